"""examples/train_gpt.py and examples/compare_runs.py run as documented: the metrics.json
contract, the loss-curve PNGs, and the same loss curve for --norm torch and --norm fused."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt_example import EXAMPLES_DIR

pytest.importorskip("matplotlib", reason="the example plots with matplotlib (test extra)")
pytest.importorskip("tqdm", reason="the example shows progress with tqdm (test extra)")

pytestmark = pytest.mark.slow  # each run is a fresh Python process that imports torch

REPO_ROOT = EXAMPLES_DIR.parent
STEPS = 50
# A tiny model on one thread: 50 steps in seconds, with the documented default seed/lr path.
TINY_ARGS = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--block-size", "32",
             "--batch-size", "8", "--corpus-bytes", "200000", "--lr", "1e-2", "--threads", "1",
             "--no-progress"]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(EXAMPLES_DIR / script), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    return result


def train(out: Path, norm: str, *extra: str) -> dict:
    _run("train_gpt.py", "--norm", norm, "--device", "cpu", "--seed", "0", "--out", str(out),
         *TINY_ARGS, *extra)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One fp32 CPU run per norm, same seed: {norm: (run directory, metrics)}."""
    root = tmp_path_factory.mktemp("train_gpt")
    return {norm: (root / norm, train(root / norm, norm, "--steps", str(STEPS)))
            for norm in ("torch", "fused")}


def _assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


def assert_metrics_contract(metrics: dict, norm: str, steps: int) -> None:
    assert metrics["norm"] == norm
    losses = metrics["losses"]
    assert isinstance(losses, list) and len(losses) == steps
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses)
    for key in ("tokens_per_s", "median_step_tokens_per_s", "peak_mem_mb"):
        assert isinstance(metrics[key], float) and metrics[key] > 0, key
    step_ms = metrics["step_ms"]
    assert len(step_ms) == metrics["timed_steps"] and all(t > 0 for t in step_ms)
    tokens = metrics["config"]["batch_size"] * metrics["config"]["block_size"]
    assert metrics["median_step_tokens_per_s"] == pytest.approx(
        1e3 * tokens / statistics.median(step_ms))
    assert metrics["config"]["steps"] == steps and metrics["config"]["seed"] == 0
    assert metrics["device_kind"] == "cpu" and metrics["device"]
    assert metrics["torch"] == torch.__version__


@pytest.mark.parametrize("norm", ["torch", "fused"])
def test_metrics_and_plot(runs, norm):
    out, metrics = runs[norm]
    assert_metrics_contract(metrics, norm, STEPS)
    _assert_png(out / "loss_curve.png")
    expected_class = "fusednorm." if norm == "fused" else "torch.nn."
    assert metrics["norm_class"].startswith(expected_class), metrics["norm_class"]


def test_same_loss_curve_and_it_falls(runs):
    torch_losses, fused_losses = runs["torch"][1]["losses"], runs["fused"][1]["losses"]
    assert torch_losses[0] == pytest.approx(math.log(256), abs=0.1)  # uniform over bytes
    diff = max(abs(a - b) for a, b in zip(torch_losses, fused_losses))
    assert diff <= 1e-3, f"max |loss difference| {diff:.2e} over {STEPS} steps"
    for losses in (torch_losses, fused_losses):
        assert sum(losses[-10:]) / 10 < losses[0] - 1.0, losses


def test_compare_runs(runs, tmp_path):
    png = tmp_path / "loss_curves.png"
    table = _run("compare_runs.py", str(runs["torch"][0]), str(runs["fused"][0] / "metrics.json"),
                 "--out", str(png)).stdout
    _assert_png(png)
    summary = json.loads((tmp_path / "comparison.json").read_text())
    assert [run["norm"] for run in summary["runs"]] == ["torch", "fused"]
    diff = max(abs(a - b) for a, b in zip(runs["torch"][1]["losses"], runs["fused"][1]["losses"]))
    assert summary["runs"][1]["max_abs_loss_diff_vs_first"] == pytest.approx(diff)
    assert (tmp_path / "comparison.md").read_text() == table


def test_amp_bf16_run(tmp_path):
    metrics = train(tmp_path, "fused", "--steps", "3", "--amp", "bf16")
    assert_metrics_contract(metrics, "fused", 3)
    assert metrics["config"]["amp"] == "bf16"


