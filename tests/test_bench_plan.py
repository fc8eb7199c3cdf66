"""`python -m benchmarks --plan`: the plan counts what a run times, the default GPU run keeps
what issue 41 judges within its time (by the estimate: no GPU here), and the estimate
reproduces the GPU runs its costs come from. (Plans time nothing; one tiny CPU run checks
the counts against the rows.)"""
from __future__ import annotations

import pytest
import torch

from benchmarks import (bench_layer_norm, bench_norm_family, bench_overhead, cli, floors, harness,
                        plan, run_all, runner)

NORM_SUITES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
ISSUE_41_NS = {1024, 2048, 4096, 8192, 16384, 32768, 65536}
HALF = {torch.bfloat16, torch.float16}


def _plans(*argv: str) -> dict[str, plan.SuitePlan]:
    args = run_all.parser().parse_args(["--plan", *argv])
    return {p.suite: p for p in run_all.plans(args)}


def _suite_plan(suite: str, *argv: str, providers=None, variants=None) -> plan.SuitePlan:
    module = run_all.SUITES[suite]
    args = module.parser().parse_args(["--device", "cuda", *argv])
    if providers is not None:
        args.providers = providers
    if variants is not None:
        args.variants = variants
    return module.plan(args)


def test_default_gpu_run_keeps_what_issue_41_judges_within_its_time():
    """The default GPU run (bash scripts/bench.sh's) by the estimate: 7.5 minutes at most
    (10 with the ~2 min build, and a margin), --quick 1.5; and it still times each norm op's
    three passes in bf16, fp16 and fp32 at N = 1024-65536 beside eager, torch.compile (and
    Liger where it has the op), the GELU FFN in 16-bit at 8192 tokens and d 768-8192 beside
    eager, torch.compile and the GEMMs alone, and the overhead suite."""
    plans = _plans()
    assert list(plans) == list(run_all.SUITES)
    assert plan.total_s(list(plans.values())) <= 7.5 * 60
    assert plan.total_s(list(_plans("--quick").values())) <= 1.5 * 60
    for name in NORM_SUITES:
        suite = plans[name]
        assert suite.passes == list(runner.PASSES)
        plain = [c for c in suite.cases if c.fields.get("variant", "plain") == "plain"]
        assert {(c.dtype, c.fields["N"]) for c in plain} == {
            (d, n) for d in (*HALF, torch.float32) for n in ISSUE_41_NS}
        wanted = {"fusednorm", "torch", "torch.compile"} | (
            {"liger"} if name != "add_layer_norm" else set())
        assert all(wanted <= set(c.providers) for c in plain)
        assert all(c.fields["M"] * c.fields["N"] == 1 << 26 for c in plain)
    ffn = plans["gelu_ffn"]
    assert {(c.dtype, c.fields["M"], c.fields["N"]) for c in ffn.cases} >= {
        (d, 8192, n) for d in HALF for n in (768, 1024, 2048, 4096, 8192)}
    assert all({"fusednorm", "torch", "torch.compile", "gemm-only"} <= set(c.providers)
               for c in ffn.cases)
    assert set(plans["overhead"].host_calls) == set(bench_overhead.CASES)
    assert all(n > 0 for n in plans["overhead"].host_calls.values())


def test_full_times_the_whole_grid():
    """--full: the grid the default GPU run leaves out (layer_norm's N = 768 and 12288,
    gelu_ffn in float32, the fresh-copy floor, the variants at a second N); the CPU's
    defaults stay as they were, the floor among them."""
    full, default = _plans("--full"), _plans()
    ns = {c.fields["N"] for c in full["layer_norm"].cases}
    assert ns == set(bench_layer_norm.GPU_FULL_NS) and ns > {c.fields["N"] for c in
                                                             default["layer_norm"].cases}
    assert torch.float32 in {c.dtype for c in full["gelu_ffn"].cases}
    assert torch.float32 not in {c.dtype for c in default["gelu_ffn"].cases}
    for name in NORM_SUITES:
        assert all(floors.FRESH_COPY in c.providers for c in full[name].cases)
        assert not any(floors.FRESH_COPY in c.providers for c in default[name].cases)
    variant_ns = {c.fields["N"] for c in full["add_rms_norm"].cases
                  if c.fields["variant"] != "plain"}
    assert variant_ns == set(bench_norm_family.VARIANT_GPU_FULL_NS)
    cpu = _plans("--device", "cpu")
    assert all(floors.FRESH_COPY in c.providers for c in cpu["layer_norm"].cases)
    assert cpu == _plans("--device", "cpu", "--full")
    assert cpu["layer_norm"].estimate_s() is None  # no CPU cost table
    named = cli.suite_parser("x", ["a", "fresh-copy"]).parse_args(["--providers", "fresh-copy"])
    assert cli.wanted_providers(named, ["a", "fresh-copy"], torch.device("cuda")) == [
        "fresh-copy"]
    assert floors.columns(["torch"]) != floors.columns(["torch", floors.FRESH_COPY])


