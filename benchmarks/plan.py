"""`python -m benchmarks --plan`: what a run would time (cases, timed measurements,
torch.compile compilations, per suite) and about how long it would take on a GPU, without
running anything: no GPU, no compiled library needed. The estimate comes from COSTS, the
cost figures of past GPU runs (docs/perf-notes.md, "2026-11-27: where a GPU run's time
goes", derives each)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import gpu_timer, harness

# What a GPU run costs beyond the calls each measurement repeats (measurement_s below),
# with the run each figure comes from: H200, torch 2.11, CUDA 13.0, docs/gpu_runs/ (the
# 2026-11-26 quick run's bench.log; the third to seventh runs' suite times, file stamps and
# session.log). docs/perf-notes.md, 2026-11-27 "Where a GPU run's time goes", derives them
# and checks the sum against each run (within 13% a default suite). Used by the plan only.
COSTS = {
    "device": "an NVIDIA H200 (torch 2.11; runs of 2026-11-26/27)",
    # `python -m benchmarks` until its first case: seventh run, bench step 08:03:30, first
    # file stamp 08:03:45; quick run, 68 s in all against 55 s of suites.
    "startup_s": 15.0,
    # Per suite (providers probed, the first copy probe, files and plot) and per case (inputs,
    # float64 reference, each provider checked), and per torch.compile compilation: the quick
    # run's tqdm (a case's check, its first compilation included, 1-2 s; 3 cases in 9-13 s)
    # and the default suites' times (a case 4.3-5 s at 0.2 s per measurement).
    "suite_s": 1.0,
    "case_s": 0.2,
    "compile_s": 0.6,
    # Per case timing Liger-Kernel (its Triton kernels, compiled per shape): layer_norm 167 s
    # with it (seventh run), 130-137 s without (fourth, fifth), less its measurements.
    "liger_case_s": 0.8,
    # Per measurement beyond its calls (Python, events, syncs): the fit of the above.
    "measurement_s": 0.02,
    # A call's time, for repetitions and warm-up: the copy probe's bytes at the H200 files'
    # copy bandwidth, a norm call's minimal bytes at 60% of it; GELU-FFN GEMM flop/s, the
    # gelu_ffn file's d 8192 rows (781b7f6).
    "copy_bandwidth": 4.2e12,
    "norm_bandwidth": 2.5e12,
    "gemm_flops": {"bfloat16": 6.5e14, "float16": 6.5e14, "float32": 5.0e13},
    # Suite `overhead`: a call's mean host time on CUDA per pass (its 08820a3 file's rows: a
    # forward+backward costs about 9 forwards, and its rounds take fewer calls).
    "host_call_s": {"fwd (no grad)": 32e-6, "fwd (grad)": 37e-6, "fwd+bwd": 310e-6},
}


@dataclass(frozen=True)
class PlannedCase:
    """One case of a suite: its rows' dtype and fields (M, N, ...), its providers, and the
    time of one call of each pass (seconds, every provider alike: an estimate from the
    pass's bytes or flops)."""

    dtype: torch.dtype
    fields: dict
    providers: tuple[str, ...]
    call_s: dict[str, float]


@dataclass
class SuitePlan:
    """What a suite would time: its cases, each provider timed at each pass."""

    suite: str
    device: str
    passes: list[str]
    budget_s: float
    cases: list[PlannedCase] = field(default_factory=list)
    # Calls timed on the host outside cases, per pass (suite `overhead`).
    host_calls: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def timings(self) -> int:
        """Timed measurements of providers (the copy probes not counted)."""
        return sum(len(c.providers) for c in self.cases) * len(self.passes)

    @property
    def probes(self) -> int:
        """Copy probes: one per pass of each case, and one before the cases."""
        return len(self.cases) * len(self.passes) + (1 if self.cases else 0)

    @property
    def compiles(self) -> int:
        """torch.compile compilations: each case compiles afresh (dynamo is reset between
        cases, dynamic=False), for the check and the fwd and fwd+bwd passes, and once more
        for the bwd pass (recompiled without donated buffers: runner._graphs_for)."""
        per_case = 1 + ("bwd" in self.passes)
        return sum(c.providers.count("torch.compile") for c in self.cases) * per_case

    def estimate_s(self) -> float | None:
        """Seconds on the GPU of COSTS; None for a CPU run (no CPU cost table)."""
        if self.device != "cuda":
            return None
        total = (COSTS["suite_s"] + COSTS["compile_s"] * self.compiles
                 + sum(COSTS["host_call_s"][p] * n for p, n in self.host_calls.items()))
        probe_call = 2 * harness.COPY_BYTES["cuda"] / COSTS["copy_bandwidth"]  # read, written
        total += measurement_s(probe_call, self.budget_s / 3) * self.probes
        for case in self.cases:
            total += COSTS["case_s"] + COSTS["liger_case_s"] * ("liger" in case.providers)
            total += len(case.providers) * sum(measurement_s(case.call_s[p], self.budget_s)
                                               for p in self.passes)
        return total


def planned_providers(names, device: torch.device) -> tuple[str, ...]:
    """The providers a plan counts: those named, less Liger-Kernel off a GPU (a run skips it
    there); on the GPU Liger is counted as if installed."""
    return tuple(n for n in names if n != "liger" or device.type == "cuda")


def measurement_s(call_s: float, budget_s: float) -> float:
    """Wall seconds of one harness.time_calls on the GPU, by its rules and gpu_timer's: two
    warm-up calls and a timed one, host_ms's calls and the memory figure's (two for fwd);
    gpu_timer's first iteration, its warm-up (max(WARMUP_MS, 2 calls)) and repetitions
    (max(budget, MIN_REPS iterations)), an iteration being the flush, the spin (its
    shortest: the plan knows no host times) and the call; plus COSTS' fixed part."""
    iteration_s = (gpu_timer.FLUSH_BYTES / COSTS["copy_bandwidth"]
                   + gpu_timer.HEAD_MIN_MS / 1000 + call_s)
    calls = 5 + harness.host_calls(1000 * call_s)
    return (calls * call_s + iteration_s
            + max(harness.WARMUP_MS / 1000, 2 * call_s, iteration_s)
            + max(budget_s, harness.MIN_REPS * iteration_s) + COSTS["measurement_s"])


def norm_call_s(pass_bytes: dict[str, int]) -> dict[str, float]:
    """A norm call's time per pass, from the bytes it moves."""
    return {p: b / COSTS["norm_bandwidth"] for p, b in pass_bytes.items()}


def gemm_call_s(flops: dict[str, int], dtype: torch.dtype) -> dict[str, float]:
    """A GEMM-bound call's time per pass, from its flops."""
    rate = COSTS["gemm_flops"].get(str(dtype).removeprefix("torch."), COSTS["gemm_flops"]["float32"])
    return {p: f / rate for p, f in flops.items()}


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s ({seconds / 60:.1f} min)"


def describe(plans: list[SuitePlan]) -> str:
    """The plan as Markdown: a row per suite and the total."""
    device = plans[0].device if plans else "cuda"
    gpu = device == "cuda"
    lines = ["| suite | cases | providers x passes | timings | copy probes | compiles | s per "
             "measurement | estimate |", "|---|--:|---|--:|--:|--:|--:|--:|"]
    for plan in plans:
        providers = sorted({p for c in plan.cases for p in c.providers})
        estimate = plan.estimate_s()
        lines.append(
            f"| `{plan.suite}` | {len(plan.cases)} | "
            + (f"{', '.join(providers)} x {len(plan.passes)}" if plan.cases else "-")
            + f" | {plan.timings} | {plan.probes} | {plan.compiles} | "
            + (f"{plan.budget_s:g}" if plan.cases else "-")
            + f" | {_minutes(estimate) if estimate is not None else 'n/a'} |")
    if gpu:
        lines.append(f"| all, with the run's start ({COSTS['startup_s']:.0f} s) | "
                     f"{sum(len(p.cases) for p in plans)} | | {sum(p.timings for p in plans)} | "
                     f"{sum(p.probes for p in plans)} | {sum(p.compiles for p in plans)} | | "
                     f"**{_minutes(total_s(plans))}** |")
    lines.append("")
    if gpu:
        lines.append(f"Estimate for {COSTS['device']}, from benchmarks/plan.py's COSTS; "
                     "the build (`bash scripts/bench.sh`, about 2 min) not included. Every "
                     "provider named is counted (Liger-Kernel as if installed): one that "
                     "cannot run is skipped at run time.")
    else:
        lines.append("No time estimate for a CPU run (COSTS are the GPU's).")
    for plan in plans:
        lines += [f"- `{plan.suite}`: {note}" for note in plan.notes]
    return "\n".join(lines) + "\n"


def total_s(plans: list[SuitePlan]) -> float | None:
    """The whole run's estimate (with the start), None off the GPU."""
    estimates = [p.estimate_s() for p in plans]
    if any(e is None for e in estimates):
        return None
    return COSTS["startup_s"] + math.fsum(estimates)
