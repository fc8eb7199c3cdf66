"""Mutation harness (a dev tool, not run in CI): `python -m tests.mutate [names...]`.

Each mutant of tests/mutants.toml is one small source patch: a file, text that must occur
in it exactly once, its replacement, and the pytest arguments that must then fail. The
harness keeps a copy of the tree (build/mutate/tree, CPU-only build, kept between runs so
that ninja recompiles only what a patch touches), and for each mutant: patches the copy,
rebuilds when the patch is in compiled code (csrc/ but not csrc/cuda, whose kernels the
emulation tests compile themselves), runs its tests, and puts the file and the build back
as they were. It reports each mutant as

  caught    its tests failed (what a mutant should do)
  survived  its tests passed: the tests miss that mistake; write a test that fails on it
  stale     its old text is not in the file exactly once (the code moved on): edit the
            patch in tests/mutants.toml
  broken    the patched tree did not build (not a test result: make the patch compile)

and before the mutants, runs each distinct test selection once on the unpatched copy (a
selection that fails there proves nothing about the mutants that use it: "invalid").
Exit status 0 only if every mutant was caught. docs/testing.md has the last score.

Options: --list (names and files only), --tree DIR (another copy), --timeout S (per test
run, default 900), --no-build (a copy whose fusednorm/ already holds a build of the
unpatched sources: no build, and only mutants that need none, i.e. the Python layer's and
the emulated CUDA kernels'; lets a second copy run those beside a first).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = os.path.join(REPO, "tests", "mutants.toml")
PYTHON = sys.executable
# Build outputs that a patch of compiled code changes, restored after each such mutant.
SNAPSHOT_DIRS = ("build",)
SNAPSHOT_SKIP = {"emulation"}  # keyed on the sources' hash by test_emulation itself


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: list[str]
    why: str = ""
    build: bool | None = None  # None: from the file (see compiled)

    @property
    def compiled(self) -> bool:
        """Whether the patch needs setup.py's build (CPU-only: csrc/cuda is not built);
        `build = false` in the table for a shared header whose patched code only the
        emulation's own compile uses."""
        if self.build is not None:
            return self.build
        return self.file.startswith("csrc/") and not self.file.startswith("csrc/cuda/")


def load_mutants(path: str = MUTANTS) -> list[Mutant]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    mutants = [Mutant(**entry) for entry in data["mutant"]]
    names = [m.name for m in mutants]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise SystemExit(f"tests/mutants.toml: duplicate names {sorted(duplicates)}")
    return mutants


def log(message: str) -> None:
    print(message, flush=True)


