"""`python -m benchmarks.replot FOLDER...`: redraws each <suite>.png in FOLDER from its
<suite>.json and the notes of its <suite>.md, with the current plotting code. Nothing is
timed again: the figures stay those of the run (and its stamp: device, torch, commit, date,
busy warning)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_gelu_ffn, bench_layer_norm, bench_norm_family, bench_overhead

DRAW = {bench_layer_norm.SUITE: bench_layer_norm.draw, bench_gelu_ffn.SUITE: bench_gelu_ffn.draw,
        **{suite: bench_norm_family.draw for suite in bench_norm_family.SUITES},
        bench_overhead.SUITE: bench_overhead.plot}


def notes_of(markdown: str) -> list[str]:
    """The bullet lines under 'Notes:' of a results Markdown file (overhead.md, whose notes
    follow its table without that heading: its bullet lines)."""
    _, found, tail = markdown.partition("\nNotes:\n")
    if not found:
        tail = markdown
    return [line[2:] for line in tail.splitlines() if line.startswith("- ")]


def replot(folder: Path) -> list[Path]:
    """Redraws every known suite's PNG in folder; returns the files written."""
    written = []
    for suite, draw in DRAW.items():
        results = folder / f"{suite}.json"
        if not results.exists():
            continue
        md = results.with_suffix(".md")
        notes = notes_of(md.read_text()) if md.exists() else []
        png = results.with_suffix(".png")
        draw(json.loads(results.read_text()), png, notes)
        written.append(png)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replot", description=__doc__)
    p.add_argument("folders", nargs="+", type=Path, help="results folders, e.g. bench-out/<device>")
    for folder in p.parse_args(argv).folders:
        written = replot(folder)
        if not written:
            raise SystemExit(f"no results (<suite>.json) in {folder}")
        for png in written:
            print(f"redrew {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
