"""Suite `layer_norm`: fusednorm vs torch.nn.functional.layer_norm, torch.compile of it and
Liger-Kernel (GPU, when importable), fwd / bwd / fwd+bwd, judged by the minimal bytes each
pass must move against the copy bandwidth measured in the same run.

    python -m benchmarks.bench_layer_norm [--device cpu] [--dtypes bf16] [--quick] ...
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import availability, cli, floors, harness, plotting, report, runner
from benchmarks import plan as plan_

fusednorm = availability.import_fusednorm()

SUITE = "layer_norm"
PROVIDERS = ["fusednorm", "torch", "torch.compile", "liger", floors.FRESH_COPY]
EPS = 1e-5

# CPU: a training batch of 16384 tokens at the widths of small to large models, and an odd
# width (no multiple of any vector size: the tails run); on the GPU, M*N >= 2^26 elements
# so that nothing sits in L2.
CPU_SHAPES = [(16384, 768), (16384, 2048), (16384, 4096), (4096, 1000)]
CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float64 on two of the shapes only: twice the bytes of float32 per row, and the default
# CPU run has to stay under 12 minutes on 2 cores.
CPU_FP64_SHAPES = [(16384, 768), (4096, 1000)]
# The GPU sweep of the norm suites (N = 1024-65536, the family's GPU_NS); --full adds
# N = 768 and 12288 (1.5 x 8192), left out of the default run to keep it short (issue 41).
GPU_NS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
GPU_FULL_NS = [768, 1024, 2048, 4096, 8192, 12288, 16384, 32768, 65536]
GPU_QUICK_NS = [1024, 4096, 16384]
GPU_ELEMENTS = 1 << 26
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def default_shapes(device: torch.device, quick: bool, full: bool = False) -> list[tuple[int, int]]:
    if device.type == "cpu":
        return CPU_SHAPES[:1] if quick else CPU_SHAPES
    ns = GPU_QUICK_NS if quick else GPU_FULL_NS if full else GPU_NS
    return [(math.ceil(GPU_ELEMENTS / n), n) for n in ns]


def default_dtypes(device: torch.device, quick: bool) -> list[torch.dtype]:
    if device.type == "cpu":
        return CPU_DTYPES[:2] if quick else CPU_DTYPES
    return GPU_DTYPES[:1] if quick else GPU_DTYPES


def default_cases(device: torch.device, quick: bool,
                  full: bool = False) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, M, N) of a run given no --dtypes / --shapes."""
    cases = [(dtype, M, N) for dtype in default_dtypes(device, quick)
             for M, N in default_shapes(device, quick, full)]
    if device.type == "cpu" and not quick:
        cases += [(torch.float64, M, N) for M, N in CPU_FP64_SHAPES]
    return cases


def selected_cases(args: argparse.Namespace,
                   device: torch.device) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, M, N) of the run: --dtypes x --shapes, the device's defaults for the other."""
    full = getattr(args, "full", False)
    if args.shapes or args.dtypes:
        shapes = args.shapes or default_shapes(device, args.quick, full)
        return [(dtype, M, N) for dtype in args.dtypes or default_dtypes(device, args.quick)
                for M, N, *_ in shapes]
    return default_cases(device, args.quick, full)


