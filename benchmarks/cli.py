"""Command-line options every suite shares, and their parsing."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from . import availability, harness, runner, stamp

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64,
}
QUICK_DIR = stamp.LOCAL_DIR / "quick"


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_dtypes(text: str) -> list[torch.dtype]:
    try:
        return [DTYPES[name.lower()] for name in _csv(text)]
    except KeyError as error:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {error.args[0]!r}; use some of {sorted(set(DTYPES))}") from None


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'4096x1024,1024x4096' -> [(4096, 1024), (1024, 4096)]."""
    try:
        shapes = [tuple(int(d) for d in item.lower().split("x")) for item in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must look like 4096x1024,1024x4096; got {text!r}")
    if not shapes or any(len(s) < 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes must look like 4096x1024,1024x4096; got {text!r}")
    return shapes


def parse_passes(text: str) -> list[str]:
    passes = _csv(text)
    unknown = [p for p in passes if p not in runner.PASSES]
    if unknown or not passes:
        raise argparse.ArgumentTypeError(f"passes must be among {list(runner.PASSES)}; got {text!r}")
    return [p for p in runner.PASSES if p in passes]


def parse_seconds(text: str) -> float:
    """A positive number of seconds (--time-per-measurement)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not seconds > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds; got {text!r}")
    return seconds


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when a GPU is visible, else cpu")
    parser.add_argument("--passes", type=parse_passes, default=list(runner.PASSES),
                        help="comma list of fwd, bwd, fwd+bwd (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"few shapes, short timings (a smoke run); results to {QUICK_DIR}")
    parser.add_argument("--full", action="store_true",
                        help="GPU: the whole grid, beyond the default run's (which is sized to "
                             "finish in minutes): layer_norm at N = 768 and 12288 too, "
                             "gelu_ffn in float32 too")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help=f"results root; files go to OUT/<device>/ (default: {stamp.LOCAL_DIR}, "
                            "untracked)")
    where.add_argument("--save", action="store_true",
                       help=f"write into the committed {stamp.RESULTS_DIR}/<device>/ (the "
                            "published results: run on a quiet machine)")
    parser.add_argument("--time-per-measurement", type=parse_seconds, default=None, metavar="S",
                        help="seconds per timed measurement (default 0.35 CPU, 0.1 GPU; quick: 0.1 CPU, "
                             "0.05 GPU)")
    parser.add_argument("--stop-after", type=float, default=None, metavar="S",
                        help="start no new case after S seconds (counted from the start of "
                             "the run); the cases timed by then are written, the file says "
                             "how many were not run. For a machine lent for minutes; not "
                             "with --save")
    parser.add_argument("--cpu-memory", choices=harness.CPU_MEMORY_MODES, default="reuse",
                        help="CPU runs: 'reuse' (default): new outputs reuse freed memory, as "
                             "under a caching allocator in training; 'fresh': glibc's "
                             "defaults, outputs above 32 MiB are new, OS-zeroed pages every call")


def add_suite_arguments(parser: argparse.ArgumentParser, providers: Sequence[str]) -> None:
    parser.add_argument("--dtypes", type=parse_dtypes, default=None,
                        help="comma list among fp32, bf16, fp16, fp64 (default per device)")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma list of MxN (default per device)")
    parser.add_argument("--providers", type=_csv, default=None,
                        help=f"comma list among {', '.join(providers)} (default: all available; "
                             f"a GPU run without --full leaves out {', '.join(GPU_FULL_ONLY)})")


# Providers a GPU run times only when named or with --full: fresh-copy, the floor of an op
# into fresh outputs, measures the CPU's page faults; on the GPU the caching allocator makes
# new outputs free and it reads about the copy probe's bandwidth (docs/perf-notes.md, as above).
GPU_FULL_ONLY = ("fresh-copy",)


def wanted_providers(args: argparse.Namespace, known: Sequence[str],
                     device: torch.device) -> list[str]:
    """--providers, else the suite's providers (known) for the device."""
    if args.providers is not None:
        return list(args.providers)
    if device.type == "cuda" and not getattr(args, "full", False):
        return [p for p in known if p not in GPU_FULL_ONLY]
    return list(known)


def resolve_device(choice: str, cpu_memory: str = "reuse") -> torch.device:
    """The device to measure on; for the CPU, also applies --cpu-memory."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    if choice == "cpu":
        harness.use_cpu_memory(cpu_memory)
    return torch.device(choice)


def out_root(args: argparse.Namespace) -> Path:
    """Where results go: --out, else the committed results with --save, else the untracked
    local folder (a subfolder for --quick, so a smoke run leaves a full run's files alone)."""
    if getattr(args, "save", False):
        if args.quick:
            raise SystemExit("--save publishes results: not with --quick (a smoke run)")
        if getattr(args, "stop_after", None) is not None:
            raise SystemExit("--save publishes complete results: not with --stop-after")
        subset = subset_options(args)
        if subset:
            raise SystemExit(f"--save publishes the default run's cases and providers: not "
                             f"with {', '.join(subset)} (a subset; leave out --save, or use "
                             "--out DIR)")
        matches = stamp.build_matches_sources()
        if not matches:
            raise SystemExit(
                "--save publishes the timings of this commit's sources: "
                + ("the loaded fusednorm was built from other sources (a stale build)"
                   if matches is False else "the loaded fusednorm has no build record")
                + "; rebuild first (bash scripts/install.sh)")
        return stamp.RESULTS_DIR
    if args.out is not None:
        return args.out
    return QUICK_DIR if args.quick else stamp.LOCAL_DIR


# Options that choose a subset of a suite's run (dest, option); --full and
# --all-variant-cases add cases and are published.
SUBSET_OPTIONS = (("dtypes", "--dtypes"), ("shapes", "--shapes"), ("providers", "--providers"),
                  ("variants", "--variants"))


def subset_options(args: argparse.Namespace) -> list[str]:
    """The options of args that leave part of the default run out: --passes other than all
    three, --dtypes, --shapes, --providers, --variants."""
    found = []
    passes = getattr(args, "passes", None)
    if passes is not None and list(passes) != list(runner.PASSES):
        found.append("--passes")
    found += [option for dest, option in SUBSET_OPTIONS if getattr(args, dest, None) is not None]
    return found


def fusednorm_refusal(wanted: Sequence[str], usable: Sequence[str],
                      notes: Sequence[str]) -> str | None:
    """Why --save must not run: a fusednorm provider of the run cannot run here (no kernel
    for the device, a build without the api: availability.usable_providers left it out,
    saying why in notes), so the published files would hold no fusednorm rows (or the
    reference's); None when every one can."""
    missing = [name for name in wanted
               if (name == "fusednorm" or name.startswith("fusednorm ")) and name not in usable]
    if not missing:
        return None
    why = [note for note in notes if any(note.startswith(f"{name} not benchmarked")
                                         for name in missing)]
    return "--save publishes fusednorm's timings: not without its kernels (" + "; ".join(
        why or missing) + ")"


def peer_refusal(device_kind: str, wanted: Sequence[str],
                 available: Mapping[str, bool]) -> str | None:
    """Why --save must not run: on a GPU ("cuda"), a peer of availability.GPU_PEERS that the
    suite times (in wanted) is not available here (available[name] false or absent), so the
    published files would lack its column; None otherwise (the CPU has no such peer: Liger
    is Triton, GPU only)."""
    if device_kind != "cuda":
        return None
    missing = [name for name in wanted
               if name in availability.GPU_PEERS and not available.get(name, False)]
    if not missing:
        return None
    return ("--save on a GPU publishes fusednorm beside its peers: not without "
            + "; ".join(f"{name}: {availability.not_importable(name)}" for name in missing)
            + "; install it, or leave out --save")


def refuse_save(args: argparse.Namespace, suite: str, device: torch.device,
                wanted: Sequence[str], usable: Sequence[str], notes: Sequence[str]) -> None:
    """--save's refusals that depend on the suite's providers on the device (wanted: those
    of the run, usable: those that can run here, notes: why the others cannot):
    fusednorm_refusal and peer_refusal (a GPU peer is available where usable kept it).
    SystemExit naming the suite, before anything is timed or written; nothing without
    --save."""
    if not getattr(args, "save", False):
        return
    reasons = [reason for reason in (
        fusednorm_refusal(wanted, usable, notes),
        peer_refusal(device.type, wanted,
                     {name: name in usable for name in availability.GPU_PEERS}))
        if reason]
    if reasons:
        raise SystemExit(f"[{suite}] " + "; ".join(reasons))


def suite_providers(args: argparse.Namespace, device: torch.device, suite: str,
                    providers: Sequence[str], usable) -> tuple[list[str], list[str]]:
    """The providers a suite times on device (those args asks for that usable(wanted,
    device, notes) keeps) and the notes on those left out; SystemExit where --save refuses
    them (refuse_save)."""
    notes: list[str] = []
    wanted = wanted_providers(args, providers, device)
    names = usable(wanted, device, notes)
    refuse_save(args, suite, device, wanted, names, notes)
    return names, notes


def check_save(args: argparse.Namespace, providers) -> None:
    """Every refusal of --save for a suite's run, with nothing timed or written: out_root's
    (the run's options, the build), then those of providers(args, device) (the suite's
    function that picks its providers on the device and calls refuse_save). python -m
    benchmarks calls it for every suite before it runs any. Nothing without --save."""
    if not getattr(args, "save", False):
        return
    out_root(args)
    providers(args, resolve_device(args.device, args.cpu_memory))


def suite_parser(description: str, providers: Sequence[str]) -> argparse.ArgumentParser:
    """The command line of a suite: the common arguments and the suite's providers."""
    p = argparse.ArgumentParser(description=description)
    add_common_arguments(p)
    add_suite_arguments(p, providers)
    return p


def run_suite(run, args: argparse.Namespace) -> None:
    """A suite's main: run(args) -> (results, Markdown, folder); prints the Markdown and
    where the files went."""
    warn_unpublishable(args)
    _, md, folder = run(args)
    print(md)
    print(f"results written to {folder}", file=sys.stderr)


def warn_unpublishable(args: argparse.Namespace) -> None:
    """--save from a checkout with uncommitted changes: the files will say '-dirty'."""
    if getattr(args, "save", False) and stamp.git_commit().endswith("-dirty"):
        print("warning: --save from a checkout with uncommitted changes; the results will be "
              "stamped '<commit>-dirty'", file=sys.stderr)


def stop_at(args: argparse.Namespace) -> float | None:
    """--stop-after as a time.monotonic() deadline, fixed at the first call (python -m
    benchmarks fixes it once for all its suites)."""
    if getattr(args, "stop_after", None) is None:
        return None
    if getattr(args, "stop_at", None) is None:
        args.stop_at = time.monotonic() + args.stop_after
    return args.stop_at


def plan_device(args: argparse.Namespace) -> torch.device:
    """The device a plan (python -m benchmarks --plan) is for: --device; auto plans the GPU
    run (the one whose time is scarce), with or without a GPU here."""
    return torch.device("cpu" if args.device == "cpu" else "cuda")


# Seconds of repetitions per timed measurement. GPU: a few hundred of the norm suites' calls,
# whose medians moved no more from 0.2 s to 0.1 s than between two runs at 0.2 s
# (docs/perf-notes.md, 2026-11-27 "Where a GPU run's time goes").
BUDGET_S = {"cpu": 0.35, "cuda": 0.1}
QUICK_BUDGET_S = {"cpu": 0.1, "cuda": 0.05}


def budget_s(args: argparse.Namespace, device: torch.device) -> float:
    if args.time_per_measurement is not None:
        return args.time_per_measurement
    return (QUICK_BUDGET_S if args.quick else BUDGET_S)[device.type]
