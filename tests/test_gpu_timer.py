"""benchmarks.gpu_timer: the GPU rows' timer times a call's kernels, not the host's pace.

On the CPU, the timer runs against a model of one CUDA stream (an operation starts when the
stream is free and the host has launched it; an event is stamped when the stream reaches
it): a call whose host part is ten times its kernel, with stalls, must read as its kernel,
and the same loop without the head start (do_bench's) must not. On a GPU, the same against
a spin kernel behind a sleeping host, and a copy against back-to-back events."""
from __future__ import annotations

import contextlib
import math
import statistics
import time
import types

import pytest
import torch

from benchmarks import gpu_timer, harness

HAS_CUDA = torch.cuda.is_available()


def test_head_start_is_twice_the_host_time_within_its_bounds():
    assert gpu_timer.head_ms(0.3) == pytest.approx(0.6)
    assert gpu_timer.head_ms(0.0) == gpu_timer.HEAD_MIN_MS
    assert gpu_timer.head_ms(1e3) == gpu_timer.HEAD_MAX_MS
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="host_ms"):
            gpu_timer.head_ms(bad)


def test_repetitions_fill_the_budget_and_keep_a_floor():
    assert gpu_timer.repetitions(100.0, 0.25, 10) == 400
    assert gpu_timer.repetitions(100.0, 30.0, 10) == 10
    with pytest.raises(ValueError, match="iteration_ms"):
        gpu_timer.repetitions(100.0, 0.0, 10)
    # host_ms's calls: HOST_CALLS for short calls, fewer (at least 3) for long ones
    assert harness.host_calls(0.1) == harness.HOST_CALLS
    assert harness.host_calls(50.0) == 3


class FakeStream:
    """One CUDA stream, in milliseconds: the host's clock, and when the stream is free. A
    launch costs the host LAUNCH_MS; an operation starts once launched and the stream free."""

    LAUNCH_MS = 0.005

    def __init__(self, cycles_per_ms: float):
        self.host = 0.0
        self.free = 0.0
        self.cycles_per_ms = cycles_per_ms

    def launch(self, device_ms: float) -> None:
        self.host += self.LAUNCH_MS
        self.free = max(self.free, self.host) + device_ms

    def stamp(self) -> float:
        self.host += self.LAUNCH_MS
        self.free = max(self.free, self.host)
        return self.free

    def wait(self, until: float) -> None:
        self.host = max(self.host, until)


@pytest.fixture
def stream(monkeypatch):
    """torch.cuda's events, spin, synchronize and device as the FakeStream's; the flush
    buffer's zero_ a launch of FLUSH_MS; the harness's clock the host's."""
    s = FakeStream(cycles_per_ms=1.7e6)

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.at = None

        def record(self):
            self.at = s.stamp()

        def synchronize(self):
            s.wait(self.at)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: s.launch(cycles / s.cycles_per_ms))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: s.wait(s.free))
    monkeypatch.setattr(torch.cuda, "device", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    flush = types.SimpleNamespace(zero_=lambda: s.launch(FLUSH_MS))
    monkeypatch.setattr(gpu_timer, "flush_buffer", lambda device: flush)
    monkeypatch.setattr(gpu_timer, "_cycles_per_ms", {})
    monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=lambda: s.host / 1e3))
    return s


FLUSH_MS, KERNEL_MS, HOST_MS, STALL_MS = 0.06, 0.1, 1.0, 5.0


def slow_host_call(s: FakeStream, stall_every: int = 7):
    """A call whose host part is HOST_MS (STALL_MS more every stall_every calls) and whose
    kernel takes KERNEL_MS."""
    calls = [0]

    def fn():
        calls[0] += 1
        s.host += HOST_MS + (STALL_MS if calls[0] % stall_every == 0 else 0.0)
        s.launch(KERNEL_MS)
    return fn


def test_each_call_is_timed_on_its_kernel_behind_a_slow_host(stream):
    times = gpu_timer.time_ms(slow_host_call(stream), torch.device("cuda", 0), host_ms=HOST_MS,
                              budget_ms=100.0, warmup_ms=25.0, min_reps=10)
    assert len(times) >= 10
    assert times == pytest.approx([KERNEL_MS] * len(times), rel=1e-9)


def test_without_the_head_start_the_host_sets_the_pace(stream, monkeypatch):
    """The control: the same loop without the spin (do_bench's) times the host."""
    monkeypatch.setattr(gpu_timer, "head_ms", lambda host_ms: 0.0)
    times = gpu_timer.time_ms(slow_host_call(stream), torch.device("cuda", 0), host_ms=HOST_MS,
                              budget_ms=100.0, warmup_ms=25.0, min_reps=10)
    assert statistics.median(times) > 5 * KERNEL_MS


def test_harness_gpu_timing_reads_the_kernel_and_the_hosts_time(stream):
    """harness.time_calls on the GPU: the median and quantiles are the kernel's, host_ms the
    host's time per call (stalls included)."""
    timing = harness.time_calls([slow_host_call(stream)], torch.device("cuda", 0), budget_s=0.1)
    assert (timing.ms, timing.ms_p20, timing.ms_p80) == pytest.approx((KERNEL_MS,) * 3)
    assert HOST_MS <= timing.host_ms <= HOST_MS + STALL_MS


def test_the_spin_is_calibrated_from_its_own_timing(stream):
    assert gpu_timer.spin_cycles_per_ms(torch.device("cuda", 0)) == pytest.approx(1.7e6)


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@requires_cuda
def test_cuda_timer_reads_a_spin_kernel_behind_a_sleeping_host():
    """A call that sleeps 2 ms on the host, then launches a 0.2 ms spin: read as the spin
    (do_bench's loop would read the host's 2 ms)."""
    device = torch.device("cuda", torch.cuda.current_device())
    cycles = round(0.2 * gpu_timer.spin_cycles_per_ms(device))

    def fn():
        time.sleep(0.002)
        torch.cuda._sleep(cycles)
    fn()
    host = harness.host_ms(fn, device)
    times = gpu_timer.time_ms(fn, device, host, budget_ms=60.0, warmup_ms=10.0, min_reps=10)
    assert 0.15 <= statistics.median(times) <= 0.3, times


@requires_cuda
def test_cuda_timer_agrees_with_back_to_back_events_on_a_copy():
    """A 256 MiB copy (device-bound, beyond L2): the timer's median within 15% of the mean of
    copies timed back to back between two events (a spin inside its events would add 40%)."""
    device = torch.device("cuda", torch.cuda.current_device())
    src = torch.randn(64 << 20, device=device)
    dst = torch.empty_like(src)

    def fn():
        dst.copy_(src)
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) / 20
    times = gpu_timer.time_ms(fn, device, harness.host_ms(fn, device), budget_ms=60.0,
                              warmup_ms=10.0, min_reps=10)
    assert statistics.median(times) == pytest.approx(back_to_back, rel=0.15)