def sync_tree(tree: str) -> None:
    """Copies the worktree's files (tracked and untracked, not ignored) into `tree`, only
    those whose content differs, so that unchanged sources keep their timestamps."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout
    files = sorted(rel for rel in listed.decode().split("\0")
                   if rel and os.path.isfile(os.path.join(REPO, rel)))
    # Files synced before and gone from the worktree since (a renamed source) go from the
    # copy too: a patch must not land in a file that no longer exists.
    manifest = os.path.join(tree, ".mutate-files")
    if os.path.exists(manifest):
        with open(manifest) as f:
            for rel in set(f.read().splitlines()) - set(files):
                if os.path.isfile(os.path.join(tree, rel)):
                    os.remove(os.path.join(tree, rel))
    with open(manifest, "w") as f:
        f.write("\n".join(files) + "\n")
    for rel in files:
        src, dst = os.path.join(REPO, rel), os.path.join(tree, rel)
        if not os.path.isfile(src):
            continue
        with open(src, "rb") as f:
            data = f.read()
        if os.path.exists(dst):
            with open(dst, "rb") as f:
                if f.read() == data:
                    continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def build(tree: str) -> tuple[bool, str]:
    env = dict(os.environ, FUSEDNORM_CPU_ONLY="1", MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    done = subprocess.run([PYTHON, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                          capture_output=True, text=True)
    return done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def built_files(tree: str) -> list[str]:
    pkg = os.path.join(tree, "fusednorm")
    return [os.path.join(pkg, f) for f in os.listdir(pkg)
            if f.endswith(".so") or f == "_build_config.py"]


def take_snapshot(tree: str, snap: str) -> None:
    shutil.rmtree(snap, ignore_errors=True)
    os.makedirs(snap)
    for d in SNAPSHOT_DIRS:
        src = os.path.join(tree, d)
        for entry in os.listdir(src):
            if entry not in SNAPSHOT_SKIP:
                copy(os.path.join(src, entry), os.path.join(snap, d, entry))
    for path in built_files(tree):
        copy(path, os.path.join(snap, "fusednorm", os.path.basename(path)))


def restore_snapshot(tree: str, snap: str) -> None:
    """Puts back the unpatched build outputs with their timestamps (so ninja and
    setuptools see them as up to date with the restored sources)."""
    for d in SNAPSHOT_DIRS:
        for entry in os.listdir(os.path.join(snap, d)):
            target = os.path.join(tree, d, entry)
            if os.path.isdir(target):
                shutil.rmtree(target)
            copy(os.path.join(snap, d, entry), target)
    for path in built_files(tree):
        os.remove(path)
    for name in os.listdir(os.path.join(snap, "fusednorm")):
        copy(os.path.join(snap, "fusednorm", name), os.path.join(tree, "fusednorm", name))


def copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=shutil.copy2, symlinks=True)
    else:
        shutil.copy2(src, dst)


def run_tests(tree: str, args: list[str], timeout: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=tree, CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"),
               FUSEDNORM_REQUIRE_EMULATION="1")
    cmd = [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--tree", default=os.path.join(REPO, "build", "mutate", "tree"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-build", action="store_true")
    opts = parser.parse_args(argv)

    mutants = load_mutants()
    if opts.names:
        unknown = set(opts.names) - {m.name for m in mutants}
        if unknown:
            raise SystemExit(f"unknown mutants: {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in opts.names]
    if opts.no_build:
        compiled = [m.name for m in mutants if m.compiled]
        if compiled:
            raise SystemExit(f"--no-build: these mutants need a build: {compiled}")
    if opts.list:
        for m in mutants:
            log(f"{m.name:40s} {m.file}")
        return 0

    tree = os.path.abspath(opts.tree)
    snap = tree + ".snapshot"
    os.makedirs(tree, exist_ok=True)
    start = time.time()
    log(f"syncing {REPO} -> {tree}")
    sync_tree(tree)
    if not opts.no_build:
        log("building the unpatched copy (CPU-only, incremental)")
        ok, out = build(tree)
        if not ok:
            log(out)
            raise SystemExit("the unpatched tree does not build")
        take_snapshot(tree, snap)

    # Stale patches first, loudly: they are the list's maintenance, not test results.
    results: dict[str, str] = {}
    for m in mutants:
        path = os.path.join(tree, m.file)
        count = open(path).read().count(m.old) if os.path.exists(path) else -1
        if count != 1:
            where = "file missing" if count < 0 else f"old text found {count} times"
            results[m.name] = f"stale ({where})"
            log(f"!!! STALE {m.name}: {m.file}: {where}; edit tests/mutants.toml")

    baseline: dict[tuple[str, ...], tuple[int, str]] = {}
    for m in mutants:
        key = tuple(m.tests)
        if m.name in results or key in baseline:
            continue
        log(f"baseline: pytest {' '.join(key)}")
        baseline[key] = run_tests(tree, list(key), opts.timeout)
        if baseline[key][0] != 0:
            log(f"!!! baseline fails: {last_line(baseline[key][1])}")

    for m in mutants:
        if m.name in results:
            continue
        if baseline[tuple(m.tests)][0] != 0:
            results[m.name] = "invalid (its tests fail unpatched)"
            continue
        path = os.path.join(tree, m.file)
        with open(path) as f:
            original = f.read()
        stat = os.stat(path)
        t0 = time.time()
        try:
            with open(path, "w") as f:
                f.write(original.replace(m.old, m.new, 1))
            if m.compiled:
                ok, out = build(tree)
                if not ok:
                    results[m.name] = "broken (does not build)"
                    log(f"{m.name}: BROKEN\n{out[-1500:]}")
                    continue
            code, out = run_tests(tree, m.tests, opts.timeout)
            if code == 0:
                results[m.name] = "SURVIVED"
            elif code in (1, -1):
                results[m.name] = "caught" if code == 1 else "caught (timed out)"
            else:
                results[m.name] = f"invalid (pytest exit {code})"
            log(f"{m.name}: {results[m.name]} in {time.time() - t0:.0f} s: {last_line(out)}")
        finally:
            with open(path, "w") as f:
                f.write(original)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            if m.compiled:
                restore_snapshot(tree, snap)

    caught = sum(r.startswith("caught") for r in results.values())
    log("\n" + "\n".join(f"{name:40s} {result}" for name, result in results.items()))
    summary = {k: sum(r.startswith(k) for r in results.values())
               for k in ("caught", "SURVIVED", "stale", "broken", "invalid")}
    log(f"\n{caught} of {len(results)} caught; " + ", ".join(f"{k.lower()} {v}" for k, v in summary.items())
        + f" ({time.time() - start:.0f} s)")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
