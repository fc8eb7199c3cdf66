"""Measuring: time of a call (median and 20/80 quantiles), copy bandwidth, peak memory.

GPU: benchmarks.gpu_timer (CUDA events, L2 flushed before every call, the device given a
head start over the host so that the events time the kernels, not the host's pace). CPU:
torch.utils.benchmark.Timer.blocked_autorange with all of torch's threads, the providers of
a case taking turns (time_side_by_side). A call is given
as a list of equivalent callables on different input sets; the timer cycles through them,
so inputs larger than the CPU's last-level cache are read from memory, as on the GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import gpu_timer

QUANTILES = [0.5, 0.2, 0.8]

# Copy-bandwidth probe: large enough to stream from DRAM / HBM on any current device.
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
# GPU: the warm-up (ms) at least, and the fewest calls the repetitions hold (long calls: so
# that the quantiles mean something).
WARMUP_MS, MIN_REPS = 25.0, 10


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th / 80th percentiles; on the GPU also the
    host's milliseconds per call (host_ms), the CPU time of launching one call."""

    ms: float
    ms_p20: float
    ms_p80: float
    host_ms: float | None = None


# GPU: calls launched back to back, without waiting, to time the host's part of a call:
# HOST_CALLS, or as many as HOST_BUDGET_MS of the device's time holds (at least 3).
HOST_CALLS, HOST_BUDGET_MS = 10, 10.0


def host_calls(call_ms: float) -> int:
    """Calls host_ms launches for a call taking call_ms on the device: waiting for the
    device at the end costs their device time, which long calls (the FFN's) keep short."""
    return max(3, min(HOST_CALLS, math.ceil(HOST_BUDGET_MS / max(call_ms, 1e-3))))


def host_ms(fn: Callable[[], object], device: torch.device, calls: int = HOST_CALLS) -> float:
    """The host's milliseconds per call of fn: wall time of `calls` calls launched back to
    back after the device is idle, before waiting for it. A call whose host part exceeds
    its device time cannot keep the GPU busy: launched in a loop, it runs at the host's pace."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    synchronize(device)
    return 1e3 * elapsed / calls


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cycling(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    if len(calls) == 1:
        return calls[0]
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def time_calls(
    calls: Sequence[Callable[[], object]], device: torch.device, budget_s: float
) -> Timing:
    """Times one call of `calls` (cycled through), after warming up; `budget_s` is roughly
    how long the measurement may take."""
    fn = _cycling(calls)
    if device.type == "cuda":
        for _ in range(max(2, len(calls))):  # warm-up: compilation, autotuning, lazy init
            fn()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        synchronize(device)
        estimate_ms = max(start.elapsed_time(end), 1e-3)
        host = host_ms(fn, device, host_calls(estimate_ms))
        times = gpu_timer.time_ms(fn, device, host, 1000.0 * budget_s, WARMUP_MS, MIN_REPS)
        return Timing(*(_quantile(times, q) for q in QUANTILES), host)

    return time_side_by_side([calls], device, budget_s)[0]


def gpu_timing_note(budget_s: float) -> str:
    """How time_calls times on the GPU, for a results file's notes."""
    return (f"{gpu_timer.DESCRIPTION}; {budget_s:g} s of calls per measurement, at least "
            f"{MIN_REPS}")


# CPU side-by-side timing: rounds in which every provider runs one slice of blocks in turn.
CPU_ROUNDS = 5


