"""benchmarks.cuda_ab without a GPU: every prepared variant's edits still apply to csrc/, the
sweep's cases, turns, ratios and table, and (with nvcc) two variants of one unit compile into
libraries of their own that load side by side, register their entries, use nothing of
torch's, and pack and unpack without compiling again."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.cuda_ab import build, sweep
from benchmarks.cuda_ab.variants import CONFIG, QUESTIONS, Edit, Unit, apply_edits

REPO = Path(__file__).resolve().parent.parent


def csrc_files():
    root = REPO / "csrc"
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*.cuh")} | {
        str(p.relative_to(root)): p.read_text() for p in root.rglob("*.h")}


def test_prepared_questions_apply_and_change_the_source():
    files = csrc_files()
    assert len(QUESTIONS) >= 3
    for q in QUESTIONS.values():
        assert q.variants and q.units and q.why
        for name, edits in q.variants.items():
            edited = apply_edits(files, edits)
            assert edited != files, f"{q.name}.{name} changes nothing"


def test_an_edit_whose_text_moved_is_refused():
    files = {CONFIG: "a b a"}
    with pytest.raises(ValueError, match="occurs 2 times"):
        apply_edits(files, (Edit(CONFIG, "a", "c"),))
    with pytest.raises(ValueError, match="occurs 0 times"):
        apply_edits(files, (Edit(CONFIG, "z", "c"),))


def test_instance_files_name_one_tag():
    tags = build.input_tags()
    assert {"f32", "f64", "f16", "bf16"} <= set(tags)
    text = build.instance_text(Unit("rms_norm", "bwd", "bf16"), tags)
    assert "#define FUSEDNORM_NORM_CENTERED false" in text
    assert "#define FUSEDNORM_NORM_ONLY_bf16(...) __VA_ARGS__" in text
    assert "#define FUSEDNORM_NORM_ONLY_f32(...)\n" in text
    with pytest.raises(ValueError):
        build.instance_text(Unit("rms_norm", "bwd", "int8"), tags)


def test_a_grad_sum_unit_shares_its_instance_file(tmp_path):
    """The backward timed with a grad_sum, and the forward with a residual, run the plain
    unit's kernels (runtime pointers): one instance file for both, else their entries would
    register twice."""
    units = (Unit("layer_norm", "bwd", "bf16"), Unit("layer_norm", "bwd", "bf16", grad_sum=True),
             Unit("layer_norm", "fwd", "bf16", residual=True), Unit("layer_norm", "fwd", "bf16"))
    _, sources = build.write_tree("v", (), units, tmp_path)
    assert [s.name for s in sources] == ["layer_norm_bwd_bf16.cu", "layer_norm_fwd_bf16.cu"]
    assert [u.label for u in units] == ["bwd", "bwd+grad_sum", "fwd+residual", "fwd"]
    with pytest.raises(ValueError, match="residual the forward's"):
        Unit("layer_norm", "bwd", "bf16", residual=True)
    with pytest.raises(ValueError, match="grad_sum is the backward's"):
        Unit("layer_norm", "fwd", "bf16", grad_sum=True)


def test_plan_cases_turns_rows_and_table():
    questions = list(QUESTIONS.values())
    plan = sweep.build_plan(questions)
    assert sweep.BASE in plan and len(plan) == 1 + sum(len(q.variants) for q in questions)
    base_units = set(plan[sweep.BASE][1])
    for q in questions:  # the base runs every unit, and the forward of every backward unit
        assert set(q.units) <= base_units
        assert {Unit(u.kind, "fwd", u.tag) for u in q.units} <= base_units
    cases = sweep.cases(questions, ns=(1024, 65536), elements=1 << 20, tags={"bf16"})
    assert cases and all(c.unit.tag == "bf16" and c.M * c.N == 1 << 20 for c in cases)
    case = cases[0]

    # Turns: every provider once a round (and a discarded sample of the round's first).
    order = []
    fake_ms = {sweep.BASE: 2.0, "q__v": 1.0, sweep.COPY: 1.6}
    providers = {n: (lambda n=n: order.append(n)) for n in fake_ms}

    def timer(fn):
        fn()
        return fake_ms[order[-1]]

    samples = sweep.time_in_turns(providers, 3, timer)
    assert len(order) == 3 * 4 and all(len(s) == 3 for s in samples.values())
    assert all(order[r * 4] == order[r * 4 + 1] and sorted(order[r * 4 + 1:r * 4 + 4])
               == sorted(fake_ms) for r in range(3))
    rows = sweep.rows_for(case, samples, {"q__v": False})
    by = {r["provider"]: r for r in rows}
    assert by["q__v"]["x_base"] == pytest.approx(2.0)
    assert by[sweep.BASE]["pct_of_copy"] == pytest.approx(80.0)
    assert by["q__v"]["ok"] is False and by[sweep.BASE]["ok"] is True
    assert by[sweep.COPY]["gbps"] == pytest.approx(sweep.pass_bytes(case) / 1.6 / 1e6)
    table = sweep.markdown(rows)
    assert "160.0% (2.000x) !" in table and f"### {case.question}" in table

    # The real timer's arithmetic on the CPU clock: a median of positive times.
    median, p20, p80 = sweep.quantiles([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (median, p20 <= median <= p80) == (3.0, True)


def _timed_order(names: list[str], rounds: int, seed=0):
    """time_in_turns over providers that log their calls: every timer call's provider in
    order, and which calls were kept (the timer returns the call's index)."""
    calls = []
    providers = {n: (lambda n=n: calls.append(n)) for n in names}

    def timer(fn):
        fn()
        return float(len(calls) - 1)

    samples = sweep.time_in_turns(providers, rounds, timer, seed=seed)
    kept = {int(ms): name for name, s in samples.items() for ms in s}
    return calls, kept


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_turns_give_no_provider_a_fixed_predecessor(n):
    """The orders of the default rounds: every provider is first in some round, and the kept
    samples of each follow each other provider (the sample before it, discarded ones
    included) about equally often, never always the same one (a rotation put base after the
    copy in every round)."""
    names = [sweep.BASE] + [f"q__v{i}" for i in range(n - 2)] + [sweep.COPY]
    rounds = sweep.DEFAULT_ROUNDS
    calls, kept = _timed_order(names, rounds)
    assert len(calls) == rounds * (n + 1) and len(kept) == rounds * n
    timed = [kept[i] for i in sorted(kept)]
    rounds_orders = [timed[r * n:(r + 1) * n] for r in range(rounds)]
    assert all(sorted(o) == sorted(names) for o in rounds_orders)
    assert {o[0] for o in rounds_orders} == set(names)
    for name in names:
        before = [calls[i - 1] for i, who in kept.items() if who == name and i > 0]
        others = [before.count(p) for p in names if p != name]
        assert len(set(before)) > 1 and min(others) >= 1, (name, before)
        # Balanced: a block of n (2n, n odd) rounds gives each predecessor the same count.
        assert max(others) - min(others) <= 2, (name, before)
    # Seeded: the same seed, the same orders; another seed, others.
    assert _timed_order(names, rounds)[0] == calls
    assert _timed_order(names, rounds, seed=1)[0] != calls


def test_run_case_times_base_again_as_an_a_a_control():
    """run_case adds base_again (base's module as a second provider, no build): with a fair
    timer (every call the same time, within 1%), its x_base is 1 and it is ok as base is; the
    table names it in a column and says what it is."""
    import random

    jitter = random.Random(3)

    def timer(fn):
        fn()
        return 1.0 + jitter.uniform(-0.01, 0.01)

    case = sweep.Case("q", Unit("layer_norm", "fwd", "f32"), M=32, N=256)
    modules = {sweep.BASE: CpuNorm(), "q__off": CpuNorm(0.1)}
    rows = sweep.run_case(case, modules, rounds=sweep.DEFAULT_ROUNDS, device="cpu", timer=timer)
    by = {r["provider"]: r for r in rows}
    assert list(by) == [sweep.BASE, sweep.AA, "q__off", sweep.COPY]
    assert by[sweep.AA]["x_base"] == pytest.approx(1.0, abs=0.02)
    assert by[sweep.AA]["ok"] and not by["q__off"]["ok"]
    table = sweep.markdown(rows)
    assert "| base | base_again | off |" in table
    assert "base_again: base timed again as its own provider" in table


@pytest.mark.parametrize("n", [3, 4, 5, 6])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_a_slow_sample_after_the_copy_moves_no_median(n, seed):
    """Every provider takes 1 ms (+-0.5%), the copy 3 ms, and a sample right after the copy's
    costs 10% more (what an H200 showed): no provider's median x_base moves off 1 by more
    than 2% (with the rotation, base followed the copy in most rounds: x_base ~1.1 for all)."""
    import random

    names = [sweep.BASE, sweep.AA] + [f"q__v{i}" for i in range(n - 3)] + [sweep.COPY]
    jitter = random.Random(seed)
    last = [None]

    def timer(fn):
        name = fn()
        ms = (3.0 if name == sweep.COPY else 1.0) * (1 + jitter.uniform(-0.005, 0.005))
        if last[0] == sweep.COPY and name != sweep.COPY:
            ms *= 1.1
        last[0] = name
        return ms

    providers = {n: (lambda n=n: n) for n in names}
    samples = sweep.time_in_turns(providers, sweep.DEFAULT_ROUNDS, timer, seed=seed)
    case = sweep.Case("q", Unit("layer_norm", "fwd", "bf16"), M=64, N=1024)
    rows = sweep.rows_for(case, samples, {})
    for r in rows:
        if r["provider"] != sweep.COPY:
            assert r["x_base"] == pytest.approx(1.0, abs=0.02), (r["provider"], r["x_base"])


def _nvcc_unavailable() -> str | None:
    if not torch.version.cuda:
        return "torch was built without CUDA"
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not (Path(home) / "bin" / "nvcc").exists() and shutil.which("nvcc") is None:
        return "nvcc not found (CUDA_HOME)"
    return None


@pytest.mark.skipif(_nvcc_unavailable() is not None, reason=str(_nvcc_unavailable()))
def test_two_variants_compile_and_load_side_by_side(tmp_path):
    """One unit (LayerNorm forward, float32) as base and with two Welford lanes: both compile
    with nvcc and load in one process, each with its own entries, and the variant's machine
    code differs from base's (the edit reached the kernels)."""
    unit = (Unit("layer_norm", "fwd", "f32"),)
    lanes = (Edit(CONFIG, "kWelfordLanes = VEC < 4 ? VEC : 4;",
                  "kWelfordLanes = VEC < 2 ? VEC : 2;"),)
    plan = {sweep.BASE: ((), unit), "lanes_2": (lanes, unit)}
    build.build_all(plan, tmp_path, jobs=2)
    modules = [build.import_built(v, tmp_path) for v in plan]
    assert modules[0] is not modules[1]
    for m in modules:
        assert sorted(m.entries()) == ["fwd layer_norm Float Float"]
    edited = (tmp_path / "lanes_2" / "csrc" / CONFIG).read_text()
    assert "VEC < 2 ? VEC : 2" in edited
    assert "VEC < 4 ? VEC : 4" in (tmp_path / sweep.BASE / "csrc" / CONFIG).read_text()

    # A library calls nothing of torch's (so a pack runs beside another torch): its only
    # undefined symbols are the C and C++ runtimes' and the CUDA runtime's.
    for m in modules:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", m.__file__], check=True,
                                   capture_output=True, text=True).stdout.split()
        names = [w for w in undefined if w not in ("U", "w")]
        foreign = [n for n in names if not re.search(r"@(GLIBC|GLIBCXX|CXXABI|GCC)_|@libcudart|"
                                                     r"^_ITM_|^__gmon_start__$", n)]
        assert names and not foreign, foreign
    # A call reaches the kernels' launcher through the entry (dtypes found, structures
    # passed), and an error there comes back as a RuntimeError with CUDA's message (here,
    # without a GPU, from the launcher's first CUDA call); a dtype not compiled is named.
    if not torch.cuda.is_available():
        v = modules[1]
        v._sm_count[0] = 132
        x = torch.randn(4, 64)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "current_device", lambda: 0)
            mp.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
            with pytest.raises(RuntimeError, match=r"libfusednorm_cuda_ab_lanes_2\.so: .*\.cuh:\d+: "):
                v.fwd(True, x, None, None, None, 1e-5, torch.empty_like(x), None, torch.empty(4),
                      torch.empty(4))
            with pytest.raises(RuntimeError, match="not compiled for RMSNorm Double"):
                v.fwd(False, x.double(), None, None, None, 1e-5, x.double(), None, None,
                      torch.empty(4, dtype=torch.float64))
    # A pack unpacked into another folder is used as built: nothing compiles there.
    archive = tmp_path / "pack.tar.xz"
    build.pack(plan, tmp_path, archive)
    other = tmp_path / "elsewhere"
    build.unpack(archive, other)
    build.build_all(plan, other, jobs=2)
    assert not list(other.rglob("*.o"))
    assert build.import_built("lanes_2", other).entries() == ["fwd layer_norm Float Float"]
    # An edit of the tree (a digest that no longer matches) compiles that variant again.
    stale = {sweep.BASE: plan[sweep.BASE],
             "lanes_2": ((Edit(CONFIG, "kWelfordLanes = VEC < 4 ? VEC : 4;",
                               "kWelfordLanes = VEC < 1 ? VEC : 1;"),), unit)}
    build.build_all(stale, other, jobs=2)
    assert [p.parent.parent.name for p in other.rglob("*.o")] == ["lanes_2"] * 2

    from sass_inspect import find_tool, read_kernels
    from benchmarks.sass_figures import figures

    if find_tool("cuobjdump") is None:
        return
    counts = [{(r["vec"], r["tpr"], r["items"], r["cluster"]): r["instructions"]
               for r in figures(read_kernels(m.__file__, find_tool("cuobjdump")))}
              for m in modules]
    assert counts[0] and counts[0].keys() == counts[1].keys()
    assert counts[0] != counts[1], "the edit did not reach the compiled kernels"


