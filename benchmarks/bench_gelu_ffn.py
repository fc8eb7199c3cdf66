"""Suite `gelu_ffn`: fusednorm's GELU feed-forward block y = W2·gelu(W1·x + b1) + b2
against eager nn.Sequential(Linear, GELU, Linear), torch.compile of it, and the same two
GEMMs alone without bias or activation (the floor: pct_of_gemm), fwd / bwd / fwd+bwd.

    python -m benchmarks.bench_gelu_ffn [--device cpu] [--dtypes bf16] [--quick] ...
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import availability, cli, harness, plotting, report, runner
from benchmarks import plan as plan_

fusednorm = availability.import_fusednorm()

SUITE = "gelu_ffn"
PROVIDERS = ["fusednorm", "torch", "torch.compile", "gemm-only"]
FLOOR = "gemm-only"
APPROXIMATE = "none"

# Issue 4: M = 8192 tokens, hidden = 4 d. The CPU default is smaller to fit a few minutes.
GPU_TOKENS, GPU_DS = 8192, [768, 1024, 1536, 2048, 3072, 4096, 8192]
# GPU: the default run, sized to finish in minutes (issue 41), times the 16-bit dtypes that
# training uses; --full float32 too, whose GEMMs (no TF32) took most of the suite's time.
GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_FULL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CPU_TOKENS, CPU_DS = 2048, [256, 512, 768, 1024]
CPU_DTYPES = [torch.float32]


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    if device.type == "cpu":
        tokens, ds = (1024, CPU_DS[:2]) if quick else (CPU_TOKENS, CPU_DS)
    else:
        tokens, ds = (GPU_TOKENS, [1024, 4096]) if quick else (GPU_TOKENS, GPU_DS)
    return [(tokens, d, 4 * d) for d in ds]


def default_dtypes(device: torch.device, quick: bool, full: bool = False) -> list[torch.dtype]:
    if device.type == "cpu":
        return CPU_DTYPES
    return GPU_DTYPES[:1] if quick else GPU_FULL_DTYPES if full else GPU_DTYPES


def selected_cases(args: argparse.Namespace,
                   device: torch.device) -> list[tuple[torch.dtype, int, int, int]]:
    """(dtype, M, d, hidden) of the run: --dtypes x --shapes (MxD or MxDxH; H = 4 D), the
    device's defaults for the other."""
    shapes = [s if len(s) == 3 else (s[0], s[1], 4 * s[1])
              for s in (args.shapes or default_shapes(device, args.quick))]
    dtypes = args.dtypes or default_dtypes(device, args.quick, getattr(args, "full", False))
    return [(dtype, M, d, h) for dtype in dtypes for M, d, h in shapes]


