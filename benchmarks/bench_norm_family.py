"""Suites `rms_norm`, `add_layer_norm`, `add_rms_norm`: fusednorm against PyTorch eager (the
composite `s = x + r; norm(s)` for the add_* ops), torch.compile of it and Liger-Kernel's
RMSNorm and fused add + RMSNorm (GPU, when importable), fwd / bwd / fwd+bwd, judged by the
bytes each pass moves against the copy bandwidth measured in the same run. The add_* suites
also time the variants of benchmarks/norm_variants.py (a float32 residual stream, dropout,
dropout with a row scale) on a few cases (--all-variant-cases: on every case).

    python -m benchmarks.bench_norm_family rms_norm [--device cpu] [--dtypes bf16] ...
    python -m benchmarks.bench_norm_family add_rms_norm --variants fp32-residual --all-variant-cases

A suite is a NormSuite: its norm, fusednorm's op, the bytes each pass moves, its providers'
functions per variant. The cases, checks, timing and files are the shared harness's (runner,
report).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import (availability, bench_layer_norm, cli, floors, harness, norm_variants,
                        report, runner)
from benchmarks import plan as plan_
from benchmarks.norm_variants import PLAIN, VARIANTS, Variant

fusednorm = availability.import_fusednorm()

EPS = 1e-6
CPU_SHAPES = [(4096, 1024), (1024, 4096), (8192, 768)]
CPU_DTYPES = [torch.float32, torch.bfloat16]
GPU_NS, GPU_QUICK_NS = bench_layer_norm.GPU_NS, bench_layer_norm.GPU_QUICK_NS
GPU_ELEMENTS = bench_layer_norm.GPU_ELEMENTS
GPU_DTYPES = bench_layer_norm.GPU_DTYPES
# The variants other than plain, in a default run: bfloat16 (the training setup they serve) at
# the first CPU shape, on the GPU at N = 4096 (--full: 16384 too). Few, because the default
# GPU run must stay short (issue 41); --all-variant-cases times them at every case.
VARIANT_DTYPES = [torch.bfloat16]
# A quick run and a default CPU run (the longest default run already) leave out plain
# `dropout`: `dropout-rowscale` runs its path, with the scale.
FEW_VARIANTS = ["plain", "fp32-residual", "dropout-rowscale"]
VARIANT_CPU_SHAPES = CPU_SHAPES[:1]
VARIANT_GPU_NS = [4096]
VARIANT_GPU_FULL_NS = [4096, 16384]

# fusednorm with zero_centered_weight: given w - 1 (a weight of [N], not a pass over the
# rows), so that it computes what the other providers compute and passes their check. Its
# kernels are plain fusednorm's (1 + w is formed per call, [N]): a default run times it at
# the variants' few cases only, as a check of that per-call cost, to keep the default GPU
# run short (issue 41); naming it in --providers, or --all-variant-cases, times it everywhere.
ZERO_CENTERED = "fusednorm zero-centered"


@dataclass
class NormSuite:
    """One op's suite. norm(s, w): the op's norm of s (eps included), PyTorch's; fused(x, r,
    w, **options): fusednorm's op (r unused without a residual)."""

    SUITE: str
    norm: Callable
    fused: Callable
    residual: bool
    centered: bool  # LayerNorm: a mean beside rstd
    outputs: list[str]
    # Liger-Kernel's peer of the plain op, where Liger computes it: find_liger() gives its
    # autograd Function (None when Liger is absent: availability), liger(F, x, r, w) calls it.
    find_liger: Callable | None = None
    liger: Callable | None = None
    _compiled: dict = field(default_factory=dict, repr=False)

    @property
    def providers(self) -> list[str]:
        return (["fusednorm", ZERO_CENTERED, "torch", "torch.compile"]
                + (["liger"] if self.liger else []) + [floors.FRESH_COPY])

    def functions(self, variant: Variant) -> dict[str, Callable]:
        """The providers of the variant's cases, each (x, r, w, rowscale) -> the op's
        differentiable outputs: the plain cases have every provider, the others those that
        compute the variant (fusednorm, eager, compiled, the floor)."""
        if self.residual:
            eager = variant.eager(self.norm)
        else:
            def eager(x, r, w, rowscale):
                return self.norm(x, w)
        if variant.name not in self._compiled:
            # Specialised to each case's shape (dynamic=False): the strongest baseline; the
            # runner resets dynamo between cases.
            self._compiled[variant.name] = torch.compile(eager, dynamic=False)
        functions = {
            "fusednorm": lambda x, r, w, rowscale: self.fused(
                x, r, w, **variant.fused_kwargs(rowscale)),
            "torch": eager, "torch.compile": self._compiled[variant.name],
            floors.FRESH_COPY: lambda x, r, w, rowscale: floors.fresh_copy(
                x, r, variant.distinct_input_grad),
        }
        if variant is PLAIN:
            functions[ZERO_CENTERED] = lambda x, r, w, rowscale: self.fused(
                x, r, w - 1, zero_centered_weight=True)
            if self.liger:
                functions["liger"] = lambda x, r, w, rowscale: self.liger(
                    self.find_liger(), x, r, w)
        return functions

    def pass_bytes(self, M: int, N: int, dtype: torch.dtype,
                   variant: Variant = PLAIN) -> dict[str, int]:
        """The bytes each pass moves. fwd reads x (and r), w (and rowscale); writes y (and s)
        and the statistics (rstd; LayerNorm: mean too). bwd reads x (or s), dy (and ds), the
        statistics, w; writes dx (and dr; one gradient for both: the same values, counted
        once) and dw. r, s, ds and dr have the sum's dtype (fp32-residual: 4 bytes beside a
        16-bit x). A variant whose dx differs from dr (the float32 dr rounded to x's dtype;
        dropout's multipliers applied, the mask regenerated, not read) writes dx too, in the
        same pass as fusednorm's backward does (and reads rowscale). Dropout's forward moves
        nothing more: the mask is not stored."""
        size = torch.finfo(dtype).bits // 8
        wide = torch.finfo(variant.sum_dtype(dtype)).bits // 8
        stat = 8 if dtype == torch.float64 else 4
        stats = M * stat * (2 if self.centered else 1)
        rows = M * N
        if not self.residual:
            fwd = 2 * size * rows + N * size + stats
            bwd = 3 * size * rows + stats + 2 * N * size
        else:
            rowscale = M * stat if variant.rowscale else 0
            fwd = (2 * size + 2 * wide) * rows + N * size + stats + rowscale
            bwd = (size + 3 * wide) * rows + stats + 2 * N * size
            if variant.distinct_input_grad:
                bwd += size * rows + rowscale
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}

    def parser(self) -> argparse.ArgumentParser:
        p = cli.suite_parser(f"suite {self.SUITE}: " + __doc__.splitlines()[0],
                             self.providers)
        if self.residual:
            p.add_argument("--variants", type=_variants, default=None,
                           help=f"comma list among {', '.join(VARIANTS)} (default: all; "
                                f"CPU or quick: {', '.join(FEW_VARIANTS)}; "
                                "benchmarks/norm_variants.py)")
            p.add_argument("--all-variant-cases", action="store_true",
                           help="time the variants other than plain at every case of the "
                                "run, not only at the default run's few (bf16; CPU: the first "
                                f"shape; GPU: N in {VARIANT_GPU_NS}, --full: "
                                f"{VARIANT_GPU_FULL_NS})")
        return p

    def run(self, args: argparse.Namespace):
        return run(self, args)

    def check_save(self, args: argparse.Namespace) -> None:
        """--save's refusals of run(args), nothing timed (python -m benchmarks: every
        suite's first)."""
        cli.check_save(args, lambda args, device: run_providers(self, args, device))

    def plan(self, args: argparse.Namespace):
        return plan(self, args)