class CpuNorm:
    """A stand-in for a variant's module on the CPU: fusednorm's CPU backend ops into the
    sweep's preallocated outputs (off by `shift`, or dropping grad_sum, to play a wrong
    variant)."""

    def __init__(self, shift=0.0, drop_grad_sum=False):
        self.shift = shift
        self.drop_grad_sum = drop_grad_sum  # (and the residual, in a forward)

    def fwd(self, centered, x, residual, w, b, eps, y, s, mean, rstd):
        if self.drop_grad_sum:
            residual = None
        out, total, m, r = torch.ops.fusednorm.norm_fwd(x, residual, w, b, eps, centered)
        y.copy_(out + self.shift)
        if s is not None and residual is not None:
            s.copy_(total)
        rstd.copy_(r)
        if mean is not None:
            mean.copy_(m)

    def bwd(self, centered, dy, grad_sum, x, mean, rstd, w, dx, dw, db):
        stats = mean if mean is not None else torch.empty(0, dtype=rstd.dtype)
        if self.drop_grad_sum:
            grad_sum = None
        gx, gw, gb, _ = torch.ops.fusednorm.norm_bwd(dy, grad_sum, x, stats, rstd, w, db, centered)
        dx.copy_(gx + self.shift)
        dw.copy_(gw)
        if db is not None:
            db.copy_(gb)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("pass_, extra", [("fwd", False), ("fwd", True), ("bwd", False),
                                          ("bwd", True)])