def time_side_by_side(
    calls_per_provider: Sequence[Sequence[Callable[[], object]]], device: torch.device,
    budget_s: float | Sequence[float],
) -> list[Timing]:
    """One Timing per provider (its `calls` cycled through). On the CPU the providers take
    turns, a slice of blocks each, for CPU_ROUNDS rounds: a machine shared with other work
    speeds up and slows down over seconds, and timing one provider after the other would
    hand such a phase to one of them (seen: the same kernel 0.7x and 1.5x PyTorch in two
    runs); in turns, each provider gets its share of every phase. Long calls get at least
    one block per round. On the GPU (steady, timed by events), one provider after the other.
    budget_s: one for all providers, or one each."""
    budgets = ([budget_s] * len(calls_per_provider) if isinstance(budget_s, (int, float))
               else list(budget_s))
    if device.type == "cuda":
        return [time_calls(calls, device, b) for calls, b in zip(calls_per_provider, budgets)]
    from torch.utils.benchmark import Timer

    # Per provider: calls per block (a block of ~10 ms, at least one call) and blocks per
    # round (the budget split over the rounds, at least one block), from one timed call.
    timers, numbers, blocks = [], [], []
    for calls, budget in zip(calls_per_provider, budgets):
        fn = _cycling(calls)
        # Warm-up (caches, allocator, lazy init): every input set once, and twice in all for
        # short calls; the last warm-up call's time is the estimate. Long calls (the FFN's,
        # ~1 s) stop after two once the warm-up has taken the budget: cycling through every
        # set cost more than their timing did.
        warmups, spent = len(calls), 0.0
        i = 0
        while (i < max(warmups, 1) and not (i >= 2 and spent >= budget)) \
                or (i < 2 and estimate_s < 0.05):
            start = time.perf_counter()
            fn()
            estimate_s = max(time.perf_counter() - start, 1e-7)
            spent += estimate_s
            i += 1
        number = max(1, round(0.01 / estimate_s))
        timers.append(Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()))
        numbers.append(number)
        blocks.append(max(1, round(budget / CPU_ROUNDS / (number * estimate_s))))
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(CPU_ROUNDS):
        for i, timer in enumerate(timers):
            for _ in range(blocks[i]):
                times[i].append(timer.timeit(numbers[i]).median)  # seconds per call
    return [Timing(*(1e3 * _quantile(sorted(t), q) for q in QUANTILES)) for t in times]