def _variants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"variants must be among {list(VARIANTS)}; got {text!r}")
    return names


def _layer_norm(s, w):
    return F.layer_norm(s, s.shape[-1:], w, None, EPS)


def _rms_norm(s, w):
    return F.rms_norm(s, s.shape[-1:], w, EPS)


# Liger's arguments, named (Function.apply takes them by position): offset 0 and casting
# "llama" (the norm in float32, the normalized rows rounded to x's dtype before the weight's
# product), its defaults; in_place=False, which is not LigerRMSNormFunction's default: in
# place, the backward writes dx into the dy it is given, the benchmark's input set, which
# every call must find as it was.
LIGER_OPTIONS = (0.0, "llama", False)


def _liger_rms(function, x, r, w):
    # LigerRMSNormFunction(X, W, eps, offset, casting_mode, in_place, row_mode=None).
    return function.apply(x, w, EPS, *LIGER_OPTIONS)


def _liger_add_rms(function, x, r, w):
    # (y, s). LigerFusedAddRMSNormFunction(X, R, W, eps, offset, casting_mode, in_place).
    return function.apply(x, r, w, EPS, *LIGER_OPTIONS)


RMS_NORM = NormSuite(
    "rms_norm", _rms_norm,
    lambda x, r, w, **options: fusednorm.rms_norm(x, x.shape[-1:], w, EPS, **options),
    residual=False, centered=False, outputs=["y"],
    find_liger=availability.liger_rms_norm, liger=_liger_rms)
