"""docs/benchmarks.md and README.md's performance block are written by
`python -m benchmarks.docs_page` from the committed results files: a results file changed
without regenerating them, or a hand edit of either, fails here. (Reads JSON only: no
compiled library, no timing.)"""
from __future__ import annotations

import pytest

from benchmarks import docs_page


def test_committed_pages_are_what_the_script_writes():
    for path, text in docs_page.outputs().items():
        assert path.read_text() == text, (
            f"{path.name} differs from what `python -m benchmarks.docs_page` writes from "
            "benchmarks/results/: run it and commit the result")


def test_readme_block_sits_between_its_markers_and_only_there():
    readme = docs_page.README.read_text()
    assert readme.count(docs_page.BEGIN) == 1 and readme.count(docs_page.END) == 1
    assert "| `layer_norm` |" in readme.split(docs_page.BEGIN)[1].split(docs_page.END)[0]


def test_a_changed_result_makes_the_page_stale():
    data = docs_page.load()
    first = data["nvidia-h200"]["layer_norm"]["rows"][0]
    assert first["provider"] == "fusednorm"
    before = docs_page.page(data)
    first["ms"] *= 2
    assert docs_page.page(data) != before
    assert docs_page.readme_block(data) != docs_page.readme_block(docs_page.load())


def test_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        docs_page.with_block("# no markers here\n", "block")


def test_every_summary_plot_is_committed():
    for folder in docs_page.README_FOLDERS:
        assert (docs_page.IMAGES / f"benchmarks-{folder}.png").stat().st_size > 0