class CopyProbe:
    """The copy-bandwidth probe: copy_ of a COPY_BYTES tensor into a preallocated one (on the
    CPU, clone() of a tensor this large would time the kernel's page faults on fresh memory,
    not the memory system). The runner times it in turns with each case's providers, so that
    a row's % of copy is taken against the bandwidth of the same moments."""

    def __init__(self, device: torch.device):
        self.src = torch.randn(COPY_BYTES[device.type] // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.bytes = 2 * self.src.numel() * self.src.element_size()  # read + written

    def call(self) -> None:
        self.dst.copy_(self.src)

    def gbps(self, timing: Timing) -> float:
        return self.bytes / (timing.ms * 1e-3) / 1e9


_cpu_memory_warning: list[str] = []


@contextlib.contextmanager
def _stderr_silenced():
    """Sends file descriptor 2 to /dev/null: the profiler's C++ side logs there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_allocated_bytes(fn: Callable[[], object]) -> tuple[int, int] | None:
    """(peak, retained): the most bytes that PyTorch's CPU allocator had handed out during
    fn() beyond what was allocated before it, and the bytes still allocated when fn has
    returned and its result is still held; from the profiler's allocation events (None
    when unavailable). Memory that libraries take past PyTorch's allocator (MKL/oneDNN
    scratch) is not seen."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with warnings.catch_warnings(), _stderr_silenced():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                result = fn()
        del result
        events: list[tuple[int, int]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
    except Exception as error:  # private profiler API: degrade to "not measured"
        if not _cpu_memory_warning:
            _cpu_memory_warning.append(f"CPU peak memory not measured: {error!r}")
        return None
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak, current


def _cuda_allocated_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    retained = torch.cuda.memory_allocated(device) - base
    del result
    return torch.cuda.max_memory_allocated(device) - base, retained


def memory_mb(fn: Callable[[], object], device: torch.device) -> tuple[float, float] | None:
    """(peak, retained) MiB of one call of fn: the most device memory it holds at once
    beyond what was allocated before (outputs, saved activations, workspace), and what is
    still allocated after it returns while its result is held (outputs and, for a forward
    recording autograd, the activations saved for backward). None where unmeasurable."""
    measured = (_cuda_allocated_bytes(fn, device) if device.type == "cuda"
                else _cpu_allocated_bytes(fn))
    return None if measured is None else (measured[0] / 2**20, measured[1] / 2**20)


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """The peak of memory_mb."""
    measured = memory_mb(fn, device)
    return None if measured is None else measured[0]


# --cpu-memory: where a CPU call's new outputs come from. "reuse": glibc's malloc keeps
# freed memory and serves the next allocation from it, as a caching allocator does (the
# steady state of a training step; PyTorch's CPU tuning guide gets it with jemalloc or
# tcmalloc); the kernels are then timed against the memory system, not against the OS.
# "fresh": glibc's defaults, under which every block above its 32 MiB mmap threshold is new
# pages on every call, zeroed by the kernel at first touch.
CPU_MEMORY_MODES = ("reuse", "fresh")
_cpu_memory = "fresh"  # what applies in this process
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def use_cpu_memory(mode: str) -> None:
    """Applies --cpu-memory for the rest of the process ("reuse": mallopt no mmap'ed blocks
    and no trimming, so freed blocks stay mapped for the next call). glibc only; elsewhere
    "reuse" raises SystemExit."""
    global _cpu_memory
    if mode == _cpu_memory:
        return
    if mode != "reuse":
        raise SystemExit(f"--cpu-memory {mode}: this process already reuses memory")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        raise SystemExit("--cpu-memory reuse needs glibc's mallopt; use --cpu-memory fresh")
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        raise SystemExit("--cpu-memory reuse: mallopt refused; use --cpu-memory fresh")
    _cpu_memory = mode


def cpu_memory() -> str:
    """The --cpu-memory mode in effect in this process."""
    return _cpu_memory


def allocator_note() -> str:
    """How PyTorch's CPU allocator backed large tensors in this run (see benchmarks/__init__)."""
    from . import THP_SET_BEFORE_TORCH, THP_SETTING

    value = os.environ.get(THP_SETTING, "")
    if _cpu_memory == "reuse":
        return ("Memory (--cpu-memory reuse): glibc's malloc keeps freed memory (mallopt "
                "M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB), so each call's new outputs reuse the "
                "blocks the previous call freed, as under a caching allocator (jemalloc, "
                "tcmalloc) in the steady state of training, for every provider alike; "
                f"{THP_SETTING}={value or 'unset'}. With --cpu-memory fresh (glibc's "
                "defaults), outputs above 32 MiB are new pages on every call, zeroed by the "
                "OS at first touch, which costs every provider up to 2x at 16384 tokens.")
    if value == "1" and THP_SET_BEFORE_TORCH:
        return (f"Memory: {THP_SETTING}=1 (PyTorch's CPU allocator puts tensors of 2 MiB or "
                "more on 2 MiB pages): outputs above 32 MiB are still new pages on every "
                "call, zeroed by the kernel at first touch, but faulted in 2 MiB at a time "
                "(without it, 4 KiB at a time: up to 3x slower for every provider alike).")
    return (f"Memory: {THP_SETTING}={value or 'unset'}"
            + ("" if THP_SET_BEFORE_TORCH else " (torch was imported before the benchmarks)")
            + ": outputs above glibc's 32 MiB mmap threshold are page-faulted in on every "
            "call, for every provider alike, and often decide the CPU times.")


def notes() -> list[str]:
    """Caveats met while measuring (e.g. a measurement that was not possible)."""
    return list(_cpu_memory_warning)


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache (32 MiB when /sys does not say)."""
    sizes = []
    try:
        for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
            text = entry.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return max(sizes, default=32 << 20)


def input_sets_needed(bytes_per_set: int, device: torch.device, cap: int = 16) -> int:
    """How many input sets to cycle through so that a set is out of cache when it comes
    round again: 1 on the GPU (gpu_timer flushes L2), else enough to fill 2x the LLC."""
    if device.type == "cuda":
        return 1
    return max(1, min(cap, math.ceil(2 * last_level_cache_bytes() / max(bytes_per_set, 1))))