ADD_RMS_NORM = NormSuite(
    "add_rms_norm", _rms_norm,
    lambda x, r, w, **options: fusednorm.add_rms_norm(x, r, x.shape[-1:], w, EPS, **options),
    residual=True, centered=False, outputs=["y", "s"],
    find_liger=availability.liger_fused_add_rms_norm, liger=_liger_add_rms)
ADD_LAYER_NORM = NormSuite(
    "add_layer_norm", _layer_norm,
    lambda x, r, w, **options: fusednorm.add_layer_norm(x, r, x.shape[-1:], w, None, EPS,
                                                        **options),
    residual=True, centered=True, outputs=["y", "s"])
SUITES = {s.SUITE: s for s in (RMS_NORM, ADD_LAYER_NORM, ADD_RMS_NORM)}


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    if device.type == "cpu":
        return CPU_SHAPES[:1] if quick else CPU_SHAPES
    ns = GPU_QUICK_NS if quick else GPU_NS
    return [(math.ceil(GPU_ELEMENTS / n), n) for n in ns]


def default_dtypes(device: torch.device, quick: bool) -> list[torch.dtype]:
    if device.type == "cpu":
        return CPU_DTYPES
    return GPU_DTYPES[:1] if quick else GPU_DTYPES


def variant_shapes(device: torch.device, quick: bool,
                   full: bool = False) -> list[tuple[int, int]]:
    """Where a default run times the variants other than plain."""
    if device.type == "cpu":
        return VARIANT_CPU_SHAPES
    ns = VARIANT_GPU_FULL_NS if full and not quick else VARIANT_GPU_NS
    return [(math.ceil(GPU_ELEMENTS / n), n) for n in ns]


def cases(suite: NormSuite, args: argparse.Namespace, device: torch.device,
          notes: list[str]) -> list[tuple[torch.dtype, int, int, Variant]]:
    """(dtype, M, N, variant) of the run: plain at every dtype and shape (--dtypes,
    --shapes, else the device's defaults); each other variant of --variants at the dtypes
    that --dtypes names, and the shapes that --shapes names, else at the run's defaults with
    --all-variant-cases, else at the default run's few (VARIANT_*)."""
    shapes = [s[:2] for s in args.shapes] if args.shapes else default_shapes(device, args.quick)
    dtypes = args.dtypes or default_dtypes(device, args.quick)
    every = getattr(args, "all_variant_cases", False)
    variant_grid = (args.dtypes or (dtypes if every else VARIANT_DTYPES),
                    shapes if args.shapes or every
                    else variant_shapes(device, args.quick, getattr(args, "full", False)))
    if not suite.residual:
        names = [PLAIN.name]
    else:
        few = args.quick or device.type == "cpu"
        names = args.variants or (FEW_VARIANTS if few else list(VARIANTS))
    selected = [VARIANTS[n] for n in names]
    found = []
    for variant in selected:
        grid_dtypes, grid_shapes = (dtypes, shapes) if variant is PLAIN else variant_grid
        left_out = [d for d in grid_dtypes if not variant.applies_to(d)]
        if left_out:
            notes.append(f"variant {variant.name} not timed at "
                         + ", ".join(str(d).removeprefix("torch.") for d in left_out)
                         + ": it is another computation only beside a 16-bit input")
        found += [(d, M, N, variant) for d in grid_dtypes if variant.applies_to(d)
                  for M, N in grid_shapes]
    return found