def test_compare_speed_alternates_runs(tmp_path):
    """examples/compare_speed.py: a round is a run of each norm, torch first in the first
    round and fused in the second; the summary's medians and ratio come from the runs' own
    tokens/s."""
    _run("compare_speed.py", str(tmp_path), "--rounds", "2", "--steps", "3", "--device", "cpu",
         *TINY_ARGS)
    summary = json.loads((tmp_path / "speed.json").read_text())
    assert summary["order"] == ["torch", "fused", "fused", "torch"]
    assert summary["first_by_round"] == ["torch", "fused"]
    for norm in ("torch", "fused"):
        values = summary["tokens_per_s"][norm]
        assert len(values) == 2 and all(v > 0 for v in values)
        assert summary["median_tokens_per_s"][norm] == pytest.approx(sum(values) / 2)
    medians = summary["median_tokens_per_s"]
    assert summary["fused_over_torch"] == pytest.approx(medians["fused"] / medians["torch"])
    steps = summary["median_step_tokens_per_s"]
    ratios = [f / t for t, f in zip(steps["torch"], steps["fused"])]
    assert summary["round_ratios"] == pytest.approx(ratios)
    assert summary["fused_over_torch_by_round"] == pytest.approx(sum(ratios) / 2)
    assert summary["rounds_fused_ahead"] == sum(r > 1 for r in ratios)
    assert (tmp_path / "speed.md").read_text().startswith("# Example GPT training speed on ")


def test_compare_speed_alternates_which_norm_runs_first(tmp_path, monkeypatch):
    """examples/compare_speed.py without --interleave: torch runs first in even rounds and
    fused in odd ones, and speed.json records it. On a machine that slows down within every
    round (the second run of each 10% slower) the round ratios then err both ways and their
    median stays near 1, where a fixed order would put the same 10% against one side. (No
    model trained: run_once stands in for train_gpt.py's processes.)"""
    sys.path.insert(0, str(EXAMPLES_DIR))
    import compare_speed

    calls = []

    def run_once(norm, steps, extra, scratch):
        rate = 100.0 if len(calls) % 2 == 0 else 90.0  # the round's second run: slower
        calls.append(norm)
        metrics = _fake_metrics(norm, batch_size=8, block_size=32)
        metrics.update(threads=1, tokens_per_s=rate, median_step_tokens_per_s=rate)
        return metrics

    monkeypatch.setattr(compare_speed, "run_once", run_once)
    summary = compare_speed.main([str(tmp_path), "--rounds", "4", "--steps", "3"])
    assert calls == ["torch", "fused", "fused", "torch", "torch", "fused", "fused", "torch"]
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved == summary
    assert saved["order"] == calls
    assert saved["first_by_round"] == ["torch", "fused", "torch", "fused"]
    assert saved["round_ratios"] == pytest.approx([0.9, 1 / 0.9, 0.9, 1 / 0.9])
    assert saved["fused_over_torch_by_round"] == pytest.approx((0.9 + 1 / 0.9) / 2)
    assert saved["rounds_fused_ahead"] == 2
    md = (tmp_path / "speed.md").read_text()
    assert "first in each round: torch, fused, torch, fused." in md
    assert [compare_speed.round_order(i) for i in range(3)] == [
        ("torch", "fused"), ("fused", "torch"), ("torch", "fused")]


