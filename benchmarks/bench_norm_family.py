"""Suites `rms_norm`, `add_layer_norm`, `add_rms_norm`: fusednorm against PyTorch eager (the
composite `s = x + r; norm(s)` for the add_* ops), torch.compile of it and Liger-Kernel's
RMSNorm (GPU, when importable), fwd / bwd / fwd+bwd, judged by the minimal bytes each pass
must move against the copy bandwidth measured in the same run.

    python -m benchmarks.bench_norm_family rms_norm [--device cpu] [--dtypes bf16] ...

A suite is a NormSuite: its providers' functions, its minimal bytes, its float64
reference. The cases, checks, timing and files are the shared harness's (runner, report).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import availability, bench_layer_norm, cli, floors, harness, report, runner

fusednorm = availability.import_fusednorm()

EPS = 1e-6
CPU_SHAPES = [(4096, 1024), (1024, 4096), (8192, 768)]
CPU_DTYPES = [torch.float32, torch.bfloat16]
GPU_NS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
GPU_ELEMENTS = 1 << 26
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@dataclass
class NormSuite:
    """One op's suite. Functions take (x, r, w) and return the op's differentiable outputs
    (r is None for ops without a residual)."""

    SUITE: str
    functions: dict[str, Callable]
    residual: bool
    outputs: list[str]

    def minimal_bytes(self, M: int, N: int, dtype: torch.dtype) -> dict[str, int]:
        """fwd reads x (and r), w; writes y (and s) and rstd. bwd reads x (or s), dy (and
        ds), rstd, w; writes dx (and dr: the same values, counted once) and dw."""
        size = torch.finfo(dtype).bits // 8
        rows, stats = M * N * size, M * (8 if dtype == torch.float64 else 4)
        streams = 2 if self.residual else 1
        fwd = (2 * streams) * rows + N * size + stats
        bwd = (2 + streams) * rows + stats + 2 * N * size
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}

    def parser(self) -> argparse.ArgumentParser:
        return cli.suite_parser(f"suite {self.SUITE}: " + __doc__.splitlines()[0],
                                list(self.functions))

    def run(self, args: argparse.Namespace):
        return run(self, args)


def _rms(x, r, w):
    return F.rms_norm(x, x.shape[-1:], w, EPS)


def _add_rms(x, r, w):
    s = x + r
    return F.rms_norm(s, s.shape[-1:], w, EPS), s


def _add_layer_norm(x, r, w):
    s = x + r
    return F.layer_norm(s, s.shape[-1:], w, None, EPS), s


# fusednorm with zero_centered_weight: given w - 1 (a weight of [N], not a pass over the
# rows), so that it computes what the other providers compute and passes their check.
ZERO_CENTERED = "fusednorm zero-centered"


def _liger_rms(x, r, w):
    return availability.liger_rms_norm().apply(x, w, EPS)


# torch.compile specialised to each case's shape (dynamic=False): the strongest baseline;
# the runner resets dynamo between cases.
RMS_NORM = NormSuite("rms_norm", {
    "fusednorm": lambda x, r, w: fusednorm.rms_norm(x, x.shape[-1:], w, EPS),
    ZERO_CENTERED: lambda x, r, w: fusednorm.rms_norm(x, x.shape[-1:], w - 1, EPS,
                                                      zero_centered_weight=True),
    "torch": _rms, "torch.compile": torch.compile(_rms, dynamic=False), "liger": _liger_rms,
    floors.FRESH_COPY: lambda x, r, w: floors.fresh_copy(x),
}, residual=False, outputs=["y"])
ADD_RMS_NORM = NormSuite("add_rms_norm", {
    "fusednorm": lambda x, r, w: fusednorm.add_rms_norm(x, r, x.shape[-1:], w, EPS),
    ZERO_CENTERED: lambda x, r, w: fusednorm.add_rms_norm(x, r, x.shape[-1:], w - 1, EPS,
                                                          zero_centered_weight=True),
    "torch": _add_rms, "torch.compile": torch.compile(_add_rms, dynamic=False),
    floors.FRESH_COPY: lambda x, r, w: floors.fresh_copy(x, r),
}, residual=True, outputs=["y", "s"])
ADD_LAYER_NORM = NormSuite("add_layer_norm", {
    "fusednorm": lambda x, r, w: fusednorm.add_layer_norm(x, r, x.shape[-1:], w, None, EPS),
    ZERO_CENTERED: lambda x, r, w: fusednorm.add_layer_norm(
        x, r, x.shape[-1:], w - 1, None, EPS, zero_centered_weight=True),
    "torch": _add_layer_norm, "torch.compile": torch.compile(_add_layer_norm, dynamic=False),
    floors.FRESH_COPY: lambda x, r, w: floors.fresh_copy(x, r),
}, residual=True, outputs=["y", "s"])
SUITES = {s.SUITE: s for s in (RMS_NORM, ADD_LAYER_NORM, ADD_RMS_NORM)}


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    if device.type == "cpu":
        return CPU_SHAPES[:1] if quick else CPU_SHAPES
    ns = [1024, 4096, 16384] if quick else GPU_NS
    return [(math.ceil(GPU_ELEMENTS / n), n) for n in ns]


def case_builder(suite: NormSuite, M: int, N: int, dtype, device, names):
    def build() -> runner.Case:
        torch.manual_seed(0)
        size = torch.finfo(dtype).bits // 8
        streams = 3 if suite.residual else 2
        sets = harness.input_sets_needed(streams * M * N * size, device)

        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, device=device) * scale + shift).to(dtype)

        residual = rand(M, N, scale=2.0).requires_grad_() if suite.residual else None
        weight = rand(N, scale=0.5, shift=1.0).requires_grad_()
        params = [weight] + ([residual] if suite.residual else [])
        outputs = len(suite.outputs)

        def dys():
            return tuple(rand(M, N) for _ in range(outputs)) if outputs > 1 else rand(M, N)

        inputs = [(rand(M, N, scale=2.0, shift=0.5).requires_grad_(), dys()) for _ in range(sets)]

        def reference() -> list[torch.Tensor]:
            x, dy = inputs[0]
            leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
            r = leaves[2] if suite.residual else None
            y = suite.functions["torch"](leaves[0], r, leaves[1])
            ys = list(y) if isinstance(y, tuple) else [y]
            dys_ = [d.double() for d in (dy if isinstance(dy, tuple) else (dy,))]
            return [t.detach() for t in ys] + list(torch.autograd.grad(ys, leaves, dys_))

        def provider(name):
            fn = suite.functions[name]
            if name == floors.FRESH_COPY:  # the floor: differentiable in x only, not checked
                return runner.Provider(name, lambda x: fn(x, residual, weight), [], check=False)
            return runner.Provider(name, lambda x: fn(x, residual, weight), params)

        grads = ["dx", "dweight"] + (["dresidual"] if suite.residual else [])
        return runner.Case(dtype=dtype, fields={"M": M, "N": N}, inputs=inputs,
                           providers=[provider(n) for n in names], reference=reference,
                           output_names=suite.outputs + grads,
                           bytes=suite.minimal_bytes(M, N, dtype))

    return build


def usable_providers(suite: NormSuite, wanted, device, notes: list[str]) -> list[str]:
    return availability.usable_providers(wanted, suite.functions, device, notes,
                                         backend_op="norm_fwd", api=suite.SUITE,
                                         liger=availability.liger_rms_norm)


def run(suite: NormSuite, args: argparse.Namespace):
    out = cli.out_root(args)  # first: a bad combination fails before minutes of timing
    device = cli.resolve_device(args.device, args.cpu_memory)
    shapes = args.shapes or default_shapes(device, args.quick)
    dtypes = args.dtypes or (CPU_DTYPES if device.type == "cpu"
                             else GPU_DTYPES[:1] if args.quick else GPU_DTYPES)
    notes: list[str] = []
    names = usable_providers(suite, args.providers, device, notes)
    for note in notes:
        print(f"[{suite.SUITE}] {note}", file=sys.stderr)
    settings = runner.Settings(suite.SUITE, device, args.passes, cli.budget_s(args, device),
                               stop_at=cli.stop_at(args),
                               floor_provider=floors.FRESH_COPY, floor_key=floors.FLOOR_KEY,
                               notes=notes)
    builders = [case_builder(suite, M, N, dtype, device, names)
                for dtype in dtypes for M, N, *_ in shapes]
    result = runner.run(settings, builders, providers_per_case=len(names))
    notes.append(
        "GB/s counts the minimal bytes of the pass (fwd: x" + (", r" if suite.residual else "")
        + ", w, y" + (", s" if suite.residual else "") + ", rstd; bwd: x, dy"
        + (", ds" if suite.residual else "") + ", rstd, w, dx, dw); % copy is that over the "
        "copy bandwidth of the same run; × torch is eager's time over the provider's. Every "
        "provider was checked against a float64 reference before it was timed.")
    notes.append(floors.NOTE)
    md = report.markdown(result, ["dtype", "M", "N"],
                         [report.MS, report.GBPS, report.FRESH_COPY,
                          report.SPEEDUP.without(floors.FRESH_COPY)], notes)
    # The same GB/s-against-copy plot as the layer_norm suite's.
    folder = report.write(result, out, md, lambda path: bench_layer_norm.draw(result, path, notes))
    return result, md, folder


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        raise SystemExit(f"usage: python -m benchmarks.bench_norm_family {{{','.join(SUITES)}}} ...")
    suite = SUITES[argv[0]]
    cli.run_suite(suite.run, suite.parser().parse_args(argv[1:]))


if __name__ == "__main__":
    main()
