"""The loop every suite shares: for each case, check each provider against a float64
reference, then time fwd, bwd and fwd+bwd side by side and measure peak memory; returns the
results object of docs/DESIGN.md."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import busy, checks, gpu_timer, harness, stamp

PASSES = ("fwd", "bwd", "fwd+bwd")


@dataclass
class Provider:
    """One implementation under test: y = forward(x), differentiable in x and params; y
    may be a tuple of outputs (then each input set's dy is a tuple too)."""

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.Tensor]
    check: bool = True  # False for a floor (e.g. GEMMs alone) that computes something else


@dataclass
class Case:
    """One shape and dtype: input sets to cycle through, the providers, the float64
    reference of (y, dx, d params...), and the minimal bytes / flops of each pass."""

    dtype: torch.dtype
    fields: dict[str, int | str]  # row fields after dtype, e.g. {"M": 4096, "N": 1024}
    inputs: list[tuple[torch.Tensor, torch.Tensor]]  # (x with requires_grad, dy)
    providers: list[Provider]
    reference: Callable[..., list[torch.Tensor]]
    output_names: list[str]
    bytes: dict[str, int]
    flops: dict[str, int] | None = None
    # An op that draws random numbers (dropout) has no reference of its own: then
    # reference(outputs) gives the one of a provider's (y, dx, d params...), reading from
    # them the draws it must reproduce, and raises ValueError when the draws are implausible.
    reference_per_provider: bool = False


@dataclass
class Settings:
    suite: str
    device: torch.device
    passes: Sequence[str]
    budget_s: float  # rough time per timed measurement
    floor_provider: str | None = None  # rows get <floor_key>: the floor's time over theirs
    floor_key: str = "pct_of_gemm"
    notes: list[str] = field(default_factory=list)
    stop_at: float | None = None  # time.monotonic() after which no new case starts


