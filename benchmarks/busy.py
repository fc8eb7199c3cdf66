"""Whether other work competed with a benchmark run for this machine's CPUs, and the warning
that says so.

The evidence is CPU time that other processes took while the suite ran: the busy time of all
CPUs from /proc/stat (steal included: a VM's neighbours) less the CPU time of this process
and its children. The copy probe's spread is no evidence: with nothing else running, the
probes timed with the cases of one run range 1.5-1.9x on the 2-core EPYC VM by themselves
(docs/perf-notes.md, "a new user's first hour"), so they are reported beside the warning, never its cause.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

BUSY_PREFIX = "other work kept"  # how the warning starts (plots pick it out by it)

# Share of all CPUs' time that other processes may take during a run before its CPU timings
# are called unreliable: one more busy process on the 2-core machine takes 50%.
OTHERS_LIMIT = 0.10

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds since boot: all CPUs' busy, total and steal time, and this process
    tree's own."""

    busy_s: float
    total_s: float
    steal_s: float
    own_s: float


def _machine_seconds() -> tuple[float, float, float]:
    """(busy, total, steal) seconds of all CPUs, from /proc/stat's first line (user nice
    system idle iowait irq softirq steal; guest time is already in user)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    fields += [0] * (8 - len(fields))
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) * _TICK_S, sum(fields) * _TICK_S, fields[7] * _TICK_S


def _proc_stat(pid: str) -> tuple[int, float]:
    """(parent pid, utime + stime + cutime + cstime seconds) of a process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; rest[0] is the state
    return int(rest[1]), sum(int(v) for v in rest[11:15]) * _TICK_S


def _own_seconds() -> float:
    """CPU seconds of this process (all threads), of its reaped children, and of its live
    descendants (e.g. torch.compile's worker processes)."""
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    children: dict[int, list[tuple[int, float]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent, seconds = _proc_stat(entry.name)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append((int(entry.name), seconds))
    stack = [os.getpid()]
    while stack:
        for pid, seconds in children.get(stack.pop(), ()):
            own += seconds
            stack.append(pid)
    return own


def sample() -> CpuTimes | None:
    """The CPU times now; None where /proc cannot tell (not Linux)."""
    try:
        busy, total, steal = _machine_seconds()
        return CpuTimes(busy, total, steal, _own_seconds())
    except (OSError, ValueError, IndexError):
        return None


def busy_note(start: CpuTimes | None, end: CpuTimes | None,
              copy_gbps: Sequence[float] = ()) -> str | None:
    """The warning for a run between two samples in which other processes took at least
    OTHERS_LIMIT of all CPUs' time (what was seen, and the spread of the copy probes timed
    with the cases, if any); else None."""
    if start is None or end is None or end.total_s <= start.total_s:
        return None
    total = end.total_s - start.total_s
    others = max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s))
    share = others / total
    if share < OTHERS_LIMIT:
        return None
    steal = (end.steal_s - start.steal_s) / total
    note = (f"{BUSY_PREFIX} the CPUs busy during this run: other processes took "
            f"{100 * share:.0f}% of all CPUs' time ({others:.0f} of {total:.0f} CPU-seconds"
            + (f"; {100 * steal:.0f}% was steal, the hypervisor's other VMs" if steal >= 0.01
               else "")
            + "), so CPU timings may be slow and uneven")
    spread = probe_spread(copy_gbps)
    if spread:
        note += f"; {spread}"
    return note + ". Re-run on a quiet machine"


def probe_spread(copy_gbps: Sequence[float]) -> str | None:
    """What the copy probes timed with the cases ranged, when there were several."""
    if len(copy_gbps) < 2 or min(copy_gbps) <= 0:
        return None
    lo, hi = min(copy_gbps), max(copy_gbps)
    return (f"the copy probes timed with the cases ranged {lo:.1f}-{hi:.1f} GB/s "
            f"({hi / lo:.2f}x), each row's % copy against its own")
