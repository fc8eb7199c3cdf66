"""Suite `overhead`: host time per call of every public function and module, fusednorm
against the PyTorch code it replaces, on tiny tensors where the kernels cost next to
nothing: what Python, argument checks, dispatch and autograd bookkeeping cost per call.

    python -m benchmarks.bench_overhead [--device cpu] [--quick] ...

Three cases each: forward without grad, forward with inputs that require grad (the graph
is recorded), forward+backward (the add ops: both outputs get a gradient, as the norm's
output and the residual stream do in a model); the add ops' variants (a float32 residual
stream, dropout) forward+backward only. CPU: one thread. CUDA: tiny CUDA tensors, wall time of
many calls with one synchronisation at the end of each round (the launches are
asynchronous, so this is the host's time as long as the GPU keeps up, which it does on
tensors this small). fusednorm and torch alternate round by round; the figure is the
median per-call time over rounds (a forward+backward round: a quarter of the calls).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import availability, busy, cli, harness, plotting, report, stamp
from benchmarks import plan as plan_
from benchmarks.norm_variants import DROPOUT, FP32_RESIDUAL, PLAIN, Variant

fusednorm = availability.import_fusednorm()

SUITE = "overhead"
CASES = ("fwd (no grad)", "fwd (grad)", "fwd+bwd")
ROWS, D, HIDDEN = 4, 64, 256
# A fwd+bwd call costs several forwards: its rounds take calls // BACKWARD_SHARE calls, so
# that the add ops' rows left a default run's time as it was (figures: docs/perf-notes.md).
BACKWARD_SHARE = 4
# (rounds, calls per round) of each provider. CUDA: fewer calls a round than the CPU's (a
# minute less): the ratio rests on the rounds' alternation, and PyTorch's own µs moved as
# much between two CUDA runs as a quick run's fewer calls moved them (docs/perf-notes.md,
# 2026-11-27 "Where a GPU run's time goes").
ROUNDS_CALLS = {"cpu": (15, 1000), "cuda": (15, 200)}
QUICK_ROUNDS_CALLS = (5, 200)


def rounds_calls(device: torch.device, quick: bool) -> tuple[int, int]:
    return QUICK_ROUNDS_CALLS if quick else ROUNDS_CALLS[device.type]


def case_calls(case: str, calls: int) -> int:
    """Calls per round of a case (BACKWARD_SHARE)."""
    return calls // BACKWARD_SHARE if case == "fwd+bwd" else calls


def warmup_calls(calls: int) -> int:
    """Calls of each provider before its rounds (measure)."""
    return max(10, calls // 10)


@dataclass
class Api:
    """One public function or module and the PyTorch code it replaces, each a callable of
    x (giving a tensor, or the add ops' (out, sum)); params are what requires grad besides x
    in the grad cases (the add ops' residual among them)."""

    name: str
    fused: Callable[[torch.Tensor], object]
    torch: Callable[[torch.Tensor], object]
    params: list[torch.Tensor]
    dtype: torch.dtype = torch.float32  # of x
    cases: tuple[str, ...] = CASES


class _EagerBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.norm = nn.LayerNorm(D, device=block.norm.weight.device)
        self.fc1, self.fc2 = block.fc1, block.fc2
        self.norm.load_state_dict(block.norm.state_dict())

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _EagerAddNorm(nn.Module):
    """s = input + residual, then the norm module: what FusedAddLayerNorm / FusedAddRMSNorm
    replace."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, r):
        s = x + r
        return self.norm(s), s


def _eager_add(norm: Callable, variant: Variant) -> Callable:
    """(x, r) -> (norm(s), s) as eager code writes the add op's variant with the fewest ops:
    s = x + r (a float32 r promotes it: the float32 stream), F.dropout(x, p) first with
    dropout, the norm's output rounded to x's dtype where s is wider."""
    if variant.random:
        def add(x, r):
            s = F.dropout(x, variant.dropout_p) + r
            return norm(s), s
    elif variant.residual_dtype is not None:
        def add(x, r):
            s = x + r
            return norm(s).to(x.dtype), s
    else:
        def add(x, r):
            s = x + r
            return norm(s), s
    return add


def _add_apis(device: torch.device) -> list[Api]:
    """The add ops, their modules and their variants (a float32 residual stream beside
    bfloat16 x, dropout: forward+backward only), each against x + r then the norm."""
    kw = dict(device=device)
    w, b = torch.randn(D, **kw), torch.randn(D, **kw)
    ln = lambda s: F.layer_norm(s, (D,), w, b)  # noqa: E731
    rms = lambda s: F.rms_norm(s, (D,), w)  # noqa: E731
    fused = {"add_layer_norm": lambda x, r, **kwargs: fusednorm.add_layer_norm(
                 x, r, (D,), w, b, **kwargs),
             "add_rms_norm": lambda x, r, **kwargs: fusednorm.add_rms_norm(
                 x, r, (D,), w, **kwargs)}
    norms = {"add_layer_norm": (ln, [w, b]), "add_rms_norm": (rms, [w])}
    found = []
    for variant, x_dtype, cases in ((PLAIN, torch.float32, CASES),
                                    (FP32_RESIDUAL, torch.bfloat16, CASES[-1:]),
                                    (DROPOUT, torch.float32, CASES[-1:])):
        r = torch.randn(ROWS, D, device=device, dtype=variant.sum_dtype(x_dtype))
        options = variant.fused_kwargs(None)
        for name, (norm, params) in norms.items():
            op, eager = fused[name], _eager_add(norm, variant)
            found.append(Api(name if variant is PLAIN else f"{name} {variant.name}",
                             lambda x, op=op, r=r, kw=options: op(x, r, **kw),
                             lambda x, eager=eager, r=r: eager(x, r), [r, *params],
                             x_dtype, cases))
    r = torch.randn(ROWS, D, **kw)
    for fused_class, eager_class in ((fusednorm.FusedAddLayerNorm, nn.LayerNorm),
                                     (fusednorm.FusedAddRMSNorm, nn.RMSNorm)):
        module, eager = fused_class(D, **kw), _EagerAddNorm(eager_class(D, **kw))
        eager.norm.load_state_dict(module.state_dict())
        found.append(Api(fused_class.__name__, lambda x, m=module, r=r: m(x, r),
                         lambda x, m=eager, r=r: m(x, r),
                         [r, *module.parameters(), *eager.parameters()]))
    return found


def apis(device: torch.device) -> list[Api]:
    torch.manual_seed(0)
    kw = dict(device=device)
    w, b = torch.randn(D, **kw), torch.randn(D, **kw)
    # bfloat16 models (model.to(torch.bfloat16)): the call widens its parameters itself.
    w16, b16 = w.to(torch.bfloat16), b.to(torch.bfloat16)
    ffn_params = [torch.randn(HIDDEN, D, **kw) * 0.1, torch.randn(HIDDEN, **kw),
                  torch.randn(D, HIDDEN, **kw) * 0.1, torch.randn(D, **kw)]
    norm = nn.LayerNorm(D, **kw)
    fused_norm = fusednorm.FusedLayerNorm(D, **kw)
    fused_norm.load_state_dict(norm.state_dict())
    fused_ffn = fusednorm.FusedGeluFFN(D, HIDDEN, **kw)
    eager_ffn = nn.Sequential(fused_ffn.fc1, nn.GELU(), fused_ffn.fc2)
    block = fusednorm.FusedLayerNormGeluFFN(D, HIDDEN, **kw)
    eager_block = _EagerBlock(block)
    return [
        Api("layer_norm", lambda x: fusednorm.layer_norm(x, (D,), w, b),
            lambda x: F.layer_norm(x, (D,), w, b), [w, b]),
        Api("layer_norm bfloat16", lambda x: fusednorm.layer_norm(x, (D,), w16, b16),
            lambda x: F.layer_norm(x, (D,), w16, b16), [w16, b16], torch.bfloat16),
        Api("FusedLayerNorm", fused_norm, norm, [*norm.parameters(), *fused_norm.parameters()]),
        Api("rms_norm", lambda x: fusednorm.rms_norm(x, (D,), w),
            lambda x: F.rms_norm(x, (D,), w), [w]),
        *_add_apis(device),
        Api("gelu_ffn", lambda x: fusednorm.gelu_ffn(x, *ffn_params),
            lambda x: F.linear(F.gelu(F.linear(x, *ffn_params[:2])), *ffn_params[2:]),
            ffn_params),
        Api("FusedGeluFFN", fused_ffn, eager_ffn, list(fused_ffn.parameters())),
        Api("FusedLayerNormGeluFFN", block, eager_block,
            [*block.parameters(), *eager_block.norm.parameters()]),
    ]


def _call(case: str, fn, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    if case == "fwd (no grad)":
        def run():
            with torch.no_grad():
                return fn(x)
        return run
    if case == "fwd (grad)":
        return lambda: fn(x)
    outputs = fn(x)
    if isinstance(outputs, torch.Tensor):
        return lambda: torch.autograd.backward(fn(x), dy)
    # (out, sum): a gradient for each, of its dtype (a float32 stream's sum is float32).
    grads = [dy.to(out.dtype) for out in outputs]
    return lambda: torch.autograd.backward(fn(x), grads)


def _round_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    harness.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def measure(fused: Callable, reference: Callable, device: torch.device, rounds: int,
            calls: int) -> tuple[list[float], list[float]]:
    """Per-call µs of each, over `rounds` rounds that alternate between the two."""
    for fn in (fused, reference):  # warm up: caches, lazy initialisation
        _round_us(fn, warmup_calls(calls), device)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_round_us(fused, calls, device))
        theirs.append(_round_us(reference, calls, device))
    return ours, theirs


def _row(api: str, case: str, provider: str, samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"api": api, "pass": case, "provider": provider,
            "us": round(statistics.median(samples), 2), "us_p20": round(pick(0.2), 2),
            "us_p80": round(pick(0.8), 2)}


def refuse_without_fusednorm(args: argparse.Namespace, device: torch.device) -> None:
    """SystemExit (with or without --save) where fusednorm cannot run on device: the suite
    times fusednorm against PyTorch, nothing else."""
    reason = availability.fusednorm_skip_reason(device, "norm_fwd", "layer_norm")
    if reason:
        raise SystemExit(f"[{SUITE}] cannot run: {reason}")


def check_save(args: argparse.Namespace) -> None:
    """--save's refusals of run(args), nothing timed (python -m benchmarks: every suite's
    first)."""
    cli.check_save(args, refuse_without_fusednorm)


def run(args: argparse.Namespace) -> tuple[dict, str, Path]:
    out = cli.out_root(args)  # first: a bad combination fails before minutes of timing
    device = cli.resolve_device(args.device, args.cpu_memory)
    refuse_without_fusednorm(args, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = stamp.header(SUITE, device)
        if device.type == "cpu":  # as the other suites: --cpu-memory fresh keeps its own folder
            result["cpu_memory"] = harness.cpu_memory()
        cpu_start = busy.sample()
        rounds, calls = rounds_calls(device, args.quick)
        rows = []
        for api in apis(device):
            x = torch.randn(ROWS, D, device=device, dtype=api.dtype)
            dy = torch.randn(ROWS, D, device=device, dtype=api.dtype)
            for case in api.cases:
                grad = case != "fwd (no grad)"
                for p in api.params:
                    p.requires_grad_(grad)
                xg = x.clone().requires_grad_(grad)
                ours, theirs = measure(_call(case, api.fused, xg, dy), _call(case, api.torch, xg, dy),
                                       device, rounds, case_calls(case, calls))
                rows += [_row(api.name, case, "fusednorm", ours), _row(api.name, case, "torch", theirs)]
                print(f"[{SUITE}] {api.name:30s} {case:14s} fusednorm {rows[-2]['us']:8.2f} us"
                      f"  torch {rows[-1]['us']:8.2f} us", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
    for ours, theirs in zip(rows[::2], rows[1::2]):
        ours["x_torch"] = round(ours["us"] / theirs["us"], 3)
    result["rows"] = rows
    warning = busy.busy_note(cpu_start, busy.sample())  # host time: on any device
    notes = [warning] if warning else []
    if warning:
        print(f"[{SUITE}] warning: {warning}", file=sys.stderr)
    notes.append(
        f"Host µs per call on {ROWS}x{D} inputs (FFN hidden {HIDDEN}), float32 unless the api names its dtype "
        f"({FP32_RESIDUAL.name}: bfloat16 x, float32 residual and sum; {DROPOUT.name}: "
        f"dropout_p={DROPOUT.dropout_p}), "
        + ("one CPU thread" if device.type == "cpu" else "CUDA, wall time with a sync per round")
        + f"; median of {rounds} rounds of {calls} calls ({calls // BACKWARD_SHARE} for fwd+bwd) "
        "alternating fusednorm/torch. "
        "× torch = fusednorm's time over PyTorch's (lower is better; the target is ≤ 1.0: a "
        "drop-in costs no more host time than what it replaces).")
    md = markdown(result, notes)
    folder = report.write(result, out, md, lambda path: plot(result, path, notes))
    return result, md, folder


def plan(args: argparse.Namespace) -> plan_.SuitePlan:
    """What run(args) would time, without running it (python -m benchmarks --plan): no
    timed cases, rounds of host calls, two providers per api and pass."""
    device = cli.plan_device(args)
    rounds, calls = rounds_calls(device, args.quick)
    cases = [case for api in apis(torch.device("cpu")) for case in api.cases]
    host_calls = {case: 0 for case in CASES}
    for case in cases:
        n = case_calls(case, calls)
        host_calls[case] += 2 * (rounds * n + warmup_calls(n))
    return plan_.SuitePlan(SUITE, device.type, [], 0.0, host_calls=host_calls, notes=[
        f"{len(cases)} api x pass rows, fusednorm and torch alternating: {rounds} rounds of "
        f"{calls} calls each ({case_calls('fwd+bwd', calls)} for fwd+bwd; "
        f"{sum(host_calls.values())} calls in all)"])


def markdown(result: dict, notes: list[str]) -> str:
    lines = [f"# {SUITE} on {result['device']}: host time per call", "",
             f"torch {result['torch']}, commit {result['commit']}, {result['date']}", "",
             "| api | pass | fusednorm µs | torch µs | × torch |", "|---|---|---:|---:|---:|"]
    rows = result["rows"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        lines.append(f"| {ours['api']} | {ours['pass']} | {ours['us']:.2f} | {theirs['us']:.2f} "
                     f"| {ours['x_torch']:.2f} |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, notes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = result["rows"][::2]
    labels = [f"{r['api']}\n{r['pass']}" for r in ours]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ours) + 1.5))
    ax.barh(range(len(ours)), [r["x_torch"] for r in ours], color="tab:blue")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(ours)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("host time per call, fusednorm / PyTorch (lower is better)")
    ax.set_title("\n".join(plotting.stamp_lines(result, notes)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_common_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    result, md, folder = run(parser().parse_args(argv))
    print(md)
    print(f"results written to {folder}", file=sys.stderr)


if __name__ == "__main__":
    main()
