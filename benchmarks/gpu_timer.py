"""Timing a call's kernels on the GPU: CUDA events around each call, L2 flushed before it,
and the device held by a spin kernel while the host launches it.

The head start is the difference from `triton.testing.do_bench`, whose loop is the same
without it: there the device runs the flush, then waits for the host to launch the call,
so a call whose host part (autograd's backward, a compiled graph's wrapper, a Triton
launcher) outlasts the flush is timed at the host's pace, not its kernels'. Here the spin
lasts HEAD_FACTOR times the call's host time, so the host stays ahead of the device from
the first call on, and a call's events enclose its kernels and nothing else. What a call
costs the host is measured on its own (harness.host_ms; the `overhead` suite).
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

# Bytes zeroed before every timed call: more than any current GPU's L2 (as do_bench's).
FLUSH_BYTES = 256 << 20
# The device's head start, in multiples of the host's time per call, and its bounds.
HEAD_FACTOR, HEAD_MIN_MS, HEAD_MAX_MS = 2.0, 0.05, 20.0
# Cycles of the spin that calibrates it.
CALIBRATION_CYCLES = 1 << 20

# The name results files carry in `gpu_timer` (benchmarks/stamp.py).
NAME = "head-start"
DESCRIPTION = ("CUDA events around each call, L2 flushed before it, the device held by a "
               "spin of twice the call's host time while the host launches it (the kernels' "
               "time, not the host's pace)")

_flush_buffers: dict[torch.device, torch.Tensor] = {}
_cycles_per_ms: dict[torch.device, float] = {}


def head_ms(host_ms: float) -> float:
    """The spin before each timed call: HEAD_FACTOR x the host's time per call, within
    [HEAD_MIN_MS, HEAD_MAX_MS]. Twice the host's time keeps the host ahead of the device
    even with the flush and the kernels taking no time, and the lead grows with every call,
    which absorbs a host that now and then stalls."""
    if not math.isfinite(host_ms) or host_ms < 0:
        raise ValueError(f"host_ms must be a finite time >= 0, got {host_ms}")
    return min(HEAD_MAX_MS, max(HEAD_MIN_MS, HEAD_FACTOR * host_ms))


def repetitions(budget_ms: float, iteration_ms: float, min_reps: int) -> int:
    """Calls to time: as many iterations (flush, spin, call) as budget_ms holds, at least
    min_reps."""
    if not iteration_ms > 0:
        raise ValueError(f"iteration_ms must be > 0, got {iteration_ms}")
    return max(min_reps, int(budget_ms / iteration_ms))


def _key(device: torch.device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def flush_buffer(device: torch.device) -> torch.Tensor:
    """The run's L2 flush buffer on `device`, allocated once."""
    key = _key(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=key)
    return _flush_buffers[key]


def spin_cycles_per_ms(device: torch.device) -> float:
    """Clock cycles of torch.cuda._sleep per millisecond on `device`, measured once: the
    median of three spins timed by events, each launched behind another spin (so that no
    launch latency falls between its events), after one that loads the kernel."""
    key = _key(device)
    if key not in _cycles_per_ms:
        samples = []
        with torch.cuda.device(key):
            for _ in range(4):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(CALIBRATION_CYCLES)
                start.record()
                torch.cuda._sleep(CALIBRATION_CYCLES)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
        _cycles_per_ms[key] = CALIBRATION_CYCLES / max(statistics.median(samples[1:]), 1e-6)
    return _cycles_per_ms[key]


def time_ms(fn: Callable[[], object], device: torch.device, host_ms: float, budget_ms: float,
            warmup_ms: float, min_reps: int) -> list[float]:
    """The device times (ms) of calls of fn, sorted: one call timed by events, then
    iterations of flush, spin, call for max(warmup_ms, 2 calls) untimed and budget_ms timed
    (at least min_reps calls), launched without waiting for the device between them (the
    warm-up's lead carries into the timed calls). fn must have run on `device` before (its
    compilation and lazy initialisation out of the way); host_ms is its host time per call."""
    key = _key(device)
    flush = flush_buffer(key)
    with torch.cuda.device(key):
        spin = max(1, round(head_ms(host_ms) * spin_cycles_per_ms(key)))

        def iteration(start=None, end=None) -> None:
            flush.zero_()
            torch.cuda._sleep(spin)
            if start is not None:
                start.record()
            fn()
            if end is not None:
                end.record()

        first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        iteration(*first)
        first[1].synchronize()
        call_ms = max(first[0].elapsed_time(first[1]), 1e-3)
        iteration_ms = max(begin.elapsed_time(first[1]), call_ms)
        for _ in range(max(1, math.ceil(max(warmup_ms, 2 * call_ms) / iteration_ms))):
            iteration()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repetitions(budget_ms, iteration_ms, min_reps))]
        for start, end in events:
            iteration(start, end)
        torch.cuda.synchronize(key)
    return sorted(start.elapsed_time(end) for start, end in events)
