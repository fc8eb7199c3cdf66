"""A suite's PNG: one column per pass (fwd, bwd, fwd+bwd), one row per (metric, dtype),
providers as lines over the cases; stamped with device, torch, commit, date and the
busy-machine warning when the run had one."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from .busy import BUSY_PREFIX


@dataclass(frozen=True)
class Metric:
    """One row of panels per dtype: the row key to plot, its axis label, and an optional
    reference line (value, label) such as the copy bandwidth."""

    key: str
    label: str
    hline: Optional[tuple[float, str]] = None
    skip: tuple[str, ...] = ()  # providers left out of these panels


@dataclass(frozen=True)
class XAxis:
    """The cases along x: `value` gives a number (plotted on a log2 axis) or a label
    (evenly spaced); `label` titles the axis."""

    value: Callable[[dict], object]
    label: str


def stamp_lines(result: dict, notes: Sequence[str]) -> list[str]:
    """Title lines: what ran where and when, then any busy-machine warning (from the third
    line on)."""
    lines = [f"{result['suite']} on {result['device']} ({result['device_kind']})",
             f"torch {result['torch']} · commit {result['commit'][:12]}"
             + ("-dirty" if result["commit"].endswith("-dirty") else "")
             + f" · {result['date']}"]
    busy = [note for note in notes if note.startswith(BUSY_PREFIX)]
    lines += [line for note in busy for line in textwrap.wrap("WARNING: " + note, 110)]
    return lines


def _providers(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["provider"] for r in rows))


def plot(result: dict, path: Path, x: XAxis, metrics: Sequence[Metric],
         notes: Sequence[str] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if not rows:
        return
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    providers = _providers(rows)
    # Distinct markers, and lines thinning from the first provider to the last, so that
    # providers with equal values stay visible one on the other.
    style = {p: dict(color=f"C{i}", marker="osD^v<>"[i % 7], linewidth=max(2.8 - 0.6 * i, 1.0))
             for i, p in enumerate(providers)}
    values = list(dict.fromkeys(x.value(r) for r in rows))
    numeric = all(isinstance(v, (int, float)) for v in values)
    position = (lambda v: v) if numeric else values.index

    panel_rows = [(metric, dtype) for metric in metrics for dtype in dtypes]
    title = stamp_lines(result, notes)
    fig, axes = plt.subplots(len(panel_rows), len(passes), squeeze=False,
                             figsize=(4.6 * len(passes), 3.0 * len(panel_rows) + 0.3 * len(title)))
    for i, (metric, dtype) in enumerate(panel_rows):
        for j, pass_name in enumerate(passes):
            ax = axes[i][j]
            panel = [r for r in rows if r["pass"] == pass_name and r["dtype"] == dtype]
            for provider in (p for p in providers if p not in metric.skip):
                points = sorted((position(x.value(r)), r[metric.key]) for r in panel
                                if r["provider"] == provider and r.get(metric.key) is not None)
                if points:
                    ax.plot(*zip(*points), markersize=4, label=provider, **style[provider])
            if metric.hline is not None:
                ax.axhline(metric.hline[0], color="grey", linestyle="--", linewidth=1,
                           label=metric.hline[1])
            if numeric:
                ax.set_xscale("log", base=2)
                ax.set_xticks(values, [str(v) for v in values])
                ax.minorticks_off()
            else:
                ax.set_xticks(range(len(values)), values)
            ax.tick_params(axis="x", labelsize=7, rotation=30)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(f"{pass_name}, {dtype}", fontsize=9)
            ax.set_xlabel(x.label, fontsize=8)
            ax.set_ylabel(metric.label, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    handles, labels = {}, []
    for ax in axes.flat:  # every provider and reference line once, whichever panel has it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = list(handles)
    fig.legend([handles[k] for k in labels], labels, loc="lower center", ncol=len(labels),
               fontsize=8)
    top = 1 - 0.28 * len(title) / fig.get_figheight()
    for k, line in enumerate(title):
        fig.text(0.5, 1 - (0.12 + 0.25 * k) / fig.get_figheight(), line, ha="center", va="top",
                 fontsize=10 if k == 0 else 8, color="firebrick" if k >= 2 else "black",
                 weight="bold" if k == 0 else "normal")
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
