"""`python -m benchmarks.cuda_ab`: variants of the CUDA norm kernels (benchmarks/cuda_ab/
variants.py: bucket tables, launch bounds, rows per block, Welford lanes) compiled side by
side with the unedited tree and timed in turns against it and a copy of the same bytes, over
a sweep of N and dtypes, in one process: one device call answers several questions.

    python -m benchmarks.cuda_ab list
    python -m benchmarks.cuda_ab build [--questions a,b]      compile only (no GPU needed)
    python -m benchmarks.cuda_ab pack [--questions a,b] [--to FILE]
                                     build, then the libraries in one tar.xz (no GPU needed)
    python -m benchmarks.cuda_ab run [--questions a,b] [--n 1024,4096] [--tags bf16]
                                     [--rounds 15] [--seed 0] [--out DIR] [--prebuilt FILE]

The libraries use nothing of torch's at run time, so a pack made on a machine without a GPU
(TORCH_CUDA_ARCH_LIST naming the GPU's arch, e.g. 9.0a) runs on a GPU machine with another
torch: `run --prebuilt FILE` unpacks it and compiles only the variants whose sources differ.

`run` builds what is missing, then prints and writes DIR/cuda_ab.json (stamped as the
suites' files: benchmarks/stamp.py) and DIR/cuda_ab.md, rewritten after each case (a sweep
cut short keeps what it timed): per question, each provider's % of
copy and its speed over base (x_base > 1: faster); a variant whose output is off the float64
reference beyond twice base's error is marked "!" (and "ok": false in the JSON). Each round
times every provider once, in an order drawn from --seed and the case (sweep.time_in_turns);
base_again is base timed again as a provider of its own, its x_base the run's noise floor.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import build, sweep
from .variants import QUESTIONS


def _questions(text: str | None):
    names = list(QUESTIONS) if not text else text.split(",")
    unknown = [n for n in names if n not in QUESTIONS]
    if unknown:
        raise SystemExit(f"unknown questions {unknown}; known: {', '.join(QUESTIONS)}")
    return [QUESTIONS[n] for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_ab",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the questions and their variants")
    for name in ("build", "pack", "run"):
        p = sub.add_parser(name)
        p.add_argument("--questions", help="comma list (default: all)")
        p.add_argument("--workdir", type=Path, default=build.DEFAULT_WORKDIR)
        p.add_argument("--jobs", type=int, help="compiler jobs per variant, at most (default: CPU count)")
        p.add_argument("--prebuilt", type=Path, help="a pack to unpack into --workdir first")
    sub.choices["pack"].add_argument("--to", type=Path, default=Path("cuda_ab_pack.tar.xz"))
    run = sub.choices["run"]
    run.add_argument("--n", default=",".join(map(str, sweep.DEFAULT_N)),
                     type=lambda s: [int(v) for v in s.split(",")])
    run.add_argument("--tags", type=lambda s: set(s.split(",")), help="input dtypes (bf16,f32..)")
    run.add_argument("--elements", type=int, default=sweep.DEFAULT_ELEMENTS,
                     help="elements per tensor (M = elements // N)")
    run.add_argument("--rounds", type=int, default=sweep.DEFAULT_ROUNDS)
    run.add_argument("--seed", type=int, default=0,
                     help="seeds each case's orders of the turns (with the case)")
    run.add_argument("--out", type=Path, default=Path("bench-out") / "cuda_ab")
    one = sub.add_parser("build-one", help="(internal) one variant of the plan in --workdir")
    one.add_argument("variant")
    one.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "list":
        for q in QUESTIONS.values():
            units = ", ".join(f"{u.kind} {u.label} {u.tag}" for u in q.units)
            print(f"{q.name}: {', '.join(q.variants)}  [{units}]\n    {q.why}")
        return
    if args.command == "build-one":
        edits, units = build.read_plan(args.workdir)[args.variant]
        build.build_one(args.variant, edits, units, args.workdir, verbose=True)
        return

    questions = _questions(args.questions)
    plan = sweep.build_plan(questions)
    if args.prebuilt:
        unpacked = build.unpack(args.prebuilt, args.workdir)
        print(f"unpacked {len(unpacked)} files of {args.prebuilt} into {args.workdir}", flush=True)
    print(f"building {len(plan)} variants in {args.workdir}: {', '.join(plan)}", flush=True)
    seconds = build.build_all(plan, args.workdir, args.jobs)
    print("built in " + ", ".join(f"{v} {s:.0f} s" for v, s in seconds.items()), flush=True)
    if args.command == "pack":
        names = build.pack(plan, args.workdir, args.to)
        print(f"packed {len(names)} files into {args.to} ({args.to.stat().st_size / 1e6:.1f} MB)")
        return
    if args.command == "build":
        return

    import torch

    from ..stamp import header

    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.cuda_ab run needs a CUDA GPU (build does not)")
    modules = {v: build.import_built(v, args.workdir) for v in plan}
    result = header("cuda_ab", torch.device("cuda"))
    result["definition"] = ("pct_of_copy: a copy_ of the pass's least bytes (fwd: x in, y "
                            "out; bwd: dy and x (and grad_sum) in, dx out) over the "
                            "provider's time, x 100; x_base: base's time over the provider's; "
                            f"medians of {args.rounds} rounds in turns, each round's order from "
                            "a Williams design shuffled by random.Random(f'{seed} {case}'), "
                            f"seed {args.seed}, the round's first sample discarded; "
                            f"{sweep.AA}: base timed again as its own provider (its x_base: "
                            "the run's noise floor)")
    result["questions"] = {q.name: {"why": q.why, "variants": {
        v: [vars(e) for e in edits] for v, edits in q.variants.items()}} for q in questions}
    result["rows"] = []
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> str:
        """The files as they stand: rewritten after each case, so that a sweep cut short
        (a device call's deadline) leaves the rows it timed."""
        (args.out / "cuda_ab.json").write_text(json.dumps(result, indent=1) + "\n")
        table = sweep.markdown(result["rows"])
        (args.out / "cuda_ab.md").write_text(
            f"# CUDA A/B: {result['device']}, commit {result['commit']}, {result['date']}\n\n"
            + table)
        return table

    start = time.monotonic()
    for case in sweep.cases(questions, args.n, args.elements, args.tags):
        q = QUESTIONS[case.question]
        mine = {sweep.BASE: modules[sweep.BASE]}
        mine.update({sweep.variant_id(q.name, v): modules[sweep.variant_id(q.name, v)]
                     for v in q.variants})
        case_rows = sweep.run_case(case, mine, args.rounds, seed=f"{args.seed} {case}")
        result["rows"] += case_rows
        write()
        line = ", ".join(f"{r['provider'].split('__')[-1]} {r['pct_of_copy']:.1f}%"
                         f"{'' if r['ok'] else ' (off the reference!)'}" for r in case_rows)
        print(f"[{time.monotonic() - start:6.1f} s] {case.question} {case.unit.kind} "
              f"{case.unit.label} {case.unit.tag} {case.M}x{case.N}: {line}", flush=True)
    # Registers and spills (cuobjdump, seconds a module): after the timings, which matter more.
    result["kernels"] = build.kernel_resources(modules)
    for v, kernels in result["kernels"].items():
        spills = [k for k in kernels if k["spills"]]
        print(f"{v}: {len(kernels)} row kernels, registers up to "
              f"{max((k['registers'] for k in kernels), default=0)}, spilling: "
              f"{', '.join(k['kernel'] for k in spills) or 'none'}", flush=True)
    print(write())
    sys.stdout.flush()

if __name__ == "__main__":
    main()