def minimal_bytes(M: int, d: int, h: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each pass must move at least: fwd reads x, W1, b1, W2, b2 and writes y and the
    pre-activation (saved for backward); bwd reads dy, x, the pre-activation, W1, W2 and
    writes dx, dW1, db1, dW2, db2."""
    size = torch.finfo(dtype).bits // 8
    weights = 2 * h * d
    fwd = size * (2 * M * d + weights + h + d + M * h)
    bwd = size * (3 * M * d + M * h + 2 * weights + h + d)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


def gemm_flops(M: int, d: int, h: int) -> dict[str, int]:
    """Multiply-adds x2 of the GEMMs: two forward, four backward (dx, dW1, dh, dW2)."""
    one = 2 * M * d * h
    return {"fwd": 2 * one, "bwd": 4 * one, "fwd+bwd": 6 * one}


def _fusednorm_provider(eager: nn.Sequential, d: int, h: int, dtype, device) -> runner.Provider:
    """FusedGeluFFN with eager's weights when the module exists, else the functional form
    on eager's own parameters."""
    fc1, fc2 = eager[0], eager[2]
    if hasattr(fusednorm, "FusedGeluFFN"):
        module = fusednorm.FusedGeluFFN(d, h, approximate=APPROXIMATE, device=device, dtype=dtype)
        module.load_state_dict({"fc1.weight": fc1.weight, "fc1.bias": fc1.bias,
                                "fc2.weight": fc2.weight, "fc2.bias": fc2.bias})
        params = [module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias]
        return runner.Provider("fusednorm", module, params)
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    return runner.Provider(
        "fusednorm",
        lambda x: fusednorm.gelu_ffn(x, *params, approximate=APPROXIMATE),
        params,
    )


def _providers(names, eager: nn.Sequential, d, h, dtype, device) -> list[runner.Provider]:
    params = [eager[0].weight, eager[0].bias, eager[2].weight, eager[2].bias]
    w1, w2 = eager[0].weight, eager[2].weight
    makers = {
        "fusednorm": lambda: _fusednorm_provider(eager, d, h, dtype, device),
        "torch": lambda: runner.Provider("torch", eager, params),
        # Specialised to the case's shape; the runner resets dynamo between cases.
        "torch.compile": lambda: runner.Provider(
            "torch.compile", torch.compile(eager, dynamic=False), params),
        FLOOR: lambda: runner.Provider(
            FLOOR, lambda x: F.linear(F.linear(x, w1), w2), [w1, w2], check=False),
    }
    return [makers[name]() for name in names]


def case_builder(M: int, d: int, h: int, dtype: torch.dtype, device: torch.device, names):
    """A callable that allocates and returns the Case (deferred, so one case lives at a time)."""

    def build() -> runner.Case:
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(d, h), nn.GELU(approximate=APPROXIMATE),
                              nn.Linear(h, d)).to(device=device, dtype=dtype)
        size = torch.finfo(dtype).bits // 8
        sets = harness.input_sets_needed(2 * M * d * size, device)
        inputs = [(torch.randn(M, d, device=device).to(dtype).requires_grad_(),
                   torch.randn(M, d, device=device).to(dtype)) for _ in range(sets)]

        def reference() -> list[torch.Tensor]:
            x, dy = inputs[0]
            model = copy.deepcopy(eager).double()
            x64 = x.detach().double().requires_grad_()
            leaves = [x64, model[0].weight, model[0].bias, model[2].weight, model[2].bias]
            y = model(x64)
            return [y.detach(), *torch.autograd.grad(y, leaves, dy.double())]

        return runner.Case(
            dtype=dtype, fields={"M": M, "N": d, "hidden": h}, inputs=inputs,
            providers=_providers(names, eager, d, h, dtype, device), reference=reference,
            output_names=["y", "dx", "dweight1", "dbias1", "dweight2", "dbias2"],
            bytes=minimal_bytes(M, d, h, dtype), flops=gemm_flops(M, d, h),
        )

    return build


def usable_providers(wanted, device: torch.device, notes: list[str]) -> list[str]:
    """wanted minus those that cannot run here, each absence explained in notes."""
    return availability.usable_providers(wanted, PROVIDERS, device, notes,
                                         backend_op="gelu_ffn_fwd", api="gelu_ffn")


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
    names, notes = run_providers(args, device)
    for note in notes:
        print(f"[{SUITE}] {note}", file=sys.stderr)
    settings = runner.Settings(SUITE, device, args.passes, cli.budget_s(args, device),
                               stop_at=cli.stop_at(args),
                               floor_provider=FLOOR, notes=notes)
    builders = [case_builder(M, d, h, dtype, device, names)
                for dtype, M, d, h in selected_cases(args, device)]
    result = runner.run(settings, builders, providers_per_case=len(names))
    notes += measurement_notes(device, settings.budget_s)
    md = report.markdown(result, ["dtype", "M", "N", "hidden"],
                         [report.MS, report.TFLOPS, report.SPEEDUP.without(FLOOR),
                          report.PEAK.without(FLOOR), report.SAVED.without(FLOOR)], notes)
    folder = report.write(result, out, md, lambda path: draw(result, path, notes))
    return result, md, folder