def _sig(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def _as_list(t) -> list[torch.Tensor]:
    return list(t) if isinstance(t, (tuple, list)) else [t]


def _grad(y, leaves, dy, retain_graph=False):
    return torch.autograd.grad(_as_list(y), leaves, _as_list(dy), retain_graph=retain_graph)


def _fwd_bwd(provider: Provider, x: torch.Tensor, dy) -> list[torch.Tensor]:
    y = provider.forward(x)
    return [*(t.detach() for t in _as_list(y)), *_grad(y, [x, *provider.params], dy)]


def _calls(pass_name: str, provider: Provider, inputs) -> list[Callable[[], object]]:
    """One callable per input set that runs the pass once."""
    if pass_name == "fwd":
        return [lambda x=x: provider.forward(x) for x, _ in inputs]
    if pass_name == "bwd":
        calls = []
        for x, dy in inputs:
            y, leaves = provider.forward(x), [x, *provider.params]
            calls.append(
                lambda y=y, leaves=leaves, dy=dy: _grad(y, leaves, dy, retain_graph=True)
            )
        return calls
    return [
        lambda x=x, dy=dy: _grad(provider.forward(x), [x, *provider.params], dy)
        for x, dy in inputs
    ]


def _memory_mb(pass_name: str, call, device: torch.device) -> tuple[float | None, float | None]:
    """(peak MiB of one call, MiB it saves for backward): the saved figure, for the fwd
    pass only, is what stays allocated while its result is held, less the outputs."""
    measured = harness.memory_mb(call, device)
    if measured is None:
        return None, None
    peak, retained = measured
    if pass_name != "fwd":
        return peak, None
    outputs = _as_list(call())
    output_mb = sum(t.untyped_storage().nbytes() for t in outputs) / 2**20
    del outputs
    return peak, max(0.0, retained - output_mb)


def _timing_order(passes: Sequence[str]) -> list[str]:
    """bwd last: its compiled graphs are built differently (see _graphs_for)."""
    return sorted(passes, key=lambda p: p == "bwd")


@contextlib.contextmanager
def _graphs_for(pass_name: str):
    """Context for building a pass's callables. The bwd pass runs backward many times over
    one retained graph, which torch.compile's donated buffers forbid: for it, compiled
    functions are recompiled without them (and reset afterwards, so that any later pass
    recompiles with the defaults)."""
    if pass_name != "bwd":
        yield
        return
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        yield
    torch._dynamo.reset()


def _check_providers(case: Case, settings: Settings, log) -> list[Provider]:
    """The providers whose fwd+bwd on the first input set matches the reference."""
    reference = None if case.reference_per_provider else case.reference()
    x, dy = case.inputs[0]
    errors: dict[str, list[float]] = {}
    problems: dict[str, str] = {}
    for provider in case.providers:
        try:
            outputs = _fwd_bwd(provider, x, dy)
            harness.synchronize(settings.device)
        except Exception as error:  # a provider that cannot run this case is skipped
            problems[provider.name] = f"raised {type(error).__name__}: {error}"
            continue
        if provider.check:
            try:
                expected = case.reference(outputs) if reference is None else reference
            except ValueError as error:
                problems[provider.name] = f"wrong result: {error}"
                continue
            errors[provider.name] = [
                checks.relative_error(out, ref) for out, ref in zip(outputs, expected)
            ]
    baseline = errors.get("torch")
    for name, errs in errors.items():
        bad = checks.failures(case.output_names, errs, baseline, case.dtype)
        if bad:
            problems[name] = "wrong result: " + "; ".join(bad)
    where = f"{case.dtype} " + " ".join(f"{k}={v}" for k, v in case.fields.items())
    for name, problem in problems.items():
        message = f"SKIPPED {name} at {where}: {problem}"
        settings.notes.append(message)
        log(message)
    return [p for p in case.providers if p.name not in problems]


def _row(case: Case, pass_name: str, provider: str, timing, peak_mb, saved_mb,
         copy_gbps: float) -> dict:
    row = {"pass": pass_name, "dtype": str(case.dtype).removeprefix("torch.")}
    row.update(case.fields)
    row.update(provider=provider, ms=_sig(timing.ms), ms_p20=_sig(timing.ms_p20),
               ms_p80=_sig(timing.ms_p80))
    if timing.host_ms is not None:
        row["host_ms"] = _sig(timing.host_ms)
    row["_bytes"] = case.bytes[pass_name]
    row["_copy_gbps"] = copy_gbps
    if case.flops is not None:
        row["_flops"] = case.flops[pass_name]
    row["peak_mem_mb"] = _sig(peak_mb)
    row["saved_mb"] = _sig(saved_mb)
    return row


def _finish_rows(rows: list[dict], settings: Settings) -> list[dict]:
    """Adds the derived figures (GB/s, % of the copy bandwidth timed in turns with the row,
    TFLOP/s, % of the floor), in the key order of docs/DESIGN.md."""
    floor_ms = {}
    if settings.floor_provider:
        for row in rows:
            if row["provider"] == settings.floor_provider:
                floor_ms[_case_key(row)] = row["ms"]
    finished = []
    for row in rows:
        seconds = row["ms"] * 1e-3
        gbps = row["_bytes"] / seconds / 1e9
        out = {k: v for k, v in row.items()
               if not k.startswith("_") and k not in ("peak_mem_mb", "saved_mb")}
        copy_gbps = row["_copy_gbps"]
        out.update(gbps=_sig(gbps), pct_of_copy=_sig(100 * gbps / copy_gbps, 3),
                   copy_gbps=_sig(copy_gbps))
        if "_flops" in row:
            out["tflops"] = _sig(row["_flops"] / seconds / 1e12)
        if settings.floor_provider:
            floor = floor_ms.get(_case_key(row))
            out[settings.floor_key] = None if floor is None else _sig(100 * floor / row["ms"], 3)
        out["peak_mem_mb"] = row["peak_mem_mb"]
        out["saved_mb"] = row["saved_mb"]
        finished.append(out)
    return finished


def _case_key(row: dict) -> tuple:
    return tuple((k, v) for k, v in row.items() if k not in _MEASURED and not k.startswith("_"))


_MEASURED = {"provider", "ms", "ms_p20", "ms_p80", "host_ms", "gbps", "pct_of_copy", "copy_gbps", "tflops",
             "pct_of_gemm", "pct_of_fresh_copy", "peak_mem_mb", "saved_mb"}


def run(
    settings: Settings,
    case_builders: Sequence[Callable[[], Case]],
    providers_per_case: int,
) -> dict:
    """Builds, checks and times every case (one at a time, to bound memory) and returns
    {suite, device, device_kind, torch, fusednorm_build, commit, date, copy_gbps,
    rows}, and on the CPU cpu_memory (--cpu-memory), on the GPU gpu_timer (the timer's
    name); cases_not_run when settings.stop_at came before the last case started (the
    first always runs)."""
    from tqdm import tqdm

    device = settings.device
    result = stamp.header(settings.suite, device)
    if device.type == "cpu":
        result["cpu_memory"] = harness.cpu_memory()
    else:
        result["gpu_timer"] = gpu_timer.NAME
    cpu_start = busy.sample()
    # The copy probe runs in turns with every pass of every case (a third of a provider's
    # budget): this VM's bandwidth moved 1.5x within one run, and one probe before and after
    # the cases put the rows of a slow phase at a low % of copy that was not theirs.
    probe = harness.CopyProbe(device)
    probe_budget = settings.budget_s / 3
    copy_seen = [probe.gbps(harness.time_calls([probe.call], device, probe_budget))]
    rows: list[dict] = []
    total = len(case_builders) * providers_per_case * len(settings.passes)
    with tqdm(total=total, desc=settings.suite, unit="timing", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for index, build in enumerate(case_builders):
            if index > 0 and settings.stop_at is not None and time.monotonic() >= settings.stop_at:
                not_run = len(case_builders) - index
                result["cases_not_run"] = not_run
                message = (f"incomplete: stopped by --stop-after, {index} of "
                           f"{len(case_builders)} cases timed, the other {not_run} not run")
                settings.notes.append(message)
                bar.write(f"[{settings.suite}] {message}")
                break
            torch._dynamo.reset()  # each case compiles afresh, specialised to its shape
            case = build()
            label = f"{str(case.dtype).removeprefix('torch.')} " + "x".join(
                str(v) for v in case.fields.values())
            bar.set_postfix_str(f"{label}: checking")
            good = _check_providers(case, settings, bar.write)
            bar.update((len(case.providers) - len(good)) * len(settings.passes))
            bar.update((providers_per_case - len(case.providers)) * len(settings.passes))
            for pass_name in _timing_order(settings.passes):
                with _graphs_for(pass_name):
                    per_provider = [(p, _calls(pass_name, p, case.inputs)) for p in good]
                bar.set_postfix_str(f"{label} {pass_name}: timing side by side")
                timings = harness.time_side_by_side(
                    [calls for _, calls in per_provider] + [[probe.call]], device,
                    [settings.budget_s] * len(per_provider) + [probe_budget])
                copy_gbps = probe.gbps(timings.pop())
                copy_seen.append(copy_gbps)
                for (provider, calls), timing in zip(per_provider, timings):
                    bar.set_postfix_str(f"{label} {pass_name} {provider.name}: memory")
                    # A floor's memory says nothing about the op (and profiling it costs
                    # a tenth of the default CPU run): left null.
                    peak, saved = (_memory_mb(pass_name, calls[0], device) if provider.check
                                   else (None, None))
                    rows.append(_row(case, pass_name, provider.name, timing, peak, saved,
                                     copy_gbps))
                    bar.update(1)
                del per_provider
            del case, good
    del probe
    warning = (busy.busy_note(cpu_start, busy.sample(), copy_seen[1:])
               if device.type == "cpu" else None)  # the probes timed with the cases
    if warning:
        settings.notes.append(warning)
        print(f"[{settings.suite}] warning: {warning}", file=sys.stderr)
    elif device.type == "cpu" and (spread := busy.probe_spread(copy_seen[1:])):
        settings.notes.append(f"No other process competed for the CPUs; {spread}.")
    settings.notes.extend(harness.notes())
    if device.type == "cpu":
        settings.notes.append(harness.allocator_note())
    # The run's ceiling (plots, the stamp line): the best the probe measured.
    result["copy_gbps"] = _sig(max(copy_seen))
    rows.sort(key=lambda row: PASSES.index(row["pass"]))  # stable: cases stay in order
    result["rows"] = _finish_rows(rows, settings)
    return result
