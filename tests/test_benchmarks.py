"""The benchmark scripts' plumbing: tiny runs whose results files must keep docs/DESIGN.md's
format, and a wrong provider that must be refused before it is timed. (No timing is
judged here: benchmarks, never tests, carry performance numbers.)"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fusednorm
from benchmarks import (bench_gelu_ffn, bench_layer_norm, busy, cli, harness, plotting, run_all,
                        runner, stamp)

TOP_KEYS = ["suite", "device", "device_kind", "torch", "fusednorm_build",
            "build_matches_sources", "commit", "date",
            "cpu_memory", "copy_gbps", "rows"]
ROW_KEYS = ["pass", "dtype", "M", "N", "provider", "ms", "ms_p20", "ms_p80", "gbps",
            "pct_of_copy", "copy_gbps", "peak_mem_mb", "saved_mb"]
FFN_ROW_KEYS = ROW_KEYS + ["hidden", "tflops", "pct_of_gemm"]
NORM_ROW_KEYS = ROW_KEYS + ["pct_of_fresh_copy"]  # the norm suites' floor


def _run(module, tmp_path, *argv):
    # --cpu-memory fresh: glibc's defaults, which the test process keeps (reuse would change
    # malloc for the rest of it; test_cpu_memory_reuse runs that in a subprocess).
    args = module.parser().parse_args(
        ["--device", "cpu", "--out", str(tmp_path), "--time-per-measurement", "0.01",
         "--cpu-memory", "fresh", *argv])
    return module.run(args)


def _check_files(result, folder, suite):
    assert json.loads((folder / f"{suite}.json").read_text()) == result
    assert (folder / f"{suite}.md").read_text().startswith(f"# {suite} on ")
    assert (folder / f"{suite}.png").stat().st_size > 0


def test_layer_norm_results_format(tmp_path):
    result, md, folder = _run(bench_layer_norm, tmp_path, "--shapes", "64x32,7x5",
                              "--dtypes", "fp32,bf16", "--providers", "fusednorm,torch,fresh-copy")
    assert list(result) == TOP_KEYS
    assert result["suite"] == "layer_norm" and result["device_kind"] == "cpu"
    cpu = fusednorm.build_info()["cpu_capability"]
    assert result["fusednorm_build"].startswith(f"cpu {cpu}") and cpu in md
    assert result["copy_gbps"] > 0
    assert len(result["rows"]) == 3 * 2 * 2 * 3  # passes x shapes x dtypes x providers
    floor_ms = {(r["pass"], r["dtype"], r["M"]): r["ms"] for r in result["rows"]
                if r["provider"] == "fresh-copy"}
    for row in result["rows"]:
        assert sorted(row) == sorted(NORM_ROW_KEYS)
        floor = floor_ms[row["pass"], row["dtype"], row["M"]]
        assert row["pct_of_fresh_copy"] == pytest.approx(100 * floor / row["ms"], rel=1e-2)
        assert row["ms_p20"] <= row["ms"] <= row["ms_p80"]
        # % copy is against the probe timed in turns with the row's pass and case: the same
        # for every provider of it, never above the run's best.
        assert row["pct_of_copy"] == pytest.approx(100 * row["gbps"] / row["copy_gbps"],
                                                   rel=1e-2)
        assert 0 < row["copy_gbps"] <= result["copy_gbps"]
        probe = {(r["provider"], r["copy_gbps"]) for r in result["rows"]
                 if (r["pass"], r["dtype"], r["M"]) == (row["pass"], row["dtype"], row["M"])}
        assert len({gbps for _, gbps in probe}) == 1
    assert [r["pass"] for r in result["rows"]][::12] == ["fwd", "bwd", "fwd+bwd"]
    assert "fusednorm % of fresh-copy" in md and "fresh-copy × torch" not in md
    _check_files(result, folder, "layer_norm")
    assert "fusednorm × torch" in md
    # The training-step table: each provider's fwd+bwd over its fwd + bwd, from the rows.
    ms = {(r["pass"], r["dtype"], r["M"], r["provider"]): r["ms"] for r in result["rows"]}
    ratio = ms["fwd+bwd", "float32", 64, "torch"] / (ms["fwd", "float32", 64, "torch"]
                                                      + ms["bwd", "float32", 64, "torch"])
    section = md.split("## fwd+bwd against fwd + bwd")[1]
    float32_line = next(line for line in section.splitlines() if line.startswith("| float32 | 64 |"))
    assert f"= {ratio:.2f} |" in float32_line  # torch's column, before the floor's


def test_gelu_ffn_results_format(tmp_path):
    result, md, folder = _run(bench_gelu_ffn, tmp_path, "--shapes", "16x8",
                              "--providers", "torch,gemm-only", "--passes", "fwd,fwd+bwd")
    assert list(result) == TOP_KEYS
    assert {r["provider"] for r in result["rows"]} == {"torch", "gemm-only"}
    for row in result["rows"]:
        assert sorted(row) == sorted(FFN_ROW_KEYS)
        assert (row["M"], row["N"], row["hidden"]) == (16, 8, 32)
        if row["provider"] == "gemm-only":  # the floor: timed, memory not measured
            assert row["pct_of_gemm"] == 100
            assert row["peak_mem_mb"] is None and row["saved_mb"] is None
        else:
            assert (row["saved_mb"] is None) == (row["pass"] != "fwd")
    # Eager keeps fc1's output and the GELU output, [16, 32] float32 each (the input and
    # parameters existed before the call).
    saved = {r["provider"]: r["saved_mb"] for r in result["rows"] if r["pass"] == "fwd"}
    if saved["torch"] is not None:  # None where the allocator cannot be observed
        assert saved["torch"] == pytest.approx(2 * 16 * 32 * 4 / 2**20, rel=0.05)
    _check_files(result, folder, "gelu_ffn")


def test_wrong_provider_is_not_timed():
    x = torch.randn(8, 4, requires_grad=True)
    dy = torch.randn(8, 4)

    def reference():
        x64 = x.detach().double().requires_grad_()
        y = x64 * 2
        return [y.detach(), *torch.autograd.grad(y, [x64], dy.double())]

    case = runner.Case(
        dtype=torch.float32, fields={"M": 8, "N": 4}, inputs=[(x, dy)],
        providers=[runner.Provider("torch", lambda t: t * 2, []),
                   runner.Provider("wrong", lambda t: t * 2.01, [])],
        reference=reference, output_names=["y", "dx"],
        bytes={"fwd": 1, "bwd": 1, "fwd+bwd": 1})
    settings = runner.Settings("test", torch.device("cpu"), ["fwd"], budget_s=0.01)
    result = runner.run(settings, [lambda: case], providers_per_case=2)
    assert [r["provider"] for r in result["rows"]] == ["torch"]
    assert any("SKIPPED wrong" in note and "relative error" in note for note in settings.notes)


def test_cli_parsing():
    assert cli.parse_shapes("4096x1024, 8x4x16") == [(4096, 1024), (8, 4, 16)]
    assert cli.parse_dtypes("bf16,float32") == [torch.bfloat16, torch.float32]
    assert cli.parse_passes("fwd+bwd,fwd") == ["fwd", "fwd+bwd"]
    for bad in (lambda: cli.parse_shapes("4096"), lambda: cli.parse_dtypes("int8"),
                lambda: cli.parse_passes("back")):
        with pytest.raises(Exception):
            bad()


def test_overhead_results_format(tmp_path):
    from benchmarks import bench_overhead

    args = bench_overhead.parser().parse_args(["--device", "cpu", "--out", str(tmp_path), "--quick",
                                               "--cpu-memory", "fresh"])
    result, md, folder = bench_overhead.run(args)
    assert list(result) == [k for k in TOP_KEYS if k != "copy_gbps"]
    # --cpu-memory fresh: recorded, and written beside the default run's folder.
    assert result["cpu_memory"] == "fresh" and folder.name.endswith("-fresh-memory")
    apis = {"layer_norm", "layer_norm bfloat16", "FusedLayerNorm", "rms_norm", "add_layer_norm",
            "add_rms_norm", "FusedAddLayerNorm", "FusedAddRMSNorm", "gelu_ffn", "FusedGeluFFN",
            "FusedLayerNormGeluFFN"}
    variants = {f"{op} {v}" for op in ("add_layer_norm", "add_rms_norm")
                for v in ("fp32-residual", "dropout")}  # forward+backward only
    assert {r["api"] for r in result["rows"]} == apis | variants
    passes = {(r["api"], r["pass"], r["provider"]) for r in result["rows"]}
    assert len(passes) == len(result["rows"]) == (len(apis) * 3 + len(variants)) * 2
    assert {p for api, p, _ in passes if api in variants} == {"fwd+bwd"}
    for ours, theirs in zip(result["rows"][::2], result["rows"][1::2]):
        assert (ours["provider"], theirs["provider"]) == ("fusednorm", "torch")
        assert ours["x_torch"] == pytest.approx(ours["us"] / theirs["us"], rel=1e-2)
        assert 0 < ours["us_p20"] <= ours["us"] <= ours["us_p80"]
    _check_files(result, folder, "overhead")
def _out(*argv):
    return cli.out_root(bench_layer_norm.parser().parse_args(list(argv)))


def _git_ignores(path) -> bool:
    """Whether git ignores `path` in this checkout (True: a run there leaves git status clean)."""
    import subprocess

    probe = path / "some-device" / "layer_norm.json"
    done = subprocess.run(["git", "-C", str(stamp.REPO_ROOT), "check-ignore", "-q", str(probe)])
    return done.returncode == 0


def test_default_output_is_untracked_and_outside_results():
    """A plain run (and a --quick one) must not write into the committed results."""
    import shutil

    if shutil.which("git") is None or not (stamp.REPO_ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    for out in (_out(), _out("--quick")):
        assert stamp.RESULTS_DIR not in (out, *out.parents), out
        assert _git_ignores(out), f"{out} is not ignored by git"
    assert not _git_ignores(stamp.RESULTS_DIR)  # the published files stay tracked


@pytest.fixture
def built_from_sources(monkeypatch):
    """--save's tests of other rules, whatever the state of this checkout's build."""
    monkeypatch.setattr(stamp, "build_matches_sources", lambda: True)


def test_save_writes_the_committed_results_and_only_then(built_from_sources):
    assert _out("--save") == stamp.RESULTS_DIR
    assert _out("--out", "/tmp/x") == Path("/tmp/x")
    with pytest.raises(SystemExit):
        _out("--save", "--quick")  # a smoke run is not published
    with pytest.raises(SystemExit):
        _out("--save", "--out", "/tmp/x")  # argparse: mutually exclusive


@pytest.mark.parametrize("subset", [["--passes", "fwd"], ["--dtypes", "bf16"],
                                    ["--shapes", "64x32"], ["--providers", "fusednorm,torch"]])
def test_save_refuses_a_subset_of_the_run(subset, built_from_sources):
    """Published files hold the default run's cases: --save refuses the options that leave
    some out (and python -m benchmarks --passes too)."""
    assert _out(*subset) == stamp.LOCAL_DIR  # without --save: fine
    with pytest.raises(SystemExit, match=subset[0]):
        _out("--save", *subset)
    assert _out("--save", "--passes", "fwd,bwd,fwd+bwd") == stamp.RESULTS_DIR  # all three
    with pytest.raises(SystemExit, match="--passes"):
        cli.out_root(run_all.parser().parse_args(["--save", "--passes", "bwd"]))


def test_save_refuses_when_fusednorm_cannot_run(tmp_path, monkeypatch, built_from_sources):
    """--save without fusednorm's kernels for the device would publish files without its
    rows: refused before anything is timed, and nothing is written."""
    from benchmarks import availability

    monkeypatch.setattr(stamp, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(availability, "fusednorm_skip_reason",
                        lambda device, op, api: "no compiled cpu kernel for fusednorm::norm_fwd*")
    args = bench_layer_norm.parser().parse_args(
        ["--device", "cpu", "--save", "--cpu-memory", "fresh"])
    with pytest.raises(SystemExit, match="no compiled cpu kernel"):
        bench_layer_norm.run(args)
    assert not (tmp_path / "results").exists()
    # Without --save the run goes on, the absence named in the notes.
    notes = []
    names = bench_layer_norm.usable_providers(["fusednorm", "torch"], torch.device("cpu"), notes)
    cli.refuse_save(argparse.Namespace(save=False), "layer_norm", torch.device("cpu"),
                    ["fusednorm", "torch"], names, notes)
    assert names == ["torch"] and notes[0].startswith("fusednorm not benchmarked")


@pytest.fixture
def nothing_timed(monkeypatch):
    """The suites whose cases reached the harness (runner.run), none of them timed."""
    timed = []

    def run(settings, case_builders, providers_per_case):
        timed.append(settings.suite)
        raise AssertionError(f"{settings.suite} was to be refused before it was timed")

    monkeypatch.setattr(runner, "run", run)
    return timed


@pytest.mark.parametrize("suites, missing, refused", [
    ("layer_norm,gelu_ffn", {"gelu_ffn_fwd"}, ["gelu_ffn"]),  # the last suite refused
    ("gelu_ffn,overhead", {"norm_fwd"}, ["overhead"]),        # overhead's own refusal
    ("gelu_ffn,rms_norm,add_layer_norm", {"norm_fwd"}, ["rms_norm", "add_layer_norm"]),
    ("layer_norm,gelu_ffn", {"norm_fwd", "gelu_ffn_fwd"}, ["layer_norm", "gelu_ffn"]),
])
def test_save_checks_every_suite_before_any_runs(suites, missing, refused, tmp_path,
                                                 monkeypatch, built_from_sources,
                                                 nothing_timed):
    """python -m benchmarks --save is all or nothing: a suite that --save refuses (here:
    fusednorm has no kernel for its op) stops the run before any suite is timed or writes
    a file, and the error names each suite refused."""
    from benchmarks import availability, bench_overhead

    monkeypatch.setattr(stamp, "RESULTS_DIR", tmp_path / "results")
    real = availability.fusednorm_skip_reason
    monkeypatch.setattr(availability, "fusednorm_skip_reason", lambda device, op, api: (
        f"no compiled cpu kernel for fusednorm::{op}*" if op in missing
        else real(device, op, api)))
    monkeypatch.setattr(bench_overhead, "measure", lambda *a: pytest.fail("overhead timed"))
    with pytest.raises(SystemExit) as refusal:
        run_all.main(["--save", "--device", "cpu", "--cpu-memory", "fresh",
                      "--suites", suites])
    message = str(refusal.value.code)
    assert message.startswith("--save: no suite run, nothing written")
    assert [name for name in suites.split(",") if f"[{name}]" in message] == refused
    assert nothing_timed == [] and not (tmp_path / "results").exists()


def test_results_record_whether_the_build_matches_the_sources(monkeypatch):
    """A stale build (compiled from other sources than the checkout's) would publish old
    timings under the new commit: the stamp records it, --save refuses it."""
    from fusednorm import _build_config, _build_stamp

    current = _build_stamp.source_hash(stamp.REPO_ROOT)
    monkeypatch.setattr(_build_config, "SOURCE_HASH", current, raising=False)
    assert stamp.build_matches_sources() is True
    assert stamp.header("layer_norm", torch.device("cpu"))["build_matches_sources"] is True
    assert _out("--save") == stamp.RESULTS_DIR
    monkeypatch.setattr(_build_config, "SOURCE_HASH", "0" * 64)
    assert stamp.build_matches_sources() is False
    assert stamp.header("layer_norm", torch.device("cpu"))["build_matches_sources"] is False
    assert _out() == stamp.LOCAL_DIR  # a default run just records it
    with pytest.raises(SystemExit, match="stale build"):
        _out("--save")
    monkeypatch.delattr(_build_config, "SOURCE_HASH")  # no build record
    assert stamp.build_matches_sources() is None
    with pytest.raises(SystemExit, match="no build record"):
        _out("--save")


def test_stop_after_writes_the_cases_timed_and_says_how_many_were_not(tmp_path):
    """--stop-after (a machine lent for minutes): no case starts after the deadline, the
    first always runs, and the file and its table say how many cases were left out."""
    result, md, folder = _run(bench_layer_norm, tmp_path, "--shapes", "64x32,7x5,9x3",
                              "--dtypes", "fp32", "--providers", "fusednorm,torch",
                              "--stop-after", "0")
    assert result["cases_not_run"] == 2
    assert {(r["M"], r["N"]) for r in result["rows"]} == {(64, 32)}
    assert "incomplete: stopped by --stop-after, 1 of 3 cases timed, the other 2 not run" in md
    _check_files(result, folder, "layer_norm")
    with pytest.raises(SystemExit):
        _out("--save", "--stop-after", "60")  # published results are complete


@pytest.mark.parametrize("argv", [["--suites", ","], ["--suites", ""],
                                  ["--time-per-measurement", "0"],
                                  ["--time-per-measurement", "-0.1"],
                                  ["--time-per-measurement", "nan"]])
def test_run_all_refuses_an_empty_run_and_no_time(argv, capsys):
    """--suites naming none would run nothing and say nothing failed; a measurement of 0 s
    or less times nothing."""
    with pytest.raises(SystemExit) as error:
        run_all.parser().parse_args(argv)
    assert error.value.code == 2 and argv[0] in capsys.readouterr().err
    if argv[0] == "--time-per-measurement":  # every suite's own command line too
        with pytest.raises(SystemExit):
            bench_layer_norm.parser().parse_args(argv)
    assert run_all.parser().parse_args(["--suites", "overhead,", "--time-per-measurement",
                                        "0.01"]).suites == ["overhead"]


def test_run_all_says_where_the_files_are():
    local = run_all.where_note(stamp.LOCAL_DIR / "cpu-x", stamp.LOCAL_DIR)
    assert str(stamp.LOCAL_DIR / "cpu-x") in local and "untracked" in local and "--save" in local
    saved = run_all.where_note(stamp.RESULTS_DIR / "cpu-x", stamp.RESULTS_DIR)
    assert "saved to" in saved and str(stamp.RESULTS_DIR / "cpu-x") in saved


def test_run_all_goes_on_after_a_failed_suite_and_names_it(tmp_path, monkeypatch, capsys,
                                                            built_from_sources):
    """python -m benchmarks without --save: a suite that exits (overhead's own refusal where
    fusednorm cannot run) or raises loses only itself; the later suites still run, stderr
    says which failed and why, and the run exits non-zero naming them. With --save a
    suite's exit still ends the run (its refusals are checked before any suite runs)."""
    from benchmarks import availability, bench_norm_family, bench_overhead

    ran = []

    def written(name):
        def run(args):
            ran.append(name)
            return {}, f"# {name} table", tmp_path / "cpu-x"
        return run

    def broken(args):
        ran.append("gelu_ffn")
        raise RuntimeError("kernel failed\non a second line")

    monkeypatch.setattr(availability, "fusednorm_skip_reason", lambda device, op, api: (
        "no compiled cpu kernel for fusednorm::norm_fwd*" if op == "norm_fwd" else None))
    monkeypatch.setattr(bench_overhead, "measure", lambda *a: pytest.fail("overhead timed"))
    monkeypatch.setattr(bench_layer_norm, "run", written("layer_norm"))
    monkeypatch.setattr(bench_gelu_ffn, "run", broken)
    monkeypatch.setattr(bench_norm_family.SUITES["rms_norm"], "run", written("rms_norm"))
    argv = ["--device", "cpu", "--cpu-memory", "fresh",
            "--suites", "overhead,layer_norm,gelu_ffn,rms_norm"]
    with pytest.raises(SystemExit) as failure:
        run_all.main([*argv, "--out", str(tmp_path)])
    assert ran == ["layer_norm", "gelu_ffn", "rms_norm"]
    message = str(failure.value.code)
    assert message.splitlines() == [
        "suite(s) failed: overhead, gelu_ffn",
        "  [overhead] cannot run: no compiled cpu kernel for fusednorm::norm_fwd*",
        "  [gelu_ffn] RuntimeError: kernel failed on a second line"]
    out, err = capsys.readouterr()
    assert "# layer_norm table" in out and "# rms_norm table" in out
    assert re.search(r"^\[overhead\] failed after \d+ s: cannot run: no compiled cpu kernel",
                     err, re.M)
    assert re.search(r"^\[gelu_ffn\] failed after \d+ s: RuntimeError: kernel failed", err, re.M)
    assert "Traceback" in err  # a raised exception's traceback, for the bug it may be
    assert re.search(r"^\[rms_norm\] \d+ s; results written to ", err, re.M)

    # --save: a suite's exit ends the run, as before (check_save stood in for: it passes).
    ran.clear()
    monkeypatch.setattr(stamp, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(run_all, "check_save", lambda args: None)
    with pytest.raises(SystemExit, match=r"^\[overhead\] cannot run"):
        run_all.main([*argv, "--save"])
    assert ran == []


def test_plots_are_stamped():
    result = {"suite": "gelu_ffn", "device": "Some CPU", "device_kind": "cpu",
              "torch": "2.14.1", "commit": "0123456789abcdef0123-dirty",
              "date": "2026-01-02T03:04:05+00:00"}
    quiet = plotting.stamp_lines(result, ["Timing: ..."])
    assert quiet == ["gelu_ffn on Some CPU (cpu)",
                     "torch 2.14.1 · commit 0123456789ab-dirty · 2026-01-02T03:04:05+00:00"]
    warned = plotting.stamp_lines(result, ["other work kept 90% of the CPUs busy when the run "
                                           "started: timings are noisy"])
    assert warned[:2] == quiet and warned[2].startswith("WARNING: other work kept 90%")


def _cpu(busy_s, total_s, own_s, steal_s=0.0):
    return busy.CpuTimes(busy_s=busy_s, total_s=total_s, steal_s=steal_s, own_s=own_s)


def test_busy_warning_counts_other_processes_only():
    start = _cpu(100.0, 1000.0, 10.0)
    # Our own run kept both CPUs busy (60 of 60 CPU-seconds), the probes spread 1.8x: quiet.
    assert busy.busy_note(start, _cpu(160.0, 1060.0, 70.0), [26.4, 47.3, 33.0]) is None
    # Others took 5 of 60 CPU-seconds (8%): under the limit.
    assert busy.busy_note(start, _cpu(165.0, 1060.0, 70.0)) is None
    # Others took 30 of 60 (50%, a third of it steal): warned, with what was seen.
    note = busy.busy_note(start, _cpu(150.0, 1060.0, 30.0, steal_s=10.0), [26.4, 47.3, 33.0])
    assert note.startswith(busy.BUSY_PREFIX)
    assert "took 50% of all CPUs' time (30 of 60 CPU-seconds; 17% was steal" in note
    assert "26.4-47.3 GB/s (1.79x)" in note
    assert busy.busy_note(None, start) is None and busy.busy_note(start, start) is None
    # The plots show it as a warning.
    lines = plotting.stamp_lines({"suite": "s", "device": "d", "device_kind": "cpu",
                                  "torch": "t", "commit": "c", "date": "x"}, [note])
    assert lines[2].startswith("WARNING: " + busy.BUSY_PREFIX)


_BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(busy.sample() is None, reason="needs Linux's /proc")
def test_busy_sample_tells_our_children_from_other_processes(tmp_path):
    """CPU time of a child counts as ours; that of a process outside our tree (a detached
    grandchild, reparented away from us) as other work, and it is warned about."""
    start = busy.sample()
    subprocess.run([sys.executable, "-c", _BURN.format(s=0.5)], check=True)
    assert busy.sample().own_s - start.own_s >= 0.45
    done = tmp_path / "done"
    burn = _BURN.format(s=1.0) + f"open({str(done)!r}, 'w').close()\n"
    launcher = ("import subprocess, sys\n"
                "subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True)\n")
    start = busy.sample()
    subprocess.run([sys.executable, "-c", launcher, burn], check=True)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    end = busy.sample()
    assert end.busy_s - start.busy_s - (end.own_s - start.own_s) >= 0.9
    assert busy.busy_note(start, end).startswith(busy.BUSY_PREFIX)


def test_replot_redraws_from_the_results_files(tmp_path):
    from benchmarks import replot

    _, md, folder = _run(bench_layer_norm, tmp_path, "--shapes", "64x32", "--dtypes", "fp32",
                         "--providers", "torch", "--passes", "fwd")
    png = folder / "layer_norm.png"
    png.unlink()
    assert replot.replot(folder) == [png] and png.stat().st_size > 0
    assert replot.notes_of(md) and all(not n.startswith("- ") for n in replot.notes_of(md))
    assert replot.notes_of("# x\n\nno notes\n") == []


def test_replot_redraws_the_overhead_plot(tmp_path, monkeypatch):
    """The overhead suite's PNG is redrawn too, with its notes (which follow its table
    without a 'Notes:' heading)."""
    from benchmarks import bench_overhead, replot

    result = {"suite": "overhead", "device": "Some CPU", "device_kind": "cpu", "torch": "t",
              "commit": "c", "date": "d", "cpu_memory": "reuse", "rows": [
                  {"api": "layer_norm", "pass": "fwd (no grad)", "provider": "fusednorm",
                   "us": 9.0, "us_p20": 8.0, "us_p80": 10.0, "x_torch": 0.9},
                  {"api": "layer_norm", "pass": "fwd (no grad)", "provider": "torch",
                   "us": 10.0, "us_p20": 9.0, "us_p80": 11.0}]}
    notes = ["other work kept the CPUs busy", "Host µs per call on 4x64 inputs"]
    (tmp_path / "overhead.json").write_text(json.dumps(result))
    (tmp_path / "overhead.md").write_text(bench_overhead.markdown(result, notes))
    drawn = []
    plot = replot.DRAW[bench_overhead.SUITE]
    monkeypatch.setitem(replot.DRAW, bench_overhead.SUITE,
                        lambda r, path, n: (drawn.append(n), plot(r, path, n)))
    assert replot.replot(tmp_path) == [tmp_path / "overhead.png"]
    assert drawn == [notes] and (tmp_path / "overhead.png").stat().st_size > 0


@pytest.mark.parametrize("suite", ["rms_norm", "add_layer_norm", "add_rms_norm"])
def test_norm_family_results_format(tmp_path, suite):
    from benchmarks import bench_norm_family

    module = bench_norm_family.SUITES[suite]
    variants = ["--variants", "plain"] if module.residual else []
    result, md, folder = _run(module, tmp_path, "--shapes", "16x24", "--dtypes", "fp32",
                              "--providers", "fusednorm,fusednorm zero-centered,torch,fresh-copy",
                              "--passes", "fwd,fwd+bwd", *variants)
    assert list(result) == TOP_KEYS and result["suite"] == suite
    assert len(result["rows"]) == 2 * 4  # passes x providers: all ran (the floor unchecked)
    for row in result["rows"]:
        assert sorted(row) == sorted(NORM_ROW_KEYS + (["variant"] if module.residual else []))
        assert row.get("variant", "plain") == "plain"
    _check_files(result, folder, suite)


def _accepts_dropout() -> bool:
    import inspect

    return "dropout_p" in inspect.signature(fusednorm.add_layer_norm).parameters


def test_norm_family_variants_rows(tmp_path):
    """The add_* suites' variants: a row per variant and provider that computes it, n/a in
    the tables for the others (zero-centered), the bytes of norm_variants' rule, dropout
    providers checked against the mask they drew; a fusednorm without dropout_p is named
    as not benchmarked, never crashed on or timed. (add_rms_norm differs in its norm only;
    its bytes are checked below.)"""
    from benchmarks import bench_norm_family

    suite = "add_layer_norm"
    module = bench_norm_family.SUITES[suite]
    result, md, folder = _run(module, tmp_path, "--shapes", "32x40", "--dtypes", "bf16",
                              "--providers", "fusednorm,fusednorm zero-centered,torch,fresh-copy",
                              "--passes", "fwd,bwd",
                              "--variants", "plain,fp32-residual,dropout-rowscale")
    rows = {(r["pass"], r["variant"], r["provider"]): r for r in result["rows"]}
    dropout_fused = _accepts_dropout()
    for pass_name in ("fwd", "bwd"):
        assert {p for (s, v, p) in rows if (s, v) == (pass_name, "plain")} == {
            "fusednorm", "fusednorm zero-centered", "torch", "fresh-copy"}
        assert {p for (s, v, p) in rows if (s, v) == (pass_name, "fp32-residual")} == {
            "fusednorm", "torch", "fresh-copy"}
        assert {p for (s, v, p) in rows if (s, v) == (pass_name, "dropout-rowscale")} == (
            {"fusednorm", "torch", "fresh-copy"} if dropout_fused else {"torch", "fresh-copy"})
    for (pass_name, variant, _), row in rows.items():
        expected = module.pass_bytes(32, 40, torch.bfloat16,
                                     bench_norm_family.VARIANTS[variant])[pass_name]
        assert row["gbps"] == pytest.approx(expected / (row["ms"] * 1e-3) / 1e9, rel=1e-2)
    assert not any("SKIPPED" in line for line in md.splitlines())  # every check passed
    fp32_line = next(line for line in md.splitlines()
                     if line.startswith("| bfloat16 | 32 | 40 | fp32-residual |"))
    assert "n/a" in fp32_line  # zero-centered: plain only
    skipped = "fusednorm not benchmarked on variant dropout-rowscale"
    assert (skipped in md) == (not dropout_fused)
    _check_files(result, folder, suite)


def test_variant_bytes_count_the_float32_stream_and_the_distinct_dx():
    """bf16 x of 3 x 5 (15 elements), LayerNorm (mean and rstd: 8 bytes a row)."""
    from benchmarks import bench_norm_family
    from benchmarks.norm_variants import DROPOUT, DROPOUT_ROWSCALE, FP32_RESIDUAL, PLAIN

    suite = bench_norm_family.ADD_LAYER_NORM
    bf16, stats, w = torch.bfloat16, 3 * 8, 5 * 2
    # fwd: x 2 + r 2 + y 2 + s 2 bytes per element; bwd: s, dy, ds, dx (= dr) 2 each.
    assert suite.pass_bytes(3, 5, bf16, PLAIN) == {
        "fwd": 8 * 15 + w + stats, "bwd": 8 * 15 + stats + 2 * w, "fwd+bwd": 16 * 15 + 3 * w + 2 * stats}
    # fp32 r and s: fwd x 2 + r 4 + y 2 + s 4; bwd s 4 + dy 2 + ds 4 + dr 4, and dx 2
    # written in the same pass (dr not read again).
    assert suite.pass_bytes(3, 5, bf16, FP32_RESIDUAL)["fwd"] == 12 * 15 + w + stats
    assert suite.pass_bytes(3, 5, bf16, FP32_RESIDUAL)["bwd"] == 16 * 15 + stats + 2 * w
    # dropout: no more forward bytes; bwd: dx written beside dr (2).
    assert suite.pass_bytes(3, 5, bf16, DROPOUT)["fwd"] == 8 * 15 + w + stats
    assert suite.pass_bytes(3, 5, bf16, DROPOUT)["bwd"] == 10 * 15 + stats + 2 * w
    # rowscale: [3] float32 read in each pass.
    assert suite.pass_bytes(3, 5, bf16, DROPOUT_ROWSCALE)["fwd"] == 8 * 15 + w + stats + 12
    assert suite.pass_bytes(3, 5, bf16, DROPOUT_ROWSCALE)["bwd"] == 10 * 15 + stats + 2 * w + 12
    # RMSNorm: rstd alone; float32 input: fp32-residual is plain (not timed there).
    rms = bench_norm_family.ADD_RMS_NORM
    assert rms.pass_bytes(3, 5, bf16)["fwd"] == 8 * 15 + w + 3 * 4
    assert not FP32_RESIDUAL.applies_to(torch.float32) and FP32_RESIDUAL.applies_to(bf16)


def test_default_variant_cases_are_few():
    """Plain at every default case; the other variants at bf16 only, on the CPU at one shape
    (and not plain dropout) and on the GPU at VARIANT_GPU_NS (quick: not plain dropout;
    --full: VARIANT_GPU_FULL_NS), every case with --all-variant-cases; none in rms_norm."""
    from benchmarks import bench_norm_family as family

    def variant_cases(suite, device, *argv):
        args = family.SUITES[suite].parser().parse_args(["--device", device, *argv])
        found = family.cases(family.SUITES[suite], args, torch.device(device), [])
        return [(d, M, N, v.name) for d, M, N, v in found if v.name != "plain"], found

    others, found = variant_cases("add_rms_norm", "cpu")
    assert {(d, M, N) for d, M, N, v in found if v.name == "plain"} == {
        (d, M, N) for d in family.CPU_DTYPES for M, N in family.CPU_SHAPES}
    assert sorted(v for *_, v in others) == ["dropout-rowscale", "fp32-residual"]
    assert {(d, M, N) for d, M, N, _ in others} == {(torch.bfloat16, 4096, 1024)}
    others, _ = variant_cases("add_layer_norm", "cpu", "--variants", "dropout")
    assert [v for *_, v in others] == ["dropout"]
    others, _ = variant_cases("add_layer_norm", "cuda", "--quick")
    assert sorted(v for *_, v in others) == ["dropout-rowscale", "fp32-residual"]
    assert {N for _, _, N, _ in others} == set(family.VARIANT_GPU_NS)
    others, _ = variant_cases("add_layer_norm", "cuda")
    assert sorted(set(v for *_, v in others)) == ["dropout", "dropout-rowscale", "fp32-residual"]
    assert {(d, N) for d, M, N, _ in others} == {(torch.bfloat16, n) for n in family.VARIANT_GPU_NS}
    others, _ = variant_cases("add_layer_norm", "cuda", "--full")
    assert {(d, N) for d, M, N, _ in others} == {
        (torch.bfloat16, n) for n in family.VARIANT_GPU_FULL_NS}
    others, _ = variant_cases("add_layer_norm", "cuda", "--all-variant-cases")
    assert len({N for *_, N, _ in others}) == len(family.GPU_NS)
    assert {d for d, *_ in others} == set(family.GPU_DTYPES)  # fp32-residual: 16-bit only
    assert not [c for c in others if c[3] == "fp32-residual" and c[0] == torch.float32]
    assert variant_cases("rms_norm", "cuda")[0] == []


class _LigerFusedAddRMSNormStub:
    """What Liger-Kernel 0.8.5's LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset,
    casting_mode, in_place) computes in its "llama" casting mode, in torch ops: s = x + r in
    x's dtype; the norm in float32, rounded to x's dtype before the weight's product; returns
    (y, s). Records each call's scalar arguments."""

    calls: list[tuple] = []

    @staticmethod
    def apply(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False):
        _LigerFusedAddRMSNormStub.calls.append((eps, offset, casting_mode, in_place))
        s = X + R
        s32 = s.float()
        xhat = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(X.dtype)
        return xhat * (offset + W), s


def test_liger_add_rms_norm_is_timed_on_plain_cases_only_and_absent_without_liger(monkeypatch):
    """add_rms_norm's liger provider: Liger's fused add + RMSNorm (its own finder, not
    RMSNorm's), called with eps, offset 0, "llama" and in_place=False (in place, its backward
    would overwrite the benchmark's dy), checked against float64 like every provider; only
    the plain variant; refused off a GPU and where Liger does not import."""
    import importlib.util

    from benchmarks import availability, bench_norm_family as family
    from benchmarks.norm_variants import PLAIN, VARIANTS

    suite = family.ADD_RMS_NORM
    assert suite.find_liger is availability.liger_fused_add_rms_norm
    assert "liger" in suite.providers and "liger" not in family.ADD_LAYER_NORM.providers
    assert [v for v in VARIANTS if "liger" in suite.functions(VARIANTS[v])] == [PLAIN.name]
    if importlib.util.find_spec("liger_kernel") is None:
        assert availability.liger_fused_add_rms_norm() is None

    notes: list[str] = []
    assert family.usable_providers(suite, ["torch", "liger"], torch.device("cpu"), notes) == [
        "torch"]
    assert notes == ["liger not benchmarked: Liger-Kernel runs on GPUs only"]
    notes.clear()
    monkeypatch.setattr(suite, "find_liger", lambda: None)
    assert family.usable_providers(suite, ["liger"], torch.device("cuda"), notes) == []
    assert notes and "liger_kernel is not importable" in notes[0]
    stub = _LigerFusedAddRMSNormStub
    monkeypatch.setattr(suite, "find_liger", lambda: stub)
    assert family.usable_providers(suite, ["liger"], torch.device("cuda"), []) == ["liger"]

    # The wiring on the CPU (the GPU gate bypassed): outputs (y, s) and gradients
    # (dx, dweight, dresidual) pass the float64 check, and it is timed beside torch.
    stub.calls.clear()
    device = torch.device("cpu")
    build = family.case_builder(suite, PLAIN, 16, 24, torch.bfloat16, device, ["torch", "liger"])
    settings = runner.Settings("add_rms_norm", device, ["fwd", "bwd"], budget_s=0.01)
    result = runner.run(settings, [build], providers_per_case=2)
    assert not [n for n in settings.notes if "SKIPPED" in n]
    assert {(r["pass"], r["provider"]) for r in result["rows"]} == {
        (p, name) for p in ("fwd", "bwd") for name in ("torch", "liger")}
    assert stub.calls and set(stub.calls) == {(family.EPS, 0.0, "llama", False)}


def test_save_on_a_gpu_refuses_a_missing_peer():
    """GPU norm suites time Liger-Kernel beside fusednorm: --save on a GPU where it is not
    available refuses, naming it and how to install it; a suite without it (gelu_ffn,
    add_layer_norm) and the CPU (Liger is Triton, GPU only) need none."""
    wanted = ["fusednorm", "torch", "torch.compile", "liger"]
    reason = cli.peer_refusal("cuda", wanted, {"liger": False})
    assert reason and "liger" in reason and "pip install liger-kernel" in reason
    assert cli.peer_refusal("cuda", wanted, {}) == reason  # not said available: missing
    assert cli.peer_refusal("cuda", wanted, {"liger": True}) is None
    assert cli.peer_refusal("cpu", wanted, {"liger": False}) is None
    assert cli.peer_refusal("cuda", ["fusednorm", "torch", "gemm-only"], {"liger": False}) is None


def test_save_on_a_gpu_without_liger_is_refused_before_any_suite_runs(
        tmp_path, monkeypatch, built_from_sources, nothing_timed):
    """python -m benchmarks --save on a GPU without Liger-Kernel: refused up front, naming
    each suite that times it and the install command, nothing timed or written; without
    --save its suites skip it with a note; on the CPU --save does not ask for it. (No GPU
    needed: the device and the availability are stand-ins.)"""
    from benchmarks import availability, bench_norm_family as family

    monkeypatch.setattr(stamp, "RESULTS_DIR", tmp_path / "results")
    resolve_device = cli.resolve_device
    monkeypatch.setattr(cli, "resolve_device", lambda choice, cpu_memory="reuse":
                        torch.device("cuda"))
    monkeypatch.setattr(availability, "fusednorm_skip_reason", lambda device, op, api: None)
    monkeypatch.setattr(availability, "liger_layer_norm", lambda: None)
    for suite in (family.RMS_NORM, family.ADD_RMS_NORM):
        monkeypatch.setattr(suite, "find_liger", lambda: None)
    with pytest.raises(SystemExit) as refusal:
        run_all.main(["--save"])
    message = str(refusal.value.code)
    assert [name for name in run_all.SUITES if f"[{name}]" in message] == [
        "layer_norm", "rms_norm", "add_rms_norm"]
    assert "liger_kernel is not importable (pip install liger-kernel)" in message
    assert nothing_timed == [] and not (tmp_path / "results").exists()

    # Without --save: liger is left out, and the notes say why.
    args = bench_layer_norm.parser().parse_args(["--device", "cuda"])
    names, notes = bench_layer_norm.run_providers(args, torch.device("cuda"))
    assert "liger" not in names and "fusednorm" in names
    assert "liger not benchmarked: liger_kernel is not importable (pip install liger-kernel)" in notes
    # With Liger importable, --save on the GPU goes on.
    monkeypatch.setattr(availability, "liger_layer_norm", lambda: object())
    bench_layer_norm.check_save(bench_layer_norm.parser().parse_args(["--save"]))
    # The CPU: --save asks nothing of Liger.
    monkeypatch.setattr(cli, "resolve_device", resolve_device)
    run_all.check_save(run_all.parser().parse_args(
        ["--save", "--device", "cpu", "--cpu-memory", "fresh"]))


class _LigerRMSNormStub(torch.autograd.Function):
    """Liger-Kernel 0.8.5's LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode,
    in_place=True, row_mode=None) in torch ops ("llama" casting), with its in-place backward:
    in_place=True writes dx into the dy it is given. Records each call's scalar arguments."""

    calls: list[tuple] = []

    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        _LigerRMSNormStub.calls.append((eps, offset, casting_mode, in_place))
        ctx.save_for_backward(X, W)
        ctx.eps, ctx.offset, ctx.in_place = eps, offset, in_place
        x32 = X.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(X.dtype) * (offset + W)

    @staticmethod
    def backward(ctx, dY):
        X, W = ctx.saved_tensors
        with torch.enable_grad():
            x, w = X.detach().requires_grad_(), W.detach().requires_grad_()
            x32 = x.float()
            y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            dx, dw = torch.autograd.grad(y * (ctx.offset + w), [x, w], dY)
        if ctx.in_place:
            dY.copy_(dx)
            dx = dY
        return dx, dw, None, None, None, None, None


def test_liger_rms_norm_leaves_the_benchmarks_dy_alone(monkeypatch):
    """rms_norm's liger provider passes in_place=False (LigerRMSNormFunction's default is
    True: its backward would overwrite the benchmark's dy), with eps, offset 0 and "llama",
    as add_rms_norm's; the case's dy is unchanged after its backward."""
    from benchmarks import bench_norm_family as family
    from benchmarks.norm_variants import PLAIN

    suite = family.RMS_NORM
    stub = _LigerRMSNormStub
    monkeypatch.setattr(suite, "find_liger", lambda: stub)
    stub.calls.clear()
    x = torch.randn(16, 24, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(24, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 24, dtype=torch.bfloat16)
    kept = dy.clone()
    y = suite.functions(PLAIN)["liger"](x, None, w, None)
    torch.autograd.backward(y, dy)
    assert torch.equal(dy, kept)
    assert stub.calls == [(family.EPS, 0.0, "llama", False)]


def test_dropout_reference_reads_the_mask_and_refuses_no_dropout():
    """A random provider is checked against the reference of the mask it drew (from its
    dx); one that keeps every element is refused before it is timed."""
    from benchmarks.norm_variants import kept_mask

    x = torch.randn(64, 64, requires_grad=True)
    dy = torch.randn(64, 64)

    def reference(outputs):
        kept = kept_mask(outputs[1], 0.5)
        x64 = x.detach().double().requires_grad_()
        y = x64 * kept / 0.5
        return [y.detach(), *torch.autograd.grad(y, [x64], dy.double())]

    case = runner.Case(
        dtype=torch.float32, fields={"M": 64, "N": 64}, inputs=[(x, dy)],
        providers=[runner.Provider("torch", lambda t: torch.nn.functional.dropout(t, 0.5), []),
                   runner.Provider("no-dropout", lambda t: t * 2, [])],
        reference=reference, reference_per_provider=True, output_names=["y", "dx"],
        bytes={"fwd": 1, "bwd": 1, "fwd+bwd": 1})
    settings = runner.Settings("test", torch.device("cpu"), ["fwd"], budget_s=0.01)
    result = runner.run(settings, [lambda: case], providers_per_case=2)
    assert [r["provider"] for r in result["rows"]] == ["torch"]
    assert any("SKIPPED no-dropout" in n and "dropout kept 1.0000" in n for n in settings.notes)


@pytest.mark.parametrize("residual", [False, True])
def test_fresh_copy_floor_moves_the_rows_of_a_norm(residual):
    """The floor reads x (and r) and writes new tensors of the same values; its backward
    reads x (s) and the output gradients into a new dx (so it moves what a norm's must)."""
    from benchmarks import floors

    x = torch.randn(5, 7, requires_grad=True)
    r = torch.randn(5, 7, requires_grad=True) if residual else None
    outputs = floors.fresh_copy(x, r)
    outputs = outputs if residual else (outputs,)
    inputs = (x, r) if residual else (x,)
    for out, source in zip(outputs, inputs):
        assert torch.equal(out, source) and out.data_ptr() != source.data_ptr()
    dys = [torch.randn(5, 7) for _ in outputs]
    (dx,) = torch.autograd.grad(outputs, [x], dys)
    expected = dys[1] + dys[0] * r if residual else dys[0] + x
    torch.testing.assert_close(dx, expected.detach())


def test_fresh_copy_floor_of_a_float32_stream_writes_dx_in_a_pass_of_its_own():
    """separate_dx: the gradient in s's dtype (float32), then dx in x's (bfloat16)."""
    from benchmarks import floors

    x = torch.randn(5, 7).to(torch.bfloat16).requires_grad_()
    r = torch.randn(5, 7, requires_grad=True)
    y, s = floors.fresh_copy(x, r, separate_dx=True)
    assert (y.dtype, s.dtype) == (torch.bfloat16, torch.float32)
    dy, ds = torch.randn(5, 7).to(torch.bfloat16), torch.randn(5, 7)
    (dx,) = torch.autograd.grad([y, s], [x], [dy, ds])
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx, (ds + dy.float() * r).detach().to(torch.bfloat16))


def test_default_cpu_cases_cover_every_dtype():
    """The default CPU LayerNorm run times float32, bfloat16 and float16 at every shape,
    float64 at some (an odd N among them), and a quick run no float64."""
    cpu = torch.device("cpu")
    cases = bench_layer_norm.default_cases(cpu, quick=False)
    assert len(set(cases)) == len(cases)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert {(M, N) for d, M, N in cases if d == dtype} == set(bench_layer_norm.CPU_SHAPES)
    fp64 = {(M, N) for d, M, N in cases if d == torch.float64}
    assert fp64 and any(N % 16 for _, N in fp64)
    assert all(d != torch.float64 for d, _, _ in bench_layer_norm.default_cases(cpu, quick=True))


def test_results_folder_names_the_cpu_simd_level_below_avx512():
    """A CPU run's folder: the device's slug for AVX-512 kernels, -avx2 after it for AVX2
    ones (the same model name comes with and without AVX-512), -fresh-memory last; a GPU
    run's stamp names its CPU kernels too, but its folder is the GPU's alone."""
    from benchmarks import report

    def folder(kind, build, memory=None):
        result = {"device": "AMD EPYC", "device_kind": kind, "fusednorm_build": build}
        if memory:
            result["cpu_memory"] = memory
        return report.folder_name(result)

    assert folder("cpu", "cpu avx512, cuda 9.0", "reuse") == "amd-epyc"
    assert folder("cpu", "cpu avx2, cuda 9.0", "reuse") == "amd-epyc-avx2"
    assert folder("cpu", "cpu avx2", "fresh") == "amd-epyc-avx2-fresh-memory"
    assert folder("cpu", "cpu avx512", "fresh") == "amd-epyc-fresh-memory"
    # No CPU kernels (fusednorm ran its reference): a folder of its own, never the AVX-512 one.
    assert folder("cpu", "cpu: reference") == "amd-epyc-reference"
    assert folder("cpu", "cpu: reference, cuda 9.0", "fresh") == "amd-epyc-reference-fresh-memory"
    assert folder("cpu", "something else") == "amd-epyc-something-else"
    assert folder("cuda", "cpu avx2, cuda 9.0") == "amd-epyc"


def test_device_slug_drops_trademark_marks():
    from benchmarks import stamp

    assert stamp.slug("Intel(R) Xeon(R) Processor") == "intel-xeon-processor"
    assert stamp.slug("Intel(R) Core(TM) i9-13900K") == "intel-core-i9-13900k"
    assert stamp.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert stamp.slug("AMD EPYC 9R14 96-Core Processor") == "amd-epyc-9r14-96-core-processor"
    assert stamp.slug("(R)") == "unknown"


def test_cpu_memory_modes_record_themselves_and_keep_apart(tmp_path):
    """The default --cpu-memory reuse (run in a subprocess: it changes malloc for the rest
    of the process) and fresh write to sibling folders, each saying which it was."""
    import subprocess
    import sys

    argv = ["--device", "cpu", "--shapes", "64x32", "--dtypes", "fp32", "--passes", "fwd",
            "--providers", "fusednorm,fresh-copy", "--time-per-measurement", "0.01"]
    subprocess.run([sys.executable, "-m", "benchmarks.bench_layer_norm", "--out", str(tmp_path / "a"),
                    *argv], check=True, cwd=stamp.REPO_ROOT, capture_output=True)
    (reuse_json,) = (tmp_path / "a").glob("*/layer_norm.json")
    reuse = json.loads(reuse_json.read_text())
    assert reuse["cpu_memory"] == "reuse" and not reuse_json.parent.name.endswith("-fresh-memory")
    assert "Memory (--cpu-memory reuse)" in reuse_json.with_suffix(".md").read_text()
    fresh, _, folder = _run(bench_layer_norm, tmp_path / "b", *argv[2:])
    assert fresh["cpu_memory"] == "fresh"
    assert folder.name == reuse_json.parent.name + "-fresh-memory"


def test_kernel_ab_builds_and_times_both_sides():
    """benchmarks.kernel_ab: HEAD's csrc (git archive) and the working tree's compile into one
    binary, and every case prints both sides' times and a positive speed-up (inputs in
    cache: a small footprint)."""
    if shutil.which("git") is None or not (Path(__file__).parents[1] / ".git").exists():
        pytest.skip("needs the git checkout (the base side is a git ref)")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_ab", "--base", "HEAD", "--rounds", "2",
         "--threads", "2", "--footprint-mib", "0.25", "--cases",
         "fwd:fp32:64x100,bwd:bf16:33x70,fwd:fp16:9x1000,afwd:bf16:17x300"],
        cwd=Path(__file__).parents[1], check=True, capture_output=True, text=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("base: HEAD, head: working tree; 2 threads, 2 rounds")
    assert lines[0].endswith("build, inputs fill 0.25 MiB")
    pattern = (r"(fwd|afwd|bwd) (fp32|bf16|fp16) (\d+)x(\d+): base ([\d.]+) ms \(fastest [\d.]+\), "
               r"head ([\d.]+) ms \(fastest [\d.]+\); head speed-up ([\d.]+)x")
    cases = [re.match(pattern, line) for line in lines[1:]]
    assert [c.group(1, 2, 3, 4) for c in cases] == [
        ("fwd", "fp32", "64", "100"), ("bwd", "bf16", "33", "70"), ("fwd", "fp16", "9", "1000"),
        ("afwd", "bf16", "17", "300")]
    for c in cases:
        assert float(c.group(5)) > 0 and float(c.group(6)) > 0 and float(c.group(7)) > 0


def test_kernel_ab_rejects_a_bad_case():
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ab", "--same", "--cases",
                          "fwd:int8:4x4"], cwd=Path(__file__).parents[1], capture_output=True,
                         text=True)
    assert run.returncode == 2 and "a case is fwd|afwd|bwd:bf16|fp16|fp32:MxN" in run.stderr


