"""The CUDA A/B tool's variants on the emulated GPU, before a GPU times them:

    python -m tests.emulate_variant QUESTION [--variants a,b] [--pairs bf16-bf16,f32-f32]

For each variant of the question (benchmarks/cuda_ab/variants.py), a copy of csrc/ with its
edits is compiled into tests/emulation's harness (cached under build/emulation/, as the
tests' builds), which then runs the emulation tests' cases (tests/test_emulation.py) of
every pass the question's units take, for every dtype pair: each bucket and one past it,
one-element packs, misaligned views, every parameter case, RMSNorm and the residual
variants, chunked rows in three launches, clustered and capped-cluster rows, rows far from
zero, and (forward) dropout and a statistics' shift beside or among outliers / (backward)
the input gradient. Chunks are cut at the variant's own largest rows, as its harness
reports them, so each chunked case takes the path it is meant to. Prints a line per variant and pass and exits 1 if any case failed.

Not run by CI (a build of the harness a variant, about 2 minutes on two cores): its record
is the variant's entry in docs/perf-notes.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from benchmarks.cuda_ab.variants import QUESTIONS, apply_edits

from . import test_emulation as emu


def variant_tree(edits, root: str) -> str:
    """A copy of csrc/ under root with the edits made; returns its path."""
    csrc = os.path.join(root, "csrc")
    shutil.copytree(os.path.join(emu.REPO, "csrc"), csrc)
    files = {}
    for e in edits:
        with open(os.path.join(csrc, e.path)) as f:
            files.setdefault(e.path, f.read())
    for path, text in apply_edits(files, edits).items():
        with open(os.path.join(csrc, path), "w") as f:
            f.write(text)
    return csrc


def pass_cases(pass_: str, t: str, p: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(plain case lines, (case line, expected clustered launches)) of one pass and pair."""
    lines = emu.cases_for(pass_, t, p)
    lines += [line for v in emu.VARIANTS for line in emu.family_cases(pass_, t, p, v)]
    launched = emu.cluster_cases(pass_, t, p) + emu.far_cases(pass_, t, p)
    for variant in ("res", "rms res"):
        for i, (line, clustered) in enumerate(
                emu.cluster_cases(pass_, t, p, ln_grad_sum=variant == "res")):
            tokens = line.split()
            tokens[5] = emu.variant_affine(variant, i)
            launched.append((" ".join(tokens) + " " + variant, clustered))
    if pass_ == "fwd":
        launched += emu.dropout_cases(t, p, "res")
        launched += emu.outlier_cases(t, p) + emu.outlier_cases(t, p, "outliers")
    else:
        launched += emu.xgrad_cases(t, p, "res", ["xgrad drop=0.5 rowscale"])
        launched += emu.xgrad_cases(t, p, "", ["xgrad rowscale"])
    return lines, launched


def capped_ok(binary, pass_, t, p) -> None:
    """The capped-cluster cases (a device holding one or three clusters)."""
    capped = emu.capped_cluster_cases(pass_, t, p)
    code, out, err = emu.run_cases(binary, [line for line, _ in capped])
    results = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert code == 0 and len(results) == len(capped), f"exit {code}:\n{out}\n{err[-3000:]}"
    for (line, blocks), result in zip(capped, results):
        assert result.startswith(f"ok {line} |"), result
        assert result.endswith(f"cluster-blocks {blocks} clustered 1"), result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.emulate_variant",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("question", choices=sorted(QUESTIONS))
    parser.add_argument("--variants", help="comma list (default: all of the question's)")
    parser.add_argument("--pairs", help="comma list of T-P (default: every pair)")
    args = parser.parse_args(argv)
    q = QUESTIONS[args.question]
    names = args.variants.split(",") if args.variants else list(q.variants)
    pairs = ([tuple(pair.split("-")) for pair in args.pairs.split(",")] if args.pairs
             else emu.PAIRS)
    passes = sorted({u.pass_ for u in q.units})
    failed = 0
    for name in names:
        with tempfile.TemporaryDirectory() as root:
            start = time.monotonic()
            binary = emu.build_harness(emu.CACHE, csrc=variant_tree(q.variants[name], root))
            print(f"{q.name}.{name}: harness built in {time.monotonic() - start:.0f} s", flush=True)
        own = {t: emu.table_rows(binary, t) for t in emu.SIZE}
        for pass_ in passes:
            count = 0
            start = time.monotonic()
            try:
                for t, p in pairs:
                    # The pair's own tables (float parameters beside 16-bit inputs take
                    # the forward's Wide ones), each other dtype's with its own parameters.
                    emu.TABLE_ROWS = {**own, t: emu.table_rows(binary, t, p)}
                    lines, launched = pass_cases(pass_, t, p)
                    emu.check_all_ok(binary, lines)
                    emu.check_ok_with_cluster_launches(binary, launched)
                    capped_ok(binary, pass_, t, p)
                    count += len(lines) + len(launched) + 3
                status = f"{count} cases passed"
            except AssertionError as e:
                failed += 1
                status = f"FAILED at {t}-{p}:\n{e}"
            print(f"{q.name}.{name} {pass_}: {status} ({time.monotonic() - start:.0f} s)",
                  flush=True)
        emu.TABLE_ROWS = None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
