"""`python -m benchmarks.docs_page`: writes docs/benchmarks.md, README.md's performance block
(between its `benchmarks:begin` / `benchmarks:end` markers) and one summary plot per device
(docs/img/benchmarks-<folder>.png) from the committed results, benchmarks/results/*/*.json.
Nothing is timed. `--check` writes nothing and exits 1 when a committed page differs from
what this would write (tests/test_docs_page.py runs it)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report, stamp
from benchmarks.busy import BUSY_PREFIX
from benchmarks.replot import notes_of

PAGE = stamp.REPO_ROOT / "docs" / "benchmarks.md"
README = stamp.REPO_ROOT / "README.md"
IMAGES = stamp.REPO_ROOT / "docs" / "img"
BEGIN = "<!-- benchmarks:begin (written by python -m benchmarks.docs_page; do not edit) -->"
END = "<!-- benchmarks:end -->"

# The folders of benchmarks/results/ in page order, and those the README summarises.
FOLDERS = ("nvidia-h200", "amd-epyc", "amd-epyc-fresh-memory", "amd-epyc-avx2",
           "intel-xeon-processor")
README_FOLDERS = ("nvidia-h200", "amd-epyc", "amd-epyc-avx2", "intel-xeon-processor")
NORM_SUITES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
TIMED_SUITES = NORM_SUITES + ("gelu_ffn",)
OURS, COMPILED, LIGER = "fusednorm", "torch.compile", "liger"
# A GPU row whose 80th percentile exceeds its 20th by more than this is shaky (shaky()).
UNSTEADY_SPREAD = 1.25
PLAIN = "plain"  # the add_* suites' rows carry a "variant" (benchmarks/norm_variants.py)
DTYPE_SHORT = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16"}

METHOD = """\
## Method

- **Passes.** `fwd`: the forward with autograd recording (inputs require grad); `bwd`: the
  backward alone, over a retained graph; `fwd+bwd`: both, as a training step runs them.
- **Timing.** GPU: CUDA events around each call, L2 flushed before it, and the device held
  by a spin of twice the call's host time while the host launches it, so that a call whose
  host part is long is still timed on its kernels (`benchmarks/gpu_timer.py`; files
  without a `gpu_timer` field were timed by `triton.testing.do_bench`, the same loop
  without the spin).
  CPU: `torch.utils.benchmark.Timer` on all of torch's threads, cycling through input sets
  that fill twice the last-level cache, so that data comes from memory as on the GPU. The
  providers of a case take turns (CPU: 5 rounds of blocks each), so that a phase in which
  other work slows the machine falls on all of them alike. Figures are medians; the JSON
  adds the 20th and 80th percentiles.
- **Checked first.** Every provider's output and gradients are compared with the float64
  reference before it is timed; a provider that fails is left out and named in the notes of
  its suite's table.
- **× torch**: PyTorch eager's time over the provider's (above 1: faster). **× compile**:
  `torch.compile`'s time over the provider's. **× liger** (GPU runs with Liger-Kernel
  installed; `--save` on a GPU refuses to run without it): Liger's time over the
  provider's (its RMSNorm functions with `in_place=False`, whose backward leaves the dy it
  is given as it was).
- **Host-bound rows** (GPU): a row whose 80th-percentile time exceeds its 20th by more
  than 1.25x, or, in a file timed by `do_bench`, whose host time per call (`host_ms`: the
  CPU time of launching a call, calls launched back to back) reaches its time, may have
  measured its host, not its kernels: CUDA events time a kernel to within a few percent.
  A ratio or % of copy with such a row on either side is marked † in the full tables and
  left out of the summaries, which say how many cases had one.
- **% of copy** (the norm suites): the fewest bytes the pass must move (forward: read x,
  weight, bias, write y, mean, rstd; backward: read x, dy, mean, rstd, weight, write dx,
  dweight, dbias; the residual variants add theirs) per second, over the bandwidth of a
  plain copy (1 GiB on the GPU, 256 MiB on the CPU, bytes read + written) timed in turns
  with the providers of the same pass and case. 100% is the memory system's limit; rows whose
  working set partly fits the CPU's last-level cache can exceed it. A run during which
  other processes took 10% or more of the CPUs' time is marked as taken on a busy machine
  (column "busy" below; runs saved before that rule were marked when their copy probes were
  more than 1.25x apart): compare its rows by their ratios to the providers timed beside them.