def test_kernel_ab_rejects_a_footprint_of_nothing():
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ab", "--same",
                          "--footprint-mib", "0"], cwd=Path(__file__).parents[1],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--footprint-mib must be positive" in run.stderr


def test_accuracy_far_rows_writes_its_results(tmp_path):
    """The accuracy script's file: every (op, shape, offset) for both providers, stamped, and
    figures that say what the README quotes from it (fusednorm's gradients at 1e4 from zero
    within 1e-6 of float64 on the CPU, PyTorch's 100x further)."""
    from benchmarks import accuracy_far_rows

    accuracy_far_rows.main(["--device", "cpu", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*/accuracy_far_rows.json")  # the folder: report.folder_name's
    folder = path.parent
    result = json.loads(path.read_text())
    assert (folder / "accuracy_far_rows.md").exists()
    assert result["suite"] == "accuracy_far_rows" and result["commit"]
    offsets = len(accuracy_far_rows.OFFSETS)
    cases = len(accuracy_far_rows.LN_SHAPES) * offsets + offsets  # LayerNorm's, then the block's
    assert len(result["rows"]) == 2 * cases
    for row in result["rows"]:
        if row["offset"] == 1e4 and row["op"] == "layer_norm":
            grads = ("dx", "dweight")
            if row["provider"] == "fusednorm":
                assert all(row[g] < 1e-6 for g in grads), row
            else:
                assert all(row[g] > 1e-5 for g in grads), row


def test_host_ms_is_the_launching_time_per_call():
    """harness.host_ms times calls launched back to back: a call that spends 2 ms on the host
    reads about 2 ms (the GPU rows' host_ms; shaky rows in docs_page)."""
    from benchmarks import harness

    ms = harness.host_ms(lambda: time.sleep(0.002), torch.device("cpu"), calls=5)
    assert 1.9 <= ms <= 20.0


def test_dropout_mask_counts_an_element_kept_where_the_sum_gradient_is_zero():
    """torch eager's bfloat16 dx = ds * mask / (1 - p) is zero where the rounded ds is
    (about 1 in 2000 elements): read with the residual's gradient (ds itself), such an
    element counts as kept (on the H200, at 67M elements, dx alone put eager's share 11
    standard deviations low)."""
    import torch.nn.functional as F

    from benchmarks.norm_variants import kept_mask

    torch.manual_seed(0)
    n = 2048
    x = (torch.randn(n, n) * 2 + 0.5).bfloat16().requires_grad_()
    r = (torch.randn(n, n) * 2).bfloat16().requires_grad_()
    h = F.dropout(x, 0.1)
    s = h + r
    y = F.layer_norm(s, (n,))
    dx, dr = torch.autograd.grad([y, s], [x, r], [torch.randn(n, n).bfloat16(),
                                                   torch.randn(n, n).bfloat16()])
    truth = h != 0
    assert (~kept_mask(dx, 0.1) & truth).sum() > 0  # dx alone misreads kept elements here
    kept = kept_mask(dx, 0.1, dr)
    assert not (~kept & truth).any()
    assert torch.equal(kept[dr != 0], truth[dr != 0])