def test_run_case_on_cpu_stand_ins(kind, pass_, extra):
    """run_case end to end on the CPU: inputs, the reference check (a variant off by 0.1 is
    flagged, base passes; with grad_sum or a residual, one that drops it too), the copy and
    the rows."""
    import time

    def timer(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    unit = Unit(kind, pass_, "f32", grad_sum=extra and pass_ == "bwd",
                residual=extra and pass_ == "fwd")
    case = sweep.Case("q", unit, M=96, N=1000)
    modules = {sweep.BASE: CpuNorm(), "q__off": CpuNorm(0.1)}
    if extra:
        modules["q__nogs"] = CpuNorm(drop_grad_sum=True)
    rows = sweep.run_case(case, modules, rounds=2, device="cpu", timer=timer)
    by = {r["provider"]: r for r in rows}
    assert set(by) == set(modules) | {sweep.AA, sweep.COPY}
    assert by[sweep.BASE]["ok"] and by[sweep.AA]["ok"] and not by["q__off"]["ok"]
    assert extra == ("q__nogs" in by) and not by.get("q__nogs", {"ok": False})["ok"]
    assert by[sweep.BASE]["pass"] == {("fwd", True): "fwd+residual",
                                      ("bwd", True): "bwd+grad_sum"}.get((pass_, extra), pass_)
    tensors = {("fwd", False): 2, ("fwd", True): 4, ("bwd", False): 3, ("bwd", True): 4}
    assert sweep.pass_bytes(case) == tensors[(pass_, extra)] * 96 * 1000 * 4  # float32
    assert all(r["ms"] > 0 and r["pct_of_copy"] > 0 for r in rows)


def test_emulate_variant_cuts_chunks_at_the_variant_tables(monkeypatch):
    """tests/emulate_variant.py's cases follow the tables a variant's harness reports: with
    16-bit backward rows capped at 8192 (bwd16_long_rows), 8 chunks are rows to 65536, and
    one pack more takes the three-launch path."""
    from tests import emulate_variant

    emu = emulate_variant.emu
    rows = {t: {"fwd_vec": emu.largest_row("fwd", t, True), "fwd_scalar": 8192,
                "fwd_vec_dropout": emu.largest_row("fwd", t, True), "fwd_scalar_dropout": 8192,
                "bwd_vec": emu.largest_row("bwd", t, True),
                "bwd_vec_ln_grad_sum": emu.largest_row("bwd", t, True, ln_grad_sum=True),
                "bwd_scalar": 4096} for t in emu.SIZE}
    rows["bf16"].update(bwd_vec=8192, bwd_vec_ln_grad_sum=4096)
    monkeypatch.setattr(emu, "TABLE_ROWS", rows)
    _, launched = emulate_variant.pass_cases("bwd", "bf16", "bf16")
    lengths = {(int(line.split()[4]), clustered) for line, clustered in launched
               if " clusters" in line and " res" not in line and "xgrad" not in line}
    assert {(16384, 1), (65536 - 8, 1), (65536 + 8, 0)} <= lengths
    # LayerNorm with a grad_sum: its own table's rows (4096 halves: 8 chunks to 32768).
    res = {(int(line.split()[4]), clustered) for line, clustered in launched
           if line.endswith(" clusters res")}
    assert {(8192, 1), (32768 - 8, 1), (32768 + 8, 0)} <= res