def case_fields(suite: NormSuite, M: int, N: int, variant: Variant) -> dict:
    """A case's row fields after dtype."""
    return {"M": M, "N": N} | ({"variant": variant.name} if suite.residual else {})


def with_providers(suite: NormSuite, args: argparse.Namespace, device: torch.device,
                   names: list[str], run_cases) -> list[tuple]:
    """(dtype, M, N, variant, providers) of each case: those of names that compute the
    variant (NormSuite.functions), zero-centered fusednorm only at the variants' few cases
    unless the providers are named or --all-variant-cases is given."""
    # Naming the providers is asking for this one.
    everywhere = args.providers is not None or getattr(args, "all_variant_cases", False)
    few = (set(VARIANT_DTYPES),
           set(variant_shapes(device, args.quick, getattr(args, "full", False))))

    def timed(name, dtype, M, N):
        return name != ZERO_CENTERED or everywhere or (dtype in few[0] and (M, N) in few[1])

    return [(dtype, M, N, variant, [n for n in names if n in suite.functions(variant)
                                    and timed(n, dtype, M, N)])
            for dtype, M, N, variant in run_cases]


def plan(suite: NormSuite, args: argparse.Namespace) -> plan_.SuitePlan:
    """What run(suite, args) would time, without running it (python -m benchmarks --plan)."""
    device = cli.plan_device(args)
    names = list(plan_.planned_providers(cli.wanted_providers(args, suite.providers, device),
                                         device))
    planned = plan_.SuitePlan(suite.SUITE, device.type, args.passes, cli.budget_s(args, device))
    for dtype, M, N, variant, case_names in with_providers(
            suite, args, device, names, cases(suite, args, device, planned.notes)):
        planned.cases.append(plan_.PlannedCase(
            dtype, case_fields(suite, M, N, variant), tuple(case_names),
            plan_.norm_call_s(suite.pass_bytes(M, N, dtype, variant))))
    return planned