def minimal_bytes(M: int, N: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each pass must move at least: fwd reads x, w, b and writes y, mean, rstd;
    bwd reads x, dy, mean, rstd, w and writes dx, dw, db."""
    size = torch.finfo(dtype).bits // 8
    stats = 2 * M * (8 if dtype == torch.float64 else 4)
    fwd = 2 * M * N * size + 2 * N * size + stats
    bwd = 3 * M * N * size + stats + 3 * N * size
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def _fusednorm_layer_norm(x, weight, bias):
    return fusednorm.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def _liger_layer_norm(x, weight, bias):
    return availability.liger_layer_norm().apply(x, weight, bias, EPS)


# Specialised to each case's shape (dynamic=False): the strongest torch.compile baseline.
# The runner resets dynamo between cases, so the cache never hits its recompile limit.
FUNCTIONS = {
    "fusednorm": _fusednorm_layer_norm,
    "torch": _layer_norm,
    "torch.compile": torch.compile(_layer_norm, dynamic=False),
    "liger": _liger_layer_norm,
}


def _provider(name: str, weight, bias) -> runner.Provider:
    if name == floors.FRESH_COPY:  # the floor: not a LayerNorm, not checked
        return runner.Provider(name, floors.fresh_copy, [], check=False)
    return runner.Provider(name, functools.partial(FUNCTIONS[name], weight=weight, bias=bias),
                           [weight, bias])


def case_builder(M: int, N: int, dtype: torch.dtype, device: torch.device, names):
    """A callable that allocates and returns the Case (deferred, so one case lives at a time)."""

    def build() -> runner.Case:
        torch.manual_seed(0)
        size = torch.finfo(dtype).bits // 8
        sets = harness.input_sets_needed(2 * M * N * size, device)

        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, device=device) * scale + shift).to(dtype)

        inputs = [(rand(M, N, scale=2.0, shift=0.5).requires_grad_(), rand(M, N))
                  for _ in range(sets)]
        weight = rand(N, scale=0.5, shift=1.0).requires_grad_()
        bias = rand(N, scale=0.5).requires_grad_()

        def reference() -> list[torch.Tensor]:
            x, dy = inputs[0]
            leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
            y = _layer_norm(*leaves)
            return [y.detach(), *torch.autograd.grad(y, leaves, dy.double())]

        return runner.Case(
            dtype=dtype, fields={"M": M, "N": N}, inputs=inputs,
            providers=[_provider(name, weight, bias) for name in names],
            reference=reference,
            output_names=["y", "dx", "dweight", "dbias"], bytes=minimal_bytes(M, N, dtype),
        )

    return build


def usable_providers(wanted, device: torch.device, notes: list[str]) -> list[str]:
    """wanted minus those that cannot run here, each absence explained in notes."""
    return availability.usable_providers(wanted, PROVIDERS, device, notes, backend_op="norm_fwd",
                                         api="layer_norm", liger=availability.liger_layer_norm)


def run_providers(args: argparse.Namespace, device: torch.device) -> tuple[list[str], list[str]]:
    """The providers run(args) times on device, and the notes (cli.suite_providers)."""
    return cli.suite_providers(args, device, SUITE, PROVIDERS, usable_providers)


def check_save(args: argparse.Namespace) -> None:
    """--save's refusals of run(args), nothing timed (python -m benchmarks: every suite's
    first)."""
    cli.check_save(args, run_providers)


def run(args: argparse.Namespace) -> tuple[dict, str, Path]:
    """Runs the suite as args say; returns (results object, Markdown, results folder)."""
    out = cli.out_root(args)  # first: a bad combination fails before minutes of timing
    device = cli.resolve_device(args.device, args.cpu_memory)
    cases = selected_cases(args, device)
    names, notes = run_providers(args, device)
    for note in notes:
        print(f"[{SUITE}] {note}", file=sys.stderr)
    settings = runner.Settings(SUITE, device, args.passes, cli.budget_s(args, device),
                               stop_at=cli.stop_at(args),
                               floor_provider=floors.FRESH_COPY, floor_key=floors.FLOOR_KEY,
                               notes=notes)
    builders = [case_builder(M, N, dtype, device, names) for dtype, M, N in cases]
    result = runner.run(settings, builders, providers_per_case=len(names))
    notes += measurement_notes(device, settings.budget_s) + [floors.note(names)]
    md = report.markdown(result, ["dtype", "M", "N"], floors.columns(names), notes)
    folder = report.write(result, out, md, lambda path: draw(result, path, notes))
    return result, md, folder


def plan(args: argparse.Namespace) -> plan_.SuitePlan:
    """What run(args) would time, without running it (python -m benchmarks --plan)."""
    device = cli.plan_device(args)
    names = plan_.planned_providers(cli.wanted_providers(args, PROVIDERS, device), device)
    return plan_.SuitePlan(SUITE, device.type, args.passes, cli.budget_s(args, device), [
        plan_.PlannedCase(dtype, {"M": M, "N": N}, names,
                          plan_.norm_call_s(minimal_bytes(M, N, dtype)))
        for dtype, M, N in selected_cases(args, device)])


def draw(result: dict, path: Path, notes) -> None:
    """GB/s against the copy bandwidth, per pass and dtype: over the row length N for a
    sweep of one size M·N (the GPU's M = 2^26 / N), else over the shapes M×N."""
    shapes = list(dict.fromkeys((r["M"], r["N"]) for r in result["rows"]))
    sizes = {m * n for m, n in shapes}
    if len(shapes) > 1 and len({n for _, n in shapes}) == len(shapes) \
            and max(sizes) <= 1.01 * min(sizes):
        x = plotting.XAxis(lambda r: r["N"],
                           f"row length N (M = 2^{round(math.log2(min(sizes)))} / N rows)")
    else:
        x = plotting.XAxis(lambda r: f"{r['M']}×{r['N']}", "shape M×N (rows × row length)")
    metric = plotting.Metric("gbps", "GB/s (minimal bytes)", hline=(result["copy_gbps"], "copy (best of the run)"))
    plotting.plot(result, path, x, [metric], notes)


def measurement_notes(device: torch.device, budget_s: float) -> list[str]:
    if device.type == "cuda":
        timing = harness.gpu_timing_note(budget_s)
    else:
        timing = (f"torch.utils.benchmark.Timer.blocked_autorange on {torch.get_num_threads()} "
                  f"threads, the providers taking turns ({harness.CPU_ROUNDS} rounds of blocks each), "
                  "20/80 quantiles over blocks; inputs cycled through enough sets "
                  "to fill twice the last-level cache")
    return [
        f"Timing: {timing}. GB/s counts the minimal bytes of the pass (fwd: x, w, b, y, "
        "mean, rstd; bwd: x, dy, mean, rstd, w, dx, dw, db); % copy is that over the copy "
        "bandwidth; × torch is torch's time over the provider's. peak_mem_mb (JSON): the "
        "allocator's peak above what was allocated before the call"
        + (" (CPU: from the profiler's allocation events)" if device.type == "cpu" else "")
        + ".",
        "Every provider was checked against a float64 reference before it was timed.",
    ]


def parser() -> argparse.ArgumentParser:
    return cli.suite_parser(__doc__.splitlines()[0], PROVIDERS)


def main(argv: list[str] | None = None) -> None:
    cli.run_suite(run, parser().parse_args(argv))


if __name__ == "__main__":
    main()