def test_plan_counts_what_the_run_times(tmp_path, monkeypatch):
    """A tiny CPU run: as many rows as the plan has timings, its cases the plan's, and the
    plan's compilations two per case of a compiled provider (the bwd pass recompiles)."""
    monkeypatch.setitem(harness.COPY_BYTES, "cpu", 1 << 20)  # a small probe: this is no timing
    # --cpu-memory: the mode this process is in (it cannot go back from reuse to fresh).
    argv = ["--device", "cpu", "--shapes", "7x5", "--dtypes", "fp32,bf16", "--passes",
            "fwd,bwd", "--time-per-measurement", "0.01", "--cpu-memory", harness.cpu_memory(),
            "--out", str(tmp_path)]
    suite = bench_norm_family.ADD_LAYER_NORM
    args = suite.parser().parse_args(argv + ["--providers", "fusednorm,torch",
                                             "--variants", "plain,dropout"])
    planned = suite.plan(args)
    result, _, _ = suite.run(args)
    assert planned.timings == len(result["rows"]) == 4 * 2 * 2  # cases x providers x passes
    assert {(c.dtype, *c.fields.values()) for c in planned.cases} == {
        (getattr(torch, r["dtype"]), r["M"], r["N"], r["variant"]) for r in result["rows"]}
    assert planned.probes == len(planned.cases) * 2 + 1 and planned.compiles == 0
    compiled = suite.plan(suite.parser().parse_args(argv + ["--providers", "torch.compile"]))
    assert compiled.compiles == 2 * len(compiled.cases)
    fwd_only = suite.plan(suite.parser().parse_args(argv[:6] + ["--passes", "fwd",
                                                                 "--providers", "torch.compile"]))
    assert fwd_only.compiles == len(fwd_only.cases)


def test_plan_runs_nothing_and_needs_no_gpu(capsys, monkeypatch):
    """--plan prints the table and returns: no device, no case built, no file written."""
    def refuse(*args, **kwargs):
        raise AssertionError("a plan must not run anything")

    monkeypatch.setattr(runner, "run", refuse)
    monkeypatch.setattr(cli, "resolve_device", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_all.main(["--plan", "--device", "cuda", "--suites", "layer_norm,overhead"])
    out = capsys.readouterr().out
    assert "| `layer_norm` | 21 |" in out and "| `overhead` |" in out and " min)** |" in out
    run_all.main(["--plan", "--device", "cpu", "--suites", "gelu_ffn"])
    assert "n/a" in capsys.readouterr().out


# The runs COSTS were fitted to (docs/gpu_runs/, H200): the suites as they were then (0.2 s
# per measurement, fresh-copy timed, no variants), and each suite's seconds.
FOUR = ["fusednorm", "torch", "torch.compile", "fresh-copy"]
PAST_RUNS = [
    ("layer_norm", ["--full", "--time-per-measurement", "0.2"], FOUR + ["liger"], None, 167),
    ("layer_norm", ["--full", "--time-per-measurement", "0.2"], FOUR, None, 133),
    ("rms_norm", ["--time-per-measurement", "0.2"], FOUR, None, 91),
    ("add_rms_norm", ["--time-per-measurement", "0.2"], FOUR, ["plain"], 89),
    ("add_layer_norm", ["--time-per-measurement", "0.2"], FOUR, ["plain"], 105),
    ("gelu_ffn", ["--full", "--time-per-measurement", "0.2"], None, None, 245),
    ("rms_norm", ["--quick", "--time-per-measurement", "0.1"], FOUR, None, 9),
    ("add_layer_norm", ["--quick", "--time-per-measurement", "0.1"], FOUR, ["plain"], 10),
]


@pytest.mark.parametrize("suite, argv, providers, variants, seconds", PAST_RUNS)
def test_estimate_reproduces_the_runs_it_comes_from(suite, argv, providers, variants, seconds):
    estimate = _suite_plan(suite, *argv, providers=providers, variants=variants).estimate_s()
    assert estimate == pytest.approx(seconds, rel=0.3 if "--quick" in argv else 0.15)


def test_the_cpu_run_keeps_its_budget_and_rounds():
    """Sizing the GPU run left the CPU's alone: 0.35 s per measurement (quick 0.1) and the
    overhead suite's 15 rounds of 1000 calls."""
    cpu = torch.device("cpu")
    for argv, budget in (([], 0.35), (["--quick"], 0.1)):
        assert cli.budget_s(run_all.parser().parse_args(argv), cpu) == budget
    assert bench_overhead.rounds_calls(cpu, False) == (15, 1000)
