"""Writing a suite's results: <suite>.json (docs/DESIGN.md's format), <suite>.md (providers side
by side) and <suite>.png (drawn by benchmarks.plotting), under <out>/<device-slug>/."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import stamp

BASELINE = "torch"
PASSES = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True)
class Column:
    """A group of table columns, one per provider: header '<provider> <title>'."""

    title: str
    cell: Callable[[dict, dict | None], str]  # (row, the torch row of the same case)
    skip: frozenset[str] = frozenset()  # providers without this column

    def without(self, *providers: str) -> "Column":
        return dataclasses.replace(self, skip=self.skip | set(providers))


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


MS = Column("ms", lambda r, b: _fmt(r["ms"], ".4g"))
GBPS = Column("GB/s (% copy)", lambda r, b: f"{_fmt(r['gbps'], '.1f')} ({_fmt(r['pct_of_copy'], '.0f')}%)")
TFLOPS = Column(
    "TFLOP/s (% GEMM)",
    lambda r, b: f"{_fmt(r['tflops'], '.3g')}"
    + ("" if r.get("pct_of_gemm") is None else f" ({r['pct_of_gemm']:.0f}%)"),
)
SPEEDUP = Column(
    "× torch", lambda r, b: "–" if b is None else f"{b['ms'] / r['ms']:.2f}×",
    skip=frozenset({BASELINE}),
)
FRESH_COPY = Column(
    "% of fresh-copy",
    lambda r, b: "–" if r.get("pct_of_fresh_copy") is None else f"{r['pct_of_fresh_copy']:.0f}%",
    skip=frozenset({"fresh-copy"}),
)
PEAK = Column("peak MiB", lambda r, b: _fmt(r["peak_mem_mb"], ".1f"))
SAVED = Column("saved MiB", lambda r, b: _fmt(r.get("saved_mb"), ".1f"))


def _providers(rows: Sequence[dict]) -> list[str]:
    seen: list[str] = []
    for row in rows:
        if row["provider"] not in seen:
            seen.append(row["provider"])
    return seen


def _case_fields(rows: Sequence[dict], case_keys: Sequence[str]):
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = tuple(row[k] for k in case_keys)
        cases.setdefault(key, {})[row["provider"]] = row
    return cases


def _copy_range(result: dict) -> str:
    """The copy bandwidth the rows were judged against: "lo-hi" over the rows (older
    results, with one probe per run: that one)."""
    seen = [r["copy_gbps"] for r in result["rows"] if r.get("copy_gbps") is not None]
    if not seen:
        return f"{result['copy_gbps']:.1f}"
    lo, hi = min(seen), max(seen)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"


def markdown(result: dict, case_keys: Sequence[str], columns: Sequence[Column],
             notes: Sequence[str] = ()) -> str:
    """The results as Markdown: a stamp line, then one table per pass with a row per case
    and the providers side by side."""
    lines = [
        f"# {result['suite']} on {result['device']}",
        "",
        f"{result['device_kind']}, torch {result['torch']}, fusednorm kernels: "
        f"{result.get('fusednorm_build', 'not recorded')}, commit `{result['commit']}`, "
        f"{result['date']}; copy bandwidth {_copy_range(result)} GB/s (bytes read + "
        "written / s, a copy timed in turns with the providers of each pass of each case; a "
        "row's % copy is against the copy of its own turns). Times are medians."
        + (f" CPU memory: {result['cpu_memory']} (see the notes)." if "cpu_memory" in result
           else ""),
    ]
    providers = _providers(result["rows"])
    for pass_name in dict.fromkeys(r["pass"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["pass"] == pass_name]
        header = list(case_keys)
        for column in columns:
            header += [f"{p} {column.title}" for p in providers if p not in column.skip]
        lines += ["", f"## {pass_name}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(case_keys) + "--:|" * (len(header) - len(case_keys))]
        for key, by_provider in _case_fields(rows, case_keys).items():
            cells = [str(v) for v in key]
            baseline = by_provider.get(BASELINE)
            for column in columns:
                for p in providers:
                    if p in column.skip:
                        continue
                    row = by_provider.get(p)
                    cells.append("n/a" if row is None else column.cell(row, baseline))
            lines.append("| " + " | ".join(cells) + " |")
    lines += _fused_against_separate(result["rows"], case_keys, providers)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _fused_against_separate(rows: Sequence[dict], case_keys: Sequence[str],
                            providers: Sequence[str]) -> list[str]:
    """A table of each provider's fwd+bwd time over its fwd time + bwd time (1.00 when a
    training step costs exactly its two passes; above 1 is time lost between them:
    allocation, page faults of fresh outputs, thread-pool stalls)."""
    by_pass = {p: _case_fields([r for r in rows if r["pass"] == p], case_keys) for p in PASSES}
    if not all(by_pass.values()):
        return []
    header = list(case_keys) + [f"{p} fwd+bwd ms / (fwd + bwd ms)" for p in providers]
    lines = ["", "## fwd+bwd against fwd + bwd", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(case_keys) + "--:|" * len(providers)]
    for key, both in by_pass["fwd+bwd"].items():
        cells = [str(v) for v in key]
        for p in providers:
            fwd, bwd = by_pass["fwd"].get(key, {}).get(p), by_pass["bwd"].get(key, {}).get(p)
            row = both.get(p)
            if row is None or fwd is None or bwd is None:
                cells.append("n/a")
            else:
                cells.append(f"{row['ms']:.4g} / ({fwd['ms']:.4g} + {bwd['ms']:.4g}) = "
                             f"{row['ms'] / (fwd['ms'] + bwd['ms']):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def to_json(result: dict) -> str:
    """The results object as JSON text, one row per line so that diffs stay readable."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in result.items() if k != "rows"]
    rows = ",\n".join("  " + json.dumps(row) for row in result["rows"])
    return "{\n" + "\n".join(head) + '\n "rows": [\n' + rows + "\n ]\n}\n"


def folder_name(result: dict) -> str:
    """<device-slug>, then for a CPU run: -<SIMD level> when fusednorm's CPU kernels ran below
    AVX-512 (amd-epyc-avx2: CPUs of one model name come with and without it, and the level
    moves the kernels' speed as much as a code change), -reference when it had no CPU kernels
    ("cpu: reference": fusednorm ran its plain-PyTorch reference), -<slug> of any other
    stamp, and -fresh-memory under --cpu-memory fresh. Each lands beside the default folder
    instead of replacing its files."""
    suffix = ""
    if result.get("device_kind") == "cpu":
        cpu_part = result.get("fusednorm_build", "").split(",")[0].strip()
        level = re.fullmatch(r"cpu (\w+)", cpu_part)
        if level is None:  # "cpu: reference", or a stamp this code does not know
            suffix += "-" + stamp.slug(cpu_part.removeprefix("cpu"))
        elif level.group(1) != "avx512":
            suffix += "-" + level.group(1)
        if result.get("cpu_memory") == "fresh":
            suffix += "-fresh-memory"
    return stamp.slug(result["device"]) + suffix


def write(result: dict, out_root: Path, md: str, draw: Callable[[Path], None]) -> Path:
    """Writes <out_root>/<folder_name>/<suite>.{json,md,png}; returns that folder."""
    folder = Path(out_root) / folder_name(result)
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / result["suite"]
    base.with_suffix(".json").write_text(to_json(result))
    base.with_suffix(".md").write_text(md)
    draw(base.with_suffix(".png"))
    return folder