def test_compare_speed_interleaves_steps(tmp_path):
    """examples/compare_speed.py --interleave: per round one model of each norm in one
    process, steps alternating; the stated speed-ups come from the recorded step times, and
    the two models of a round train alike (same seed and batches)."""
    _run("compare_speed.py", str(tmp_path), "--interleave", "--rounds", "2", "--steps", "4",
         "--device", "cpu", *TINY_ARGS)
    summary = json.loads((tmp_path / "interleaved.json").read_text())
    assert summary["rounds"] == 2
    torch_ms, fused_ms = summary["step_ms"]["torch"], summary["step_ms"]["fused"]
    # 4 steps: the first untimed, 3 timed per model and round.
    assert [len(r) for r in torch_ms] == [len(r) for r in fused_ms] == [3, 3]
    ratios = [t / f for tr, fr in zip(torch_ms, fused_ms) for t, f in zip(tr, fr)]
    assert summary["pair_ratios"] == pytest.approx(ratios)
    assert summary["fused_speedup_by_pair"] == pytest.approx(statistics.median(ratios))
    assert summary["pairs_fused_ahead"] == sum(r > 1 for r in ratios)
    totals = [sum(map(sum, ms)) for ms in (torch_ms, fused_ms)]
    assert summary["fused_speedup_by_total"] == pytest.approx(totals[0] / totals[1])
    for torch_loss, fused_loss in zip(summary["final_loss"]["torch"], summary["final_loss"]["fused"]):
        assert fused_loss == pytest.approx(torch_loss, rel=1e-4)
    assert summary["final_loss"]["torch"][0] == summary["final_loss"]["torch"][1]
    md = (tmp_path / "interleaved.md").read_text()
    assert md.startswith("# Example GPT training speed on ") and "steps interleaved" in md


def test_profile_step(tmp_path):
    """examples/profile_step.py: both norms profiled; the CPU busy time is the operators' summed
    self time; the fused model's rows show fusednorm's ops and the torch model's do not."""
    _run("profile_step.py", str(tmp_path), "--warmup", "2", "--steps", "2", "--device", "cpu",
         *TINY_ARGS)
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["commit"] and profile["date"] and profile["torch"] == torch.__version__
    assert all(r["device"] == profile["device"] for r in profile["results"])
    results = {r["norm"]: r for r in profile["results"]}
    assert set(results) == {"torch", "fused"}
    for norm, r in results.items():
        assert r["steps"] == 2 and r["wall_ms_per_step"] > 0 and r["launches_per_step"] == 0
        assert r["busy_ms_per_step"] == pytest.approx(
            sum(row["self_us_per_step"] for row in r["rows"]) / 1e3)
        names = {row["name"] for row in r["rows"]}
        assert any(n.startswith("fusednorm::") for n in names) == (norm == "fused")
    assert (tmp_path / "profile.md").read_text().startswith("# Example GPT step profile")


def test_commit_stamp_names_the_sources_when_told(monkeypatch):
    """FUSEDNORM_COMMIT names the sources (a copy whose .git is not theirs), as in the
    benchmarks' stamp."""
    sys.path.insert(0, str(EXAMPLES_DIR))
    from train_gpt import git_commit

    monkeypatch.setenv("FUSEDNORM_COMMIT", "0123abc")
    assert git_commit() == "0123abc"
    monkeypatch.delenv("FUSEDNORM_COMMIT")
    assert git_commit() != "0123abc"


TORCHRUN_STEPS = 6  # the learning-rate schedule depends on --steps: both runs take these


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("short"), "fused", "--steps", str(TORCHRUN_STEPS))


@pytest.mark.parametrize("parallel", [["--tp", "2"], ["--fsdp"]], ids=["tp2", "fsdp2"])
def test_torchrun_two_processes_give_the_losses_of_one(short_run, tmp_path, parallel):
    """Under torchrun (2 gloo processes), tensor + sequence parallelism or FSDP2: the loss
    of every step within float32 rounding of the single-process run's."""
    steps = TORCHRUN_STEPS
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(EXAMPLES_DIR / "train_gpt.py"), "--norm", "fused", "--device", "cpu", "--seed", "0",
         "--out", str(out), *TINY_ARGS, "--steps", str(steps), *parallel],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr}"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["parallel"]["processes"] == 2
    assert metrics["losses"] == pytest.approx(short_run["losses"], abs=1e-5)


def _train_gpt_module():
    sys.path.insert(0, str(EXAMPLES_DIR))
    import train_gpt

    return train_gpt