def plan(args: argparse.Namespace) -> plan_.SuitePlan:
    """What run(args) would time, without running it (python -m benchmarks --plan)."""
    device = cli.plan_device(args)
    names = plan_.planned_providers(cli.wanted_providers(args, PROVIDERS, device), device)
    return plan_.SuitePlan(SUITE, device.type, args.passes, cli.budget_s(args, device), [
        plan_.PlannedCase(dtype, {"M": M, "N": d, "hidden": h}, names,
                          plan_.gemm_call_s(gemm_flops(M, d, h), dtype))
        for dtype, M, d, h in selected_cases(args, device)])


def draw(result: dict, path: Path, notes) -> None:
    """TFLOP/s and peak memory over d_model, per pass and dtype."""
    tokens = sorted({r["M"] for r in result["rows"]})
    x = plotting.XAxis(lambda r: r["N"], "d_model (hidden = 4·d_model"
                       + (f", {tokens[0]} tokens)" if len(tokens) == 1 else ")"))
    metrics = [plotting.Metric("tflops", "TFLOP/s (GEMM flops)"),
               plotting.Metric("peak_mem_mb", "peak MiB", skip=(FLOOR,))]
    plotting.plot(result, path, x, metrics, notes)


def measurement_notes(device: torch.device, budget_s: float) -> list[str]:
    if device.type == "cuda":
        timing = harness.gpu_timing_note(budget_s)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        timing += f"; torch.backends.cuda.matmul.allow_tf32={tf32}"
    else:
        timing = (f"torch.utils.benchmark.Timer.blocked_autorange on {torch.get_num_threads()} "
                  f"threads, the providers taking turns ({harness.CPU_ROUNDS} rounds of blocks each), "
                  "20/80 quantiles over blocks")
    memory = ("peak MiB: PyTorch allocator's peak above what was allocated before the call"
              + (" (CPU: from the profiler's allocation events; MKL/oneDNN scratch unseen)"
                 if device.type == "cpu" else "")
              + "; saved MiB (fwd rows): what stays allocated after the forward while its "
              "output is held, less the output: the activations kept for backward (the "
              "backward's own temporaries are in its peak, not here)")
    gemm = []
    if device.type == "cuda" and os.environ.get("FUSEDNORM_DISABLE_CUBLASLT") == "1":
        gemm = ["FUSEDNORM_DISABLE_CUBLASLT=1: fusednorm's GEMMs ran on ATen's (as eager's), "
                "without cuBLASLt and its epilogues; bias, GELU and their gradients in "
                "fusednorm's own passes."]
    if device.type == "cpu" and fusednorm is not None:
        setting = os.environ.get("FUSEDNORM_CPU_GEMM")
        how = (f"set by FUSEDNORM_CPU_GEMM={setting}" if setting else
               "FUSEDNORM_CPU_GEMM unset: oneDNN's matmul on AMD AVX-512 CPUs, where it "
               "measured faster than MKL, else ATen")
        backend = setting or fusednorm.build_info().get("cpu_ffn_gemm")
        gemm = [f"fusednorm's float32 GEMMs with the tokens as the long side (forward linears, "
                f"backward dy·W2 and dh·W1) ran on {backend} ({how}); torch, torch.compile "
                "and gemm-only run ATen's GEMMs (MKL), so % GEMM above 100% is fusednorm's "
                "GEMM library beating eager's."]
    return gemm + [
        f"Timing: {timing}. M = tokens, N = d_model, hidden = 4·N, GELU exact (erf). "
        "TFLOP/s counts the GEMMs' flops only (fwd 4·M·N·hidden, bwd 8·M·N·hidden); % GEMM "
        "is the time of the same GEMMs alone (gemm-only: no bias, no activation) over the "
        "provider's time; × torch is eager's time over the provider's; " + memory + ".",
        "Every provider but gemm-only was checked against a float64 reference before it "
        "was timed.",
    ]


def parser() -> argparse.ArgumentParser:
    return cli.suite_parser(__doc__.splitlines()[0], PROVIDERS)


def main(argv: list[str] | None = None) -> None:
    cli.run_suite(run, parser().parse_args(argv))


if __name__ == "__main__":
    main()
