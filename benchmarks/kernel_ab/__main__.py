"""`python -m benchmarks.kernel_ab --base REF`: the CPU LayerNorm kernels of git REF against
the working tree's, both compiled into one binary and timed in turns in one process.

Why: on a shared machine whose speed changes within seconds (the 2-vCPU VM of
benchmarks/results/amd-epyc), two benchmark runs, even in turns, differed by 1.5-2x at the
same code, more than most changes measured. Here the two sides alternate pass by pass over
out-of-cache inputs and outputs, and the figure is the median over rounds of each round's
time ratio; a tree against itself (--base with no change, or --same) reads 0.95-1.06x. This is a
development tool: the published figures come from the suites (`python -m benchmarks`).

    python -m benchmarks.kernel_ab --base HEAD~1 --cases fwd:bf16:4096x1000,bwd:fp32:4096x1000

`--footprint-mib` sets the memory the input sets fill (default 128: out of every cache). A
footprint inside L2 (e.g. 0.4 with 32x1024 cases; two sets are the least) times the kernels'
own instructions with memory out of the way: a kernel about as fast in cache as out of it is
bound by its instructions, not by memory.

Each side's csrc/ is compiled with -Dfusednorm=fusednorm_base / fusednorm_head (two copies
of every inline kernel, no clash) into variant.cpp's entries; driver.cpp times them.
Prints one line per case: each side's median and fastest ms per call, and head's speed-up
(base time / head time, median over rounds, with its 20-80% quantile range).
"""
from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2}
PASSES = ("fwd", "afwd", "bwd")  # afwd: add + LayerNorm forward (the residual path)


def build_config() -> dict:
    """What fusednorm's own build compiled (setup.py writes fusednorm/_build_config.py): both
    sides are compiled with its SIMD flags, so they run the instructions the op runs."""
    path = REPO / "fusednorm" / "_build_config.py"
    config = runpy.run_path(str(path)) if path.exists() else {}
    if "CPU_SIMD_FLAGS" not in config:
        raise SystemExit("benchmarks.kernel_ab compiles with the SIMD flags of fusednorm's build: "
                         "build it first (python setup.py build_ext --inplace)")
    return config


def compile_flags(simd_flags: list[str]) -> list[str]:
    include = Path(torch.__file__).parent / "include"
    includes = [f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    return ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-w", *simd_flags, *includes]


def export_csrc(ref: str, into: Path) -> Path:
    """REF's csrc/ as a plain folder (git archive: no worktree to clean up)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "csrc"


def build(base_csrc: Path, head_csrc: Path, workdir: Path, simd_flags: list[str]) -> Path:
    cxx = os.environ.get("CXX", "c++")
    flags = compile_flags(simd_flags)
    objects = []
    for side, csrc in (("base", base_csrc), ("head", head_csrc)):
        obj = workdir / f"variant_{side}.o"
        subprocess.run([cxx, *flags, f"-I{csrc}", f"-Dfusednorm=fusednorm_{side}",
                        f"-DAB_SIDE={side}", "-c", str(HERE / "variant.cpp"), "-o", str(obj)],
                       check=True)
        objects.append(str(obj))
    binary = workdir / "kernel_ab"
    lib = Path(torch.__file__).parent / "lib"
    subprocess.run([cxx, *flags, str(HERE / "driver.cpp"), *objects, "-o", str(binary),
                    f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"], check=True)
    return binary


def parse_case(text: str) -> tuple[str, str, int, int]:
    try:
        pass_, dtype, shape = text.split(":")
        m, n = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is PASS:DTYPE:MxN, got {text!r}") from None
    if pass_ not in PASSES or dtype not in DTYPES or m < 1 or n < 1:
        raise argparse.ArgumentTypeError(
            f"a case is {'|'.join(PASSES)}:{'|'.join(DTYPES)}:MxN with M, N >= 1, got {text!r}")
    return pass_, dtype, m, n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_ab",
                                     description=__doc__.split("\n\n")[0])
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--base", help="git ref whose csrc/ is the base side")
    side.add_argument("--same", action="store_true",
                      help="the working tree on both sides (how much a null change reads)")
    parser.add_argument("--cases", default="fwd:bf16:4096x1000,bwd:fp32:4096x1000",
                        type=lambda s: [parse_case(c) for c in s.split(",")],
                        help="comma list of PASS:DTYPE:MxN (PASS fwd|afwd|bwd, "
                             "DTYPE bf16|fp16|fp32)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--footprint-mib", type=float, default=128.0,
                        help="memory the input sets fill (default 128: out of cache)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    if not args.footprint_mib > 0:
        parser.error("--footprint-mib must be positive")
    footprint = int(args.footprint_mib * (1 << 20))

    config = build_config()
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as tmp:
        workdir = Path(tmp)
        head = REPO / "csrc"
        base = head if args.same else export_csrc(args.base, workdir)
        binary = build(base, head, workdir, config["CPU_SIMD_FLAGS"])
        label = "working tree" if args.same else args.base
        print(f"base: {label}, head: working tree; {args.threads} threads, {args.rounds} rounds,"
              f" {config['CPU_CAPABILITY']} build, inputs fill {args.footprint_mib:g} MiB")
        for pass_, dtype, m, n in args.cases:
            out = subprocess.run([str(binary), pass_, str(DTYPES[dtype]), str(m), str(n),
                                  str(args.threads), str(args.rounds), str(footprint)],
                                 check=True, capture_output=True, text=True).stdout.split()
            r = dict(zip(out[0::2], (float(v) for v in out[1::2])))
            print(f"{pass_} {dtype} {m}x{n}: base {r['base_ms']:.3f} ms (fastest "
                  f"{r['base_min_ms']:.3f}), head {r['head_ms']:.3f} ms (fastest "
                  f"{r['head_min_ms']:.3f}); head speed-up {r['speedup']:.3f}x "
                  f"[{r['speedup_q20']:.3f}, {r['speedup_q80']:.3f}]")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