- **% of fresh-copy** (norm suites, in the full tables): the time of an op that only reads
  and writes the pass's rows into newly allocated outputs, over the provider's: the floor
  of any op that returns new tensors (`benchmarks/floors.py`). A GPU run times it with
  `--full` only: there PyTorch's caching allocator makes new outputs free, and it reads
  about the copy's bandwidth.
- **Variants** (`add_layer_norm`, `add_rms_norm`): rows of the sum's variants beside the
  plain `s = x + r` (a float32 residual stream beside 16-bit input, dropout, dropout with a
  row scale; column "variant"), at a few cases. The summaries quote the plain cases; each
  other variant has a summary row of its own.
- **% of GEMM** (`gelu_ffn`): the time of the same two GEMMs alone (no bias, no GELU) over
  the provider's: 100% is the cost of the matrix products themselves.
- **Host time per call** (`overhead`): tiny tensors (4×64), fusednorm and the PyTorch code
  it replaces (the add ops: `x + r`, with dropout `F.dropout(x, p) + r`, then the norm)
  alternating round by round, one CPU thread, or on CUDA wall time with a sync per round.
- **CPU memory** (`--cpu-memory`): `reuse`, the default, makes glibc's malloc keep freed
  memory (mallopt `M_MMAP_MAX=0`, `M_TRIM_THRESHOLD` 2 GiB), so that each call's outputs
  reuse the blocks the previous call freed: the steady state of a training step under a
  caching allocator (jemalloc or tcmalloc on the CPU, PyTorch's own on the GPU). `fresh`
  keeps glibc's defaults, under which every output above its 32 MiB mmap threshold is new
  pages on every call, zeroed by the OS at first touch: up to half of every provider's time
  at 16384 tokens. A `fresh` run's files go to `<device>-fresh-memory/`.
- **Huge pages**: `import benchmarks` sets `THP_MEM_ALLOC_ENABLE=1` before torch is imported
  (unless the environment sets it), PyTorch's switch for backing tensors of 2 MiB or more
  with huge pages; without it, the 4 KiB page faults of fresh outputs decide the CPU times
  of every provider alike. The notes under each table say what applied.
- **Stamps.** Each results file records the device, torch, the kernels that ran, the commit
  and the date of its run (table below); code changed after a file's run has not been timed
  by it.

The columns of the full tables, the options and how to publish a run:
[`benchmarks/README.md`](../benchmarks/README.md); the results-file format:
[`DESIGN.md`](DESIGN.md#performance-and-benchmark-results). Runs on GPUs lent for minutes
(quick runs, partial suites, logs) are kept in [`gpu_runs/`](gpu_runs/README.md).
"""


def load(results_dir: Path = stamp.RESULTS_DIR) -> dict[str, dict[str, dict]]:
    """{folder: {suite: results object}} for the folders of FOLDERS that exist; each
    object gains "_notes" (the notes of its .md)."""
    found: dict[str, dict[str, dict]] = {}
    for folder in FOLDERS:
        for path in sorted((results_dir / folder).glob("*.json")):
            result = json.loads(path.read_text())
            md = path.with_suffix(".md")
            result["_notes"] = notes_of(md.read_text()) if md.exists() else []
            found.setdefault(folder, {})[result["suite"]] = result
    return found


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _cases(result: dict, keys: tuple[str, ...]) -> dict[tuple, dict[str, dict]]:
    """{(pass, *case keys): {provider: row}} in file order."""
    cases: dict[tuple, dict[str, dict]] = {}
    for row in result["rows"]:
        cases.setdefault((row["pass"],) + tuple(row.get(k, PLAIN) for k in keys),
                         {})[row["provider"]] = row
    return cases


def _case_keys(result: dict) -> tuple[str, ...]:
    if result["suite"] == "gelu_ffn":
        return ("dtype", "M", "N", "hidden")
    variant = any("variant" in row for row in result["rows"])
    return ("dtype", "M", "N") + (("variant",) if variant else ())


def by_variant(result: dict) -> dict[str, dict]:
    """{variant: the result with that variant's rows only}, plain first (a file without
    variants: {"plain": result})."""
    variants = sorted(dict.fromkeys(r.get("variant", PLAIN) for r in result["rows"]),
                      key=lambda v: v != PLAIN)
    return {v: dict(result, rows=[r for r in result["rows"] if r.get("variant", PLAIN) == v])
            for v in variants}


def _plain(result: dict) -> dict:
    """The result's plain rows: the cases the summaries quote (variants get rows of their
    own in the summary table and the suite's table)."""
    return by_variant(result).get(PLAIN, dict(result, rows=[]))


def shaky(result: dict, row: dict) -> bool:
    """Whether a GPU row's time may be the host's rather than its kernels': its 20-80%
    spread exceeds UNSTEADY_SPREAD (CUDA events time a kernel to a few percent, so the
    spread is a host that now and then falls behind, or a disturbed machine), or, in a file
    timed without the device's head start (no `gpu_timer`: triton's do_bench), its host
    time per call (host_ms) reaches its time (the host set the pace). CPU rows are never
    called so: their spread is the shared machine's, met by timing in turns."""
    if result.get("device_kind") == "cpu":
        return False
    p20, p80, host = row.get("ms_p20"), row.get("ms_p80"), row.get("host_ms")
    host_paced = "gpu_timer" not in result and host is not None and host >= row["ms"]
    return bool((p20 and p80 and p80 / p20 > UNSTEADY_SPREAD) or host_paced)


def speedups(result: dict, baseline: str = report.BASELINE) -> dict[str, list[float]]:
    """{pass: [baseline ms / fusednorm ms for each case]} of a timed suite, leaving out the
    cases where either row is shaky."""
    out: dict[str, list[float]] = {}
    for (pass_name, *_), by in _cases(result, _case_keys(result)).items():
        if OURS in by and baseline in by:
            if shaky(result, by[OURS]) or shaky(result, by[baseline]):
                continue
            out.setdefault(pass_name, []).append(by[baseline]["ms"] / by[OURS]["ms"])
    return out


def shaky_cases(result: dict) -> tuple[int, int]:
    """(cases with a shaky row of fusednorm, eager or a peer, cases timed)."""
    cases = [by for by in _cases(result, _case_keys(result)).values() if OURS in by]
    return sum(any(shaky(result, by[p]) for p in (OURS, report.BASELINE, COMPILED, LIGER)
                   if p in by) for by in cases), len(cases)


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _span(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def _dtypes(result: dict) -> str:
    seen = dict.fromkeys(r["dtype"] for r in result["rows"])
    return ", ".join(DTYPE_SHORT.get(d, d) for d in seen)


def _shapes(result: dict) -> str:
    ns = sorted({r["N"] for r in result["rows"]})
    ms = sorted({r["M"] for r in result["rows"]})
    n_text = f"{ns[0]}–{ns[-1]}" if len(ns) > 1 else f"{ns[0]}"
    if result["suite"] == "gelu_ffn":
        tokens = f"{ms[0]}" if len(ms) == 1 else f"{ms[0]}–{ms[-1]}"
        return f"{tokens} tokens, d_model {n_text}, hidden 4·d"
    count = len({(r["M"], r["N"]) for r in result["rows"]})
    return f"{count} shape{'s' if count > 1 else ''}, N {n_text}"


def _device_line(result: dict) -> str:
    kernels = result.get("fusednorm_build", "not recorded")
    return f"{result['device']}, torch {result['torch']}, fusednorm kernels: {kernels}"


def _overhead_span(result: dict) -> str:
    ratios = [r["x_torch"] for r in result["rows"] if r.get("x_torch") is not None]
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def _busy(result: dict) -> bool:
    return any(note.startswith(BUSY_PREFIX) for note in result["_notes"])


def _timed_suites(suites: dict[str, dict]) -> list[str]:
    """The timed suites among suites' keys, in page order (TIMED_SUITES)."""
    return [suite for suite in TIMED_SUITES if suite in suites]


def _pass_cells(per_pass: dict[str, list[float]], span) -> list[str]:
    """One cell per pass of report.PASSES: span (_span, _pct_span) of that pass's values."""
    return [span(per_pass.get(p, [])) for p in report.PASSES]


def _pass_table(column: str, suites: dict[str, dict], rows_of) -> list[str]:
    """Markdown lines of a table whose columns are the suite, `column` and one per pass;
    rows_of(suite, result) yields (suite cell, `column` cell, pass cells) for each timed
    suite, in page order."""
    lines = [f"| suite | {column} | forward | backward | forward+backward |",
             "|---|---|--:|--:|--:|"]
    for suite in _timed_suites(suites):
        for name, label, cells in rows_of(suite, suites[suite]):
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    return lines


def summary_table(suites: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per timed suite (and per variant of its rows other than
    plain), fusednorm's speed-up over PyTorch eager per pass (median and range over the
    cases)."""
    def rows_of(suite: str, result: dict):
        for variant, part in by_variant(result).items():
            name = f"`{suite}`" + ("" if variant == PLAIN else f" {variant}")
            yield name, f"{_dtypes(part)}; {_shapes(part)}", _pass_cells(speedups(part), _span)

    return _pass_table("cases", suites, rows_of)


def peers_table(suites: dict[str, dict]) -> list[str]:
    """Markdown lines: per timed suite, fusednorm against the peers timed beside it
    (torch.compile; Liger where the suite has it: peer ms / fusednorm ms) and against the
    floor measured in the same run (% of copy; gelu_ffn: % of the GEMM-only time), median
    (range) over the suite's plain cases, per pass."""
    def rows_of(suite: str, result: dict):
        result = _plain(result)
        for peer in (COMPILED, LIGER):
            per_pass = speedups(result, baseline=peer)
            if per_pass:
                yield f"`{suite}`", f"× {peer}", _pass_cells(per_pass, _span)
        floor_key, floor_name = (("pct_of_gemm", "% of GEMM-only") if suite == "gelu_ffn"
                                 else ("pct_of_copy", "% of copy"))
        floors: dict[str, list[float]] = {}
        for (pass_name, *_), by in _cases(result, _case_keys(result)).items():
            value = by.get(OURS, {}).get(floor_key)
            if value is not None and not shaky(result, by[OURS]):
                floors.setdefault(pass_name, []).append(value)
        if floors:
            yield f"`{suite}`", floor_name, _pass_cells(floors, _pct_span)

    return _pass_table("against", suites, rows_of)


def shaky_note(suites: dict[str, dict]) -> list[str]:
    """Lines saying how many cases had a shaky row, which the summaries leave out of the
    ratios it enters (none: [])."""
    counts = [shaky_cases(_plain(suites[suite])) for suite in _timed_suites(suites)]
    left, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if not left:
        return []
    return ["", f"{left} of these {total} cases had a provider whose time was its host's "
                f"(20–80% spread above {UNSTEADY_SPREAD}×, or host time per call at least its "
                "time): the summaries leave each ratio and % of copy with such a side out, and "
                "the full tables mark it †."]


def _pct_span(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.0f}% ({min(values):.0f}–{max(values):.0f})"


def _image(folder: str) -> Path:
    return IMAGES / f"benchmarks-{folder}.png"


def readme_block(data: dict[str, dict[str, dict]]) -> str:
    """README.md's performance section body, between the markers."""
    lines = [BEGIN, "",
             "fusednorm's time against PyTorch eager's, **median (range) over each suite's "
             "cases**, above 1 faster; from the committed results, per device "
             "([method, hardware and every table](docs/benchmarks.md)):"]
    for folder in README_FOLDERS:
        suites = data.get(folder)
        if not suites:
            continue
        first = next(iter(suites.values()))
        lines += ["", f"**{_device_line(first)}**", ""] + summary_table(suites)
        lines += ["", "Against the peers timed in the same runs (above 1: fusednorm faster) "
                      "and the floor each run measured (% of copy above 100: rows that partly "
                      "fit a CPU's cache):", ""] + peers_table(suites) + shaky_note(suites)
        if "overhead" in suites:
            lines += ["", f"Host time per call on tiny tensors (suite `overhead`): "
                          f"fusednorm's is {_overhead_span(suites['overhead'])} "
                          "PyTorch's (below 1: less)."]
        lines += ["", f"![{folder} summary](docs/img/{_image(folder).name})"]
    return "\n".join(lines + ["", END])


def _stamps_table(data: dict[str, dict[str, dict]]) -> list[str]:
    lines = ["| folder | suite | device | torch | fusednorm kernels | CPU memory | copy GB/s "
             "| busy | commit | date |", "|---|---|---|---|---|---|--:|---|---|---|"]
    for folder, suites in data.items():
        for suite, r in suites.items():
            memory = r.get("cpu_memory", "fresh" if folder.endswith("-fresh-memory") else "–")
            if r["device_kind"] != "cpu":
                memory = "–"
            copy = report._copy_range(r) if "copy_gbps" in r else "–"
            lines.append(
                f"| `{folder}` | [`{suite}`](../benchmarks/results/{folder}/{suite}.md) | "
                f"{r['device']} | {r['torch']} | {r.get('fusednorm_build', '–')} | {memory} | "
                f"{copy} | {'yes' if _busy(r) else 'no'} | `{r['commit'][:7]}` | "
                f"{r['date'][:10]} |")
    return lines


def _suite_table(result: dict) -> list[str]:
    """One row per case: for each pass, fusednorm's × torch / × compile (/ × liger where the
    suite timed Liger) / % of copy (the norm suites) or % of GEMM (gelu_ffn)."""
    ffn = result["suite"] == "gelu_ffn"
    floor_key, floor_name = ("pct_of_gemm", "% GEMM") if ffn else ("pct_of_copy", "% copy")
    keys = _case_keys(result)
    cases = _cases(result, keys)
    passes = list(dict.fromkeys(k[0] for k in cases))
    peers = [COMPILED] + ([LIGER] if any(r["provider"] == LIGER for r in result["rows"]) else [])
    peer_names = " / ".join(f"× {'compile' if p == COMPILED else p}" for p in peers)
    header = list(keys) + [f"{p}: × torch / {peer_names} / {floor_name}" for p in passes]
    if ffn:
        header.append("saved MiB (torch)")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(keys) + "--:|" * (len(header) - len(keys))]
    for case in dict.fromkeys(k[1:] for k in cases):
        cells = [DTYPE_SHORT.get(case[0], case[0])] + [str(v) for v in case[1:]]
        for p in passes:
            by = cases.get((p, *case), {})
            ours = by.get(OURS)
            if ours is None:
                cells.append("n/a")
                continue
            floor = ours.get(floor_key)
            def cell(text: str, other: str | None = None) -> str:
                """text, marked † when a side of it is shaky."""
                marked = shaky(result, ours) or (other in by and shaky(result, by[other]))
                return text + ("†" if marked and text != "–" else "")
            cells.append(" / ".join(
                [cell(_x(_ratio(by.get(peer, {}).get("ms"), ours["ms"])), peer)
                 for peer in [report.BASELINE] + peers]
                + [cell("–" if floor is None else f"{floor:.0f}%")]))
        if ffn:
            fwd = cases.get(("fwd", *case), {})
            ours, theirs = fwd.get(OURS, {}).get("saved_mb"), fwd.get(report.BASELINE, {}).get("saved_mb")
            cells.append("–" if ours is None else f"{ours:g} ({'–' if theirs is None else f'{theirs:g}'})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _overhead_table(result: dict) -> list[str]:
    lines = ["| api | pass | fusednorm µs | torch µs | fusednorm / torch |", "|---|---|--:|--:|--:|"]
    rows = result["rows"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        lines.append(f"| {ours['api']} | {ours['pass']} | {ours['us']:.2f} | {theirs['us']:.2f} | "
                     f"{ours['x_torch']:.2f} |")
    return lines


def _accuracy_table(result: dict) -> list[str]:
    """The largest error of each output (over the reference's largest value), fusednorm and
    torch, per op at each row offset: the worst over the shapes."""
    worst: dict[tuple, dict[str, float]] = {}
    fields: dict[str, list[str]] = {}
    for row in result["rows"]:
        names = [k for k in row if k not in ("op", "M", "N", "offset", "provider")]
        fields.setdefault(row["op"], names)
        cell = worst.setdefault((row["op"], row["offset"], row["provider"]), {})
        for k in names:
            cell[k] = max(cell.get(k, 0.0), row[k])
    lines = []
    for op, names in fields.items():
        lines += ["", f"`{op}`, float32 rows at offset + N(0, 1), worst over the shapes:", "",
                  "| offset | provider | " + " | ".join(names) + " |",
                  "|--:|---|" + "--:|" * len(names)]
        for (o, offset, provider), cell in worst.items():
            if o == op:
                lines.append(f"| {offset:g} | {provider} | "
                             + " | ".join(f"{cell[k]:.1e}" for k in names) + " |")
    return lines


def page(data: dict[str, dict[str, dict]]) -> str:
    """docs/benchmarks.md."""
    lines = ["# Benchmarks", "",
             "<!-- Written by `python -m benchmarks.docs_page` from benchmarks/results/*/*.json; "
             "do not edit. -->", "",
             "fusednorm against PyTorch eager, `torch.compile` and the memory or GEMM floor, "
             "from the committed results of `python -m benchmarks --save` "
             "(`bash scripts/bench.sh` runs the same suites and writes to the untracked "
             "`bench-out/`).", "", METHOD.rstrip(), "", "## Hardware and versions", "",
             "The stamp of each results file. The CPU runs are from virtual machines with "
             "2 vCPUs, shared with other work, whose memory bandwidth moves in phases: AMD "
             "EPYC, a Zen 4 with AVX-512 (`amd-epyc`, `amd-epyc-fresh-memory`) and a Zen 3 "
             "with AVX2 only (`amd-epyc-avx2`, slower memory), and an Intel Xeon with "
             "AVX-512 (`intel-xeon-processor`) whose last-level cache reads 480 MiB, so the "
             "cycled input sets of the smaller cases stay in it. Compare a run's rows by their "
             "ratios to the providers timed beside them. The GPU runs are from machines lent for minutes "
             "([`gpu_runs/`](gpu_runs/README.md)).", ""] + _stamps_table(data)
    for folder, suites in data.items():
        first = next(iter(suites.values()))
        title = _device_line(first)
        if folder.endswith("-fresh-memory"):
            title += " (`--cpu-memory fresh`)"
        lines += ["", f"## {title}", "", f"Folder [`benchmarks/results/{folder}/`]"
                  f"(../benchmarks/results/{folder}/): each suite's full tables (`.md`), "
                  "plot (`.png`) and data (`.json`).", "", "Summary, fusednorm's speed-up "
                  "over PyTorch eager, median (range) over the cases:", ""]
        lines += summary_table(suites) + shaky_note(suites)
        for suite in _timed_suites(suites):
            r = suites[suite]
            lines += ["", f"### `{suite}`" + (" (busy machine: see the notes of its table)"
                                              if _busy(r) else ""), ""] + _suite_table(r)
        if "overhead" in suites:
            lines += ["", "### `overhead`: host time per call", ""] + _overhead_table(suites["overhead"])
        if "accuracy_far_rows" in suites:
            lines += ["", "### `accuracy_far_rows`: errors against float64 (not a timing)"]
            lines += _accuracy_table(suites["accuracy_far_rows"])
    return "\n".join(lines) + "\n"


def with_block(readme: str, block: str) -> str:
    """readme with the text between the markers (inclusive) replaced by block."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    return readme[:start] + block + readme[end + len(END):]


def draw(suites: dict[str, dict], path: Path) -> None:
    """The device's summary plot: per suite and pass, fusednorm's median speed-up over
    PyTorch eager with the range over the cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _timed_suites(suites)
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(names) * len(report.PASSES) / 2 + 1.4))
    height = 0.8 / len(report.PASSES)
    for j, pass_name in enumerate(report.PASSES):
        ys, med, lo, hi = [], [], [], []
        for i, suite in enumerate(names):
            values = speedups(_plain(suites[suite])).get(pass_name)
            if values:
                m = statistics.median(values)
                ys.append(i + (j - 1) * height)
                med.append(m)
                lo.append(m - min(values))
                hi.append(max(values) - m)
        ax.barh(ys, med, height=height, xerr=[lo, hi], color=f"C{j}", label=pass_name,
                error_kw=dict(elinewidth=0.8, capsize=2))
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("× PyTorch eager (median over cases, bars: range)")
    ax.set_title(_device_line(next(iter(suites.values()))), fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def outputs(data: dict[str, dict[str, dict]] | None = None) -> dict[Path, str]:
    """{file: the text this script writes there}: docs/benchmarks.md and README.md."""
    data = load() if data is None else data
    return {PAGE: page(data), README: with_block(README.read_text(), readme_block(data))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.docs_page", description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when a committed page is not what this writes")
    args = p.parse_args(argv)
    data = load()
    stale = [path for path, text in outputs(data).items()
             if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(stamp.REPO_ROOT)} is stale: run python -m "
                  "benchmarks.docs_page", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs(data).items():
        path.write_text(text)
    IMAGES.mkdir(parents=True, exist_ok=True)
    for folder in README_FOLDERS:
        if folder in data:
            draw(data[folder], _image(folder))
    print(f"wrote {PAGE.relative_to(stamp.REPO_ROOT)}, README.md's benchmarks block and "
          f"{IMAGES.relative_to(stamp.REPO_ROOT)}/benchmarks-*.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
