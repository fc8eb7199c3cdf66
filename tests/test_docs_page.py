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


def test_peers_table_states_each_peer_and_the_floor_per_pass():
    """Two cases: fusednorm 1 ms, torch.compile 0.5 and 2 ms, Liger 3 ms (forward only), at
    40% and 80% of copy: medians and ranges per pass, a peer's row only where it was timed."""
    def row(pass_, n, provider, ms, pct=None):
        return {"pass": pass_, "dtype": "bfloat16", "M": 8, "N": n, "provider": provider,
                "ms": ms, "pct_of_copy": pct}
    rows = [row("fwd", 1024, "fusednorm", 1.0, 40.0), row("fwd", 1024, "torch.compile", 0.5),
            row("fwd", 1024, "liger", 3.0),
            row("fwd", 2048, "fusednorm", 1.0, 80.0), row("fwd", 2048, "torch.compile", 2.0),
            row("bwd", 1024, "fusednorm", 2.0, 50.0), row("bwd", 1024, "torch.compile", 2.0)]
    lines = docs_page.peers_table({"layer_norm": {"suite": "layer_norm", "rows": rows}})
    assert lines[2] == "| `layer_norm` | × torch.compile | 1.25× (0.50–2.00) | 1.00× (1.00–1.00) | – |"
    assert lines[3] == "| `layer_norm` | × liger | 3.00× (3.00–3.00) | – | – |"
    assert lines[4] == "| `layer_norm` | % of copy | 60% (40–80) | 50% (50–50) | – |"
    assert len(lines) == 5


def test_variant_rows_get_summary_rows_of_their_own():
    """An add_* file with the variants' rows: the suite's summary and peers rows stay those
    of its plain cases; each other variant gets a summary row of its own (– where fusednorm
    was not timed), and the suite's table a variant column, n/a where fusednorm is absent."""
    def row(pass_, variant, provider, ms, pct=None):
        return {"pass": pass_, "dtype": "bfloat16", "M": 8, "N": 1024, "variant": variant,
                "provider": provider, "ms": ms, "pct_of_copy": pct}
    rows = [row("fwd", "plain", "fusednorm", 1.0, 80.0), row("fwd", "plain", "torch", 2.0),
            row("fwd", "plain", "torch.compile", 1.0),
            row("fwd", "fp32-residual", "fusednorm", 1.0, 60.0),
            row("fwd", "fp32-residual", "torch", 4.0),
            row("fwd", "fp32-residual", "torch.compile", 3.0),
            row("fwd", "dropout", "torch", 3.0), row("fwd", "dropout", "torch.compile", 2.0)]
    result = {"suite": "add_layer_norm", "rows": rows}
    summary = docs_page.summary_table({"add_layer_norm": result})
    assert summary[2:] == [
        "| `add_layer_norm` | bf16; 1 shape, N 1024 | 2.00× (2.00–2.00) | – | – |",
        "| `add_layer_norm` fp32-residual | bf16; 1 shape, N 1024 | 4.00× (4.00–4.00) | – | – |",
        "| `add_layer_norm` dropout | bf16; 1 shape, N 1024 | – | – | – |"]
    assert docs_page.peers_table({"add_layer_norm": result})[2:] == [
        "| `add_layer_norm` | × torch.compile | 1.00× (1.00–1.00) | – | – |",
        "| `add_layer_norm` | % of copy | 80% (80–80) | – | – |"]
    table = docs_page._suite_table(result)
    assert table[0] == "| dtype | M | N | variant | fwd: × torch / × compile / % copy |"
    assert table[2:] == ["| bf16 | 8 | 1024 | plain | 2.00× / 1.00× / 80% |",
                         "| bf16 | 8 | 1024 | fp32-residual | 4.00× / 3.00× / 60% |",
                         "| bf16 | 8 | 1024 | dropout | n/a |"]


def test_shaky_gpu_rows_leave_the_summaries_and_are_counted_and_marked():
    """A GPU case where fusednorm's, eager's or a peer's row spreads over 1.25x from its 20th
    to its 80th percentile, or (timed by do_bench) its host time per call reaches its time:
    the ratios with that row on a side leave the summaries, the note under them counts the
    case, the suite's table marks them †; a CPU file's rows are never called so."""
    def row(n, provider, ms, p20, p80, pct=None):
        return {"pass": "fwd", "dtype": "bfloat16", "M": 8, "N": n, "provider": provider,
                "ms": ms, "ms_p20": p20, "ms_p80": p80, "pct_of_copy": pct}
    rows = [row(1024, "fusednorm", 1.0, 0.99, 1.01, 50.0),
            row(1024, "torch.compile", 2.0, 1.0, 3.0), row(1024, "torch", 3.0, 2.9, 3.1),
            row(2048, "fusednorm", 1.0, 0.99, 1.01, 60.0),
            row(2048, "torch.compile", 1.5, 1.45, 1.55), row(2048, "torch", 3.0, 2.9, 3.1),
            row(4096, "fusednorm", 1.0, 0.5, 1.5, 10.0),
            row(4096, "torch.compile", 1.0, 0.99, 1.01), row(4096, "torch", 2.0, 1.99, 2.01),
            row(8192, "fusednorm", 1.0, 0.99, 1.01, 70.0),
            dict(row(8192, "torch.compile", 1.2, 1.19, 1.21), host_ms=1.3),
            dict(row(8192, "torch", 2.0, 1.99, 2.01), host_ms=0.1)]
    gpu = {"suite": "layer_norm", "device_kind": "cuda", "rows": rows}
    assert docs_page.peers_table({"layer_norm": gpu})[2:] == [
        "| `layer_norm` | × torch.compile | 1.50× (1.50–1.50) | – | – |",
        "| `layer_norm` | % of copy | 60% (50–70) | – | – |"]
    assert docs_page.summary_table({"layer_norm": gpu})[2].endswith("| 3.00× (2.00–3.00) | – | – |")
    (note,) = [line for line in docs_page.shaky_note({"layer_norm": gpu}) if line]
    assert note.startswith("3 of these 4 cases")
    table = docs_page._suite_table(gpu)
    assert table[2].endswith("| 3.00× / 2.00×† / 50% |")
    assert table[3].endswith("| 3.00× / 1.50× / 60% |")
    assert table[4].endswith("| 2.00×† / 1.00×† / 10%† |")
    assert table[5].endswith("| 2.00× / 1.20×† / 70% |")

    # Timed with the device's head start (gpu_timer), a row's time is its kernels' however
    # long its host part: host_ms no longer makes it shaky, the spread still does.
    timed = dict(gpu, gpu_timer="head-start")
    assert docs_page.peers_table({"layer_norm": timed})[2] == (
        "| `layer_norm` | × torch.compile | 1.35× (1.20–1.50) | – | – |")

    cpu = dict(gpu, device_kind="cpu")
    assert docs_page.peers_table({"layer_norm": cpu})[2] == (
        "| `layer_norm` | × torch.compile | 1.35× (1.00–2.00) | – | – |")
    assert docs_page.shaky_note({"layer_norm": cpu}) == []
