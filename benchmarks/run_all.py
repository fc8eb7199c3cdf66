"""Every suite on this machine's device (the GPU when one is visible, else the CPU), then
their Markdown tables. `python -m benchmarks --help` for the options."""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (bench_gelu_ffn, bench_layer_norm, bench_norm_family, bench_overhead, cli,
                        plan, stamp)

SUITES = {suite.SUITE: suite for suite in (bench_layer_norm, *bench_norm_family.SUITES.values(),
                                         bench_gelu_ffn, bench_overhead)}


def parse_suites(text: str) -> list[str]:
    """--suites: a comma list of at least one suite (',' alone would run nothing)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one suite among {', '.join(SUITES)}; "
                                         f"got {text!r}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run fusednorm's benchmark suites with their default shapes and dtypes "
                    "for the device; each suite's own script takes finer options.")
    cli.add_common_arguments(p)
    p.add_argument("--suites", type=parse_suites, default=list(SUITES),
                   help=f"comma list among {', '.join(SUITES)}")
    p.add_argument("--plan", action="store_true",
                   help="print what the run would time (per suite: cases, timings, "
                        "torch.compile compilations) and its estimated GPU time, and run "
                        "nothing; --device auto plans the GPU run, with or without a GPU here")
    return p


# The options of `python -m benchmarks` that every suite's own parser takes too.
SHARED = ("device", "passes", "quick", "full", "out", "save", "time_per_measurement",
          "cpu_memory", "stop_after")


def suite_arguments(module, args: argparse.Namespace) -> argparse.Namespace:
    """A suite's own arguments: its defaults, with the run's shared options."""
    suite_args = module.parser().parse_args([])
    for key in SHARED:
        if hasattr(suite_args, key):
            setattr(suite_args, key, getattr(args, key))
    return suite_args


def plans(args: argparse.Namespace) -> list[plan.SuitePlan]:
    """Each suite's plan for the run args describe."""
    return [SUITES[name].plan(suite_arguments(SUITES[name], args)) for name in args.suites]


def check_save(args: argparse.Namespace) -> None:
    """--save is all or nothing: every refusal of every suite of the run (its check_save:
    the run's options, the build, fusednorm's kernels and the GPU peers on the device), one
    SystemExit naming them all before any suite runs or writes a file."""
    if not args.save:
        return
    refusals = []
    for name in args.suites:
        module = SUITES[name]
        try:
            module.check_save(suite_arguments(module, args))
        except SystemExit as refusal:
            refusals.append(str(refusal.code))
    if refusals:
        raise SystemExit("--save: no suite run, nothing written:\n"
                         + "\n".join(dict.fromkeys(refusals)))


def failure_reason(suite: str, error: BaseException) -> str:
    """Why suite failed, on one line: the exception's type and message; a SystemExit's
    message alone, less its "[suite] " (the suite's own sentence: "cannot run: ...")."""
    if isinstance(error, SystemExit):
        if isinstance(error.code, str):
            return " ".join(error.code.split()).removeprefix(f"[{suite}] ")
        return f"exited with status {error.code or 0} before writing its results"
    message = " ".join(str(error).split())  # one line: the summary lists a suite a line
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def where_note(folder: Path, out: Path) -> str:
    """The closing line: where the files are, and how to publish them."""
    if out == stamp.RESULTS_DIR:
        return f"Results saved to {folder} (committed folder: review with git diff before committing)."
    note = f"Results in {folder}"
    if out in (stamp.LOCAL_DIR, cli.QUICK_DIR):
        note += (" (untracked). To publish them into "
                 f"{stamp.RESULTS_DIR.relative_to(stamp.REPO_ROOT)}/, rerun with --save "
                 "on a quiet machine.")
    return note


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; choose among {list(SUITES)}")
    if args.plan:
        print(plan.describe(plans(args)), end="")
        return
    out = cli.out_root(args)
    check_save(args)
    cli.warn_unpublishable(args)
    device = cli.resolve_device(args.device, args.cpu_memory)
    print(f"fusednorm benchmarks on {device.type}: {', '.join(args.suites)}", file=sys.stderr)
    if device.type == "cuda":
        estimate = plan.total_s(plans(args))
        print(f"estimated {estimate / 60:.1f} min on {plan.COSTS['device']} (python -m "
              "benchmarks --plan shows the plan)", file=sys.stderr)
    deadline = cli.stop_at(args)  # one deadline for the whole run
    failed: dict[str, str] = {}  # suite -> why it failed
    folders, not_started = [], []
    for name in args.suites:
        if deadline is not None and time.monotonic() >= deadline:
            not_started.append(name)
            continue
        module = SUITES[name]
        start = time.monotonic()
        try:
            suite_args = suite_arguments(module, args)
            suite_args.stop_at = deadline
            _, md, folder = module.run(suite_args)
        except Exception as error:  # a bug or a failed call: report, run the other suites
            traceback.print_exc()
            failed[name] = failure_reason(name, error)
        except SystemExit as error:
            # Without --save a suite's own exit (overhead's refusal where fusednorm cannot
            # run) loses only that suite. With --save it still ends the run, as it always
            # has: check_save made every refusal before the first suite ran.
            if args.save:
                raise
            failed[name] = failure_reason(name, error)
        if name in failed:
            print(f"[{name}] failed after {time.monotonic() - start:.0f} s: {failed[name]}",
                  file=sys.stderr)
            continue
        print(md)
        print(f"[{name}] {time.monotonic() - start:.0f} s; results written to {folder}",
              file=sys.stderr)
        folders.append(folder)
    for folder in dict.fromkeys(folders):
        print(where_note(folder, out), file=sys.stderr)
    if not_started:
        print(f"not started (--stop-after): {', '.join(not_started)}", file=sys.stderr)
    if failed:
        raise SystemExit(f"suite(s) failed: {', '.join(failed)}\n"
                         + "\n".join(f"  [{name}] {why}" for name, why in failed.items()))


if __name__ == "__main__":
    main()