def test_cpu_device_name_is_the_processor_model(monkeypatch, tmp_path):
    """The results name the CPU's model (as the benchmarks' stamp does), not just
    platform.machine()'s 'x86_64'."""
    train_gpt = _train_gpt_module()
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                       "model name\t: AMD EPYC 9999 64-Core Processor\nflags\t: fpu\n")
    monkeypatch.setattr(train_gpt, "_CPUINFO", cpuinfo, raising=False)
    assert train_gpt.device_name(torch.device("cpu")) == "AMD EPYC 9999 64-Core Processor"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def test_commit_stamp_says_dirty_when_the_sources_differ(monkeypatch, tmp_path):
    """A run from edited sources is not stamped with the clean commit; run folders and the
    examples' results (which the scripts write) do not count as edits."""
    monkeypatch.delenv("FUSEDNORM_COMMIT", raising=False)
    train_gpt = _train_gpt_module()
    repo = tmp_path / "clone"
    (repo / "fusednorm").mkdir(parents=True)
    (repo / "examples" / "results").mkdir(parents=True)
    (repo / "fusednorm" / "modules.py").write_text("x = 1\n")
    (repo / "examples" / "results" / "speed.md").write_text("old\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                         text=True, check=True).stdout.strip()
    (repo / "runs" / "fused").mkdir(parents=True)
    (repo / "runs" / "fused" / "metrics.json").write_text("{}\n")
    (repo / "examples" / "results" / "speed.md").write_text("new\n")
    assert train_gpt.git_commit(repo) == sha
    (repo / "fusednorm" / "modules.py").write_text("x = 2\n")
    assert train_gpt.git_commit(repo) == sha + "-dirty"


def _fake_metrics(norm: str, **config) -> dict:
    return {"norm": norm, "losses": [5.5, 4.0, 3.0], "tokens_per_s": 100.0,
            "peak_mem_mb": 10.0, "device": "cpu model", "device_kind": "cpu",
            "torch": torch.__version__, "commit": "abc", "date": "2026-01-01T00:00:00+00:00",
            "config": {"n_layer": 2, "d_model": 32, "seed": 0, "amp": "fp32", "steps": 3,
                       **config}}


def test_compare_runs_stamps_and_flags_runs_that_differ_beyond_the_norm(tmp_path, capsys):
    """comparison.json/.md carry the runs' commit and date, and a comparison of runs whose
    configuration differs (seed, dtype, size) says so: its loss difference is no
    kernel rounding."""
    sys.path.insert(0, str(EXAMPLES_DIR))
    import compare_runs

    for name, metrics in {"torch": _fake_metrics("torch"),
                          "fused": _fake_metrics("fused", seed=1)}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
    summary = compare_runs.main([str(tmp_path / "torch"), str(tmp_path / "fused"),
                                 "--out", str(tmp_path / "loss_curves.png")])
    assert summary["commit"] == "abc" and summary["date"].startswith("2026-01-01")
    assert summary["config_differences"] == {"seed": [0, 1]}
    md = (tmp_path / "comparison.md").read_text()
    assert "seed" in md and "abc" in md
    assert "seed" in capsys.readouterr().err


def test_run_comparison_writes_a_relative_out_dir_where_it_was_called(tmp_path):
    """bash examples/run_comparison.sh OUT_DIR from any folder: OUT_DIR is relative to
    that folder (not to the checkout, where the script changes to)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHON"] = sys.executable
    result = subprocess.run(
        ["bash", str(EXAMPLES_DIR / "run_comparison.sh"), "runs", "--steps", "2",
         "--device", "cpu", *TINY_ARGS], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "comparison.md").is_file()
    assert (tmp_path / "runs" / "torch" / "metrics.json").is_file()
    assert not (REPO_ROOT / "runs" / "comparison.md").exists() or (REPO_ROOT / "runs").samefile(
        tmp_path / "runs")


def test_a_corpus_too_small_for_the_context_stops_before_training(tmp_path):
    """--corpus-bytes too small for --block-size: a usage error up front, not a ValueError
    from the evaluation after every step has run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "train_gpt.py"), "--norm", "torch", "--steps", "2",
         "--out", str(tmp_path / "run"), "--corpus-bytes", "1000", "--block-size", "128",
         "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--batch-size", "2",
         "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "--corpus-bytes" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_fused_metrics_name_the_fusednorm_build(tmp_path):
    """A fused run's metrics.json says which fusednorm ran: its version and build (SIMD level,
    CUDA archs, a load error that left only the reference path)."""
    import fusednorm

    metrics = train(tmp_path, "fused", "--steps", "2")
    build = metrics["fusednorm_build"]
    assert build["fusednorm"] == fusednorm.build_info()["fusednorm"]
    assert build["cpu_capability"] == fusednorm.build_info()["cpu_capability"]