def _probe(suite: NormSuite, variant: Variant, dtype: torch.dtype, device: torch.device):
    """A tiny forward and backward of fusednorm with the variant's options."""
    x = torch.randn(4, 16, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(4, 16, device=device, dtype=variant.sum_dtype(dtype), requires_grad=True)
    w = torch.rand(16, device=device, dtype=dtype, requires_grad=True)
    rowscale = norm_variants.rowscale_for(variant, 4, dtype, device)
    outputs = suite.fused(x, r, w, **variant.fused_kwargs(rowscale))
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def providers_of(suite: NormSuite, variant: Variant, dtype: torch.dtype, names: list[str],
                 device: torch.device, notes: list[str], probed: dict) -> list[str]:
    """The providers among names that time the variant's cases at dtype: those that compute
    it (NormSuite.functions) and, for fusednorm, a build that accepts its options (an older
    one is reported as such in notes, once, not crashed on)."""
    usable = [n for n in names if n in suite.functions(variant)]
    if variant is PLAIN or "fusednorm" not in usable:
        return usable
    key = (variant.name, dtype)
    if key not in probed:
        probed[key] = availability.call_skip_reason(
            lambda: _probe(suite, variant, dtype, device),
            f"fusednorm.{suite.SUITE}(..., {variant.options}) at "
            f"{str(dtype).removeprefix('torch.')}")
        if probed[key]:
            notes.append(f"fusednorm not benchmarked on variant {variant.name}: {probed[key]}")
    return [n for n in usable if n != "fusednorm" or not probed[key]]


def case_builder(suite: NormSuite, variant: Variant, M: int, N: int, dtype, device, names):
    def build() -> runner.Case:
        torch.manual_seed(0)
        wide = variant.sum_dtype(dtype)
        size, wide_size = torch.finfo(dtype).bits // 8, torch.finfo(wide).bits // 8
        streams = 2 * size + wide_size if suite.residual else 2 * size  # x, dy (and ds)
        sets = harness.input_sets_needed(streams * M * N, device)

        def rand(*shape, scale=1.0, shift=0.0, dtype=dtype):
            return (torch.randn(*shape, device=device) * scale + shift).to(dtype)

        residual = rand(M, N, scale=2.0, dtype=wide).requires_grad_() if suite.residual else None
        weight = rand(N, scale=0.5, shift=1.0).requires_grad_()
        rowscale = norm_variants.rowscale_for(variant, M, dtype, device)
        params = [weight] + ([residual] if suite.residual else [])

        def dys():  # the gradient of each output, in that output's dtype
            return (rand(M, N), rand(M, N, dtype=wide)) if suite.residual else rand(M, N)

        inputs = [(rand(M, N, scale=2.0, shift=0.5).requires_grad_(), dys()) for _ in range(sets)]

        def reference(outputs=None) -> list[torch.Tensor]:
            """float64 outputs and gradients; with dropout, those of the mask that the
            provider's outputs show it drew (norm_variants.kept_mask)."""
            x, dy = inputs[0]
            leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
            if suite.residual:
                h = leaves[0]
                if variant.random:
                    dx, dresidual = outputs[len(suite.outputs)], outputs[len(suite.outputs) + 2]
                    kept = norm_variants.kept_mask(dx, variant.dropout_p, dresidual)
                    h = h * kept / (1 - variant.dropout_p)
                if rowscale is not None:
                    h = h * rowscale.double()[:, None]
                s = h + leaves[2]
                ys = [suite.norm(s, leaves[1]), s]
            else:
                ys = [suite.norm(leaves[0], leaves[1])]
            dys_ = [d.double() for d in (dy if isinstance(dy, tuple) else (dy,))]
            return [t.detach() for t in ys] + list(torch.autograd.grad(ys, leaves, dys_))

        functions = suite.functions(variant)

        def provider(name):
            fn = functions[name]

            def forward(x):
                return fn(x, residual, weight, rowscale)
            if name == floors.FRESH_COPY:  # the floor: differentiable in x only, not checked
                return runner.Provider(name, forward, [], check=False)
            return runner.Provider(name, forward, params)

        grads = ["dx", "dweight"] + (["dresidual"] if suite.residual else [])
        return runner.Case(dtype=dtype, fields=case_fields(suite, M, N, variant), inputs=inputs,
                           providers=[provider(n) for n in names], reference=reference,
                           reference_per_provider=variant.random,
                           output_names=suite.outputs + grads,
                           bytes=suite.pass_bytes(M, N, dtype, variant))

    return build


def usable_providers(suite: NormSuite, wanted, device, notes: list[str]) -> list[str]:
    return availability.usable_providers(wanted, suite.providers, device, notes,
                                         backend_op="norm_fwd", api=suite.SUITE,
                                         liger=suite.find_liger)


def bytes_notes(suite: NormSuite, variants: list[Variant]) -> list[str]:
    """What the GB/s of the suite's rows count, and what each variant computes."""
    r = suite.residual
    stats = "mean, rstd" if suite.centered else "rstd"
    notes = [
        "GB/s counts the bytes each pass moves (fwd: x" + (", r" if r else "") + ", w, y"
        + (", s" if r else "") + f", {stats}; bwd: " + ("s" if r else "x") + ", dy"
        + (", ds" if r else "") + f", {stats}, w, dx" + (" (= dr, counted once)" if r else "")
        + ", dw); % copy is that over the copy bandwidth of the same run; × torch is eager's "
        "time over the provider's. Every provider was checked against a float64 reference "
        "before it was timed."]
    others = [v for v in variants if v is not PLAIN]
    if r:
        notes.append("variant: " + "; ".join(f"`{v.name}`: {v.description}" for v in variants)
                     + ". n/a: a provider not timed at that case (fusednorm zero-centered"
                     + (", liger" if suite.liger else "") + ": plain only; one skipped at a "
                     "case is named in these notes).")
    notes.append("fusednorm zero-centered (the same kernels as fusednorm, 1 + w formed per "
                 "call) is timed, in a default run, only at the variants' few cases (bf16): "
                 "--providers naming it, or --all-variant-cases, time it at every case.")
    if others:
        notes.append(
            "Variants' bytes: r, s, ds and dr in the sum's dtype (fp32-residual: 4 bytes); "
            "fusednorm's backward forms dx from dr in a pass of its own (the rounding of a "
            "float32 dr to x's dtype; dropout's multipliers, its mask regenerated from the "
            "forward's seed, not stored), and bwd counts that pass: dr read again and dx "
            "written (and rowscale, [M], read in fwd and bwd). Dropout's forward moves no more "
            "bytes than plain's. Dropout providers are checked against the float64 result of "
            "the mask each drew (its dx is zero where it dropped; an element whose dr is "
            "zero counts as kept; it must keep 1 - p of the elements).")
    return notes


def draw(result: dict, path: Path, notes) -> None:
    """bench_layer_norm's plot, a row of panels per dtype and variant (plain: the dtype)."""
    rows = [dict(r, dtype=r["dtype"] if r.get("variant", PLAIN.name) == PLAIN.name
                 else f"{r['dtype']} {r['variant']}") for r in result["rows"]]
    bench_layer_norm.draw(dict(result, rows=rows), path, notes)


def run_providers(suite: NormSuite, args: argparse.Namespace,
                  device: torch.device) -> tuple[list[str], list[str]]:
    """The providers run(suite, args) times on device, and the notes (cli.suite_providers)."""
    return cli.suite_providers(
        args, device, suite.SUITE, suite.providers,
        lambda wanted, device, notes: usable_providers(suite, wanted, device, notes))


def run(suite: NormSuite, args: argparse.Namespace):
    out = cli.out_root(args)  # first: a bad combination fails before minutes of timing
    device = cli.resolve_device(args.device, args.cpu_memory)
    names, notes = run_providers(suite, args, device)
    run_cases = cases(suite, args, device, notes)
    probed: dict = {}
    builders = [case_builder(suite, variant, M, N, dtype, device,
                             providers_of(suite, variant, dtype, case_names, device, notes,
                                          probed))
                for dtype, M, N, variant, case_names in with_providers(suite, args, device,
                                                                       names, run_cases)]
    for note in notes:
        print(f"[{suite.SUITE}] {note}", file=sys.stderr)
    settings = runner.Settings(suite.SUITE, device, args.passes, cli.budget_s(args, device),
                               stop_at=cli.stop_at(args),
                               floor_provider=floors.FRESH_COPY, floor_key=floors.FLOOR_KEY,
                               notes=notes)
    result = runner.run(settings, builders, providers_per_case=len(names))
    notes += bytes_notes(suite, list(dict.fromkeys(v for *_, v in run_cases)))
    notes.append(floors.note(names))
    keys = ["dtype", "M", "N"] + (["variant"] if suite.residual else [])
    md = report.markdown(result, keys, floors.columns(names), notes)
    folder = report.write(result, out, md, lambda path: draw(result, path, notes))
    return result, md, folder


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        raise SystemExit(f"usage: python -m benchmarks.bench_norm_family {{{','.join(SUITES)}}} ...")
    suite = SUITES[argv[0]]
    cli.run_suite(suite.run, suite.parser().parse_args(argv[1:]))


if __name__ == "__main__":
    main()
