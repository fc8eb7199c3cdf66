"""The A/B sweep: for each question, each of its units (kind, pass, dtype) and each row length
N, the base tree, base again (an A/A control), the question's variants and a copy of the same
bytes, timed in turns (each round in an order of a shuffled balanced design: time_in_turns)
on one set of inputs; each variant's output is first checked against the float64 reference
(fusednorm.reference) within twice the base's error. Rows: median ms with 20/80% quantiles,
pct_of_copy (copy time over the provider's, x 100) and x_base (base time over the provider's:
> 1 is faster than base); base_again's x_base is the run's noise floor and order bias.

The device-independent parts (cases, statistics, rows, the table) take plain callables, so
tests/test_cuda_ab.py runs them on the CPU.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Callable

import torch

from .variants import QUESTIONS, Question, Unit

DEFAULT_N = (1024, 2048, 4096, 8192, 12288, 16384, 32768, 65536)
DEFAULT_ELEMENTS = 1 << 26  # per tensor: far beyond L2 (M = elements // N rows)
DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}
BASE = "base"
AA = "base_again"  # base timed a second time as a provider of its own: the A/A control
COPY = "copy"
DEFAULT_ROUNDS = 15


def variant_id(question: str, variant: str) -> str:
    return f"{question}__{variant}"


def build_plan(questions: list[Question]):
    """variant id -> (edits, units): the base covers every unit of the questions, each variant
    its own question's."""
    units = tuple(dict.fromkeys(u for q in questions for u in q.units))
    # The base also makes the statistics a backward case reads: the forward of its unit.
    units = tuple(dict.fromkeys(units + tuple(Unit(u.kind, "fwd", u.tag) for u in units)))
    plan = {BASE: ((), units)}
    for q in questions:
        for name, edits in q.variants.items():
            plan[variant_id(q.name, name)] = (edits, q.units)
    return plan


@dataclasses.dataclass(frozen=True)
class Case:
    question: str
    unit: Unit
    M: int
    N: int


def cases(questions: list[Question], ns=DEFAULT_N, elements=DEFAULT_ELEMENTS,
          tags: set[str] | None = None) -> list[Case]:
    out = []
    for q in questions:
        for unit in q.units:
            if tags is None or unit.tag in tags:
                out += [Case(q.name, unit, max(1, elements // n), n) for n in ns]
    return out


def pass_bytes(case: Case) -> int:
    """The least bytes the pass moves: forward reads x (and the residual) and writes y (and
    the sum); backward reads dy and x (and grad_sum) and writes dx (parameters and
    statistics, O(M + N), left out)."""
    size = torch.empty((), dtype=DTYPE[case.unit.tag]).element_size()
    u = case.unit
    tensors = (4 if u.residual else 2) if u.pass_ == "fwd" else 4 if u.grad_sum else 3
    return tensors * case.M * case.N * size


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    """(median, 20%, 80%) of the samples."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), q[1], q[7]


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design of n slots: n orders (2n when n is odd) in which each slot is once in
    every position (per n orders) and right after every other slot equally often (once, or
    twice when n is odd)."""
    first, lo, hi = [0], 1, n - 1
    for j in range(1, n):
        if j % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(f + i) % n for f in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_in_turns(providers: dict[str, Callable[[], object]], rounds: int,
                  timer: Callable[[Callable[[], object]], float],
                  seed: int | str = 0) -> dict[str, list[float]]:
    """Each provider timed once per round by timer(fn) -> ms. The rounds' orders come in
    blocks of a Williams design (williams_rows), the providers assigned to its slots and the
    block's orders shuffled by random.Random(seed) (a run is reproducible): in a block, each
    provider takes every position and follows every other provider equally often. Each round
    starts with a discarded sample of its first provider, so no kept sample follows the
    previous round's last. Why: a sample depends on what ran before it (on an H200 one after
    the copy of the pass's bytes is slower); a rotated order gave every provider a fixed
    predecessor, so base always followed the copy."""
    names = list(providers)
    samples = {n: [] for n in names}
    if not names:
        return samples
    rng = random.Random(seed)
    block: list[list[str]] = []
    for _ in range(rounds):
        if not block:
            slots = rng.sample(names, len(names))
            block = [[slots[i] for i in row] for row in williams_rows(len(names))]
            rng.shuffle(block)
        order = block.pop()
        timer(providers[order[0]])  # discarded
        for name in order:
            samples[name].append(timer(providers[name]))
    return samples


def rows_for(case: Case, samples: dict[str, list[float]], ok: dict[str, bool]) -> list[dict]:
    stats = {name: quantiles(s) for name, s in samples.items()}
    copy_ms, base_ms = stats[COPY][0], stats[BASE][0]
    rows = []
    for name, (ms, p20, p80) in stats.items():
        rows.append({
            "question": case.question, "kind": case.unit.kind, "pass": case.unit.label,
            "dtype": case.unit.tag, "M": case.M, "N": case.N, "provider": name,
            "ms": ms, "ms_p20": p20, "ms_p80": p80,
            "gbps": pass_bytes(case) / ms / 1e6,
            "pct_of_copy": 100.0 * copy_ms / ms,
            "x_base": base_ms / ms,
            "ok": ok.get(name, True),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per question: a line per (kind, pass, dtype, N), a column per provider with
    its % of copy and its speed over base."""
    out = []
    for question in dict.fromkeys(r["question"] for r in rows):
        mine = [r for r in rows if r["question"] == question]
        providers = [p for p in dict.fromkeys(r["provider"] for r in mine) if p != COPY]
        short = [p.split("__", 1)[-1] for p in providers]
        out += [f"### {question}", "", QUESTIONS[question].why if question in QUESTIONS else "",
                "", "% of copy (x base) per provider; ! = output off the reference; "
                f"{AA}: base timed again as its own provider, its x base the run's noise "
                "floor (a variant's gain counts beyond it).", "",
                "| kind | pass | dtype | M x N | copy ms | " + " | ".join(short) + " |",
                "|---|---|---|---|--:|" + "--:|" * len(short)]
        keys = dict.fromkeys((r["kind"], r["pass"], r["dtype"], r["M"], r["N"]) for r in mine)
        for key in keys:
            cell = {r["provider"]: r for r in mine
                    if (r["kind"], r["pass"], r["dtype"], r["M"], r["N"]) == key}
            kind, pass_, dtype, M, N = key
            cells = [f"{cell[p]['pct_of_copy']:.1f}% ({cell[p]['x_base']:.3f}x)"
                     + ("" if cell[p]["ok"] else " !") if p in cell else "" for p in providers]
            out.append(f"| {kind} | {pass_} | {dtype} | {M} x {N} | "
                       f"{cell[COPY]['ms']:.4f} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# The device side: inputs, the providers of a case, the reference check, a CUDA-event timer.

def cuda_timer(min_ms: float = 1.0) -> Callable[[Callable[[], object]], float]:
    """timer(fn): ms per call of fn, from CUDA events around enough back-to-back calls to
    fill min_ms (the count found once per fn by one timed call)."""
    reps_of: dict[int, int] = {}

    def timer(fn):
        reps = reps_of.get(id(fn))
        if reps is None:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            reps = reps_of[id(fn)] = max(1, int(min_ms / max(start.elapsed_time(end), 1e-3)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    return timer


def tensors(case: Case, M: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used
    dtype = DTYPE[case.unit.tag]

    def rand(*shape, shift=0.5):
        return (torch.randn(*shape, generator=g, dtype=torch.float32, device=device)
                + shift).to(dtype)

    centered = case.unit.kind == "layer_norm"
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    t = {"x": rand(M, case.N), "dy": rand(M, case.N, shift=0.0), "w": rand(case.N, shift=1.0),
         "b": rand(case.N) if centered else None, "centered": centered,
         "eps": 1e-5 if centered else 1e-6}
    t["y"] = torch.empty_like(t["x"])
    t["mean"] = torch.empty(M, dtype=acc, device=device) if centered else None
    t["rstd"] = torch.empty(M, dtype=acc, device=device)
    t["dx"] = torch.empty_like(t["x"])
    t["gs"] = rand(M, case.N, shift=0.0) if case.unit.grad_sum else None
    t["r"] = rand(M, case.N, shift=0.0) if case.unit.residual else None
    t["sum"] = torch.empty_like(t["x"]) if case.unit.residual else None
    t["dw"] = torch.empty_like(t["w"])
    t["db"] = torch.empty_like(t["b"]) if centered else None
    return t


def call(module, case: Case, t: dict) -> Callable[[], None]:
    """One pass of the case by the variant's module, into t's outputs (the backward reads the
    statistics a forward left there)."""
    if case.unit.pass_ == "fwd":
        return lambda: module.fwd(t["centered"], t["x"], t["r"], t["w"], t["b"], t["eps"], t["y"],
                                  t["sum"], t["mean"], t["rstd"])
    return lambda: module.bwd(t["centered"], t["dy"], t["gs"], t["x"], t["mean"], t["rstd"], t["w"],
                              t["dx"], t["dw"], t["db"])


def reference_outputs(case: Case, t: dict) -> list[torch.Tensor]:
    """float64 forward output (and the sum, of the input's dtype: the kernels normalize its
    rounded values), or dx (plus grad_sum), dweight (and dbias) of the backward."""
    from fusednorm import reference

    if t["r"] is not None:
        total = (t["x"].double() + t["r"].double()).to(t["x"].dtype)
        return reference_outputs(case, {**t, "x": total, "r": None}) + [total.double()]
    x = t["x"].double().requires_grad_()
    w = t["w"].double().requires_grad_()
    b = t["b"].double().requires_grad_() if t["b"] is not None else None
    if t["centered"]:
        y = reference.layer_norm(x, (case.N,), w, b, t["eps"])
    else:
        y = reference.rms_norm(x, (case.N,), w, t["eps"])
    if case.unit.pass_ == "fwd":
        return [y.detach()]
    y.backward(t["dy"].double())
    dx = x.grad + t["gs"].double() if t["gs"] is not None else x.grad
    return [dx, w.grad] + ([b.grad] if b is not None else [])


def outputs(case: Case, t: dict) -> list[torch.Tensor]:
    if case.unit.pass_ == "fwd":
        return [t["y"].clone()] + ([t["sum"].clone()] if t["sum"] is not None else [])
    return [t["dx"].clone(), t["dw"].clone()] + ([t["db"].clone()] if t["db"] is not None else [])


def check_rows(case: Case, modules: dict, device: str, rows: int = 64) -> dict[str, bool]:
    """Whether each module's outputs on `rows` rows are within 2x base's error of float64
    (+ a few units of the dtype's rounding), the outputs poisoned with NaN before each call."""
    t = tensors(case, min(rows, case.M), device, seed=1)
    modules[BASE].fwd(t["centered"], t["x"], None, t["w"], t["b"], t["eps"], t["y"], None,
                      t["mean"], t["rstd"])
    ref = reference_outputs(case, t)
    got = {}
    for name, module in modules.items():
        for key in ("y", "sum", "dx", "dw", "db"):  # NaN where a variant writes nothing
            if t[key] is not None:
                t[key].fill_(float("nan"))
        call(module, case, t)()
        got[name] = outputs(case, t)
    tol = 4 * torch.finfo(DTYPE[case.unit.tag]).eps
    ok = {}
    for name, outs in got.items():
        ok[name] = all(
            (o.double() - r).abs().max().item()
            <= 2 * (b.double() - r).abs().max().item() + tol * (1 + r.abs().max().item())
            for o, b, r in zip(outs, got[BASE], ref))
    return ok


def run_case(case: Case, modules: dict, rounds: int, device: str = "cuda",
             timer=None, seed: int | str = 0) -> list[dict]:
    """modules: provider name -> variant module (BASE among them); adds base again (AA: the
    same module, a second callable) and the copy, timed in turns (time_in_turns, seed)."""
    ok = check_rows(case, modules, device)
    ok[AA] = ok[BASE]
    t = tensors(case, case.M, device)
    modules[BASE].fwd(t["centered"], t["x"], None, t["w"], t["b"], t["eps"], t["y"], None,
                      t["mean"], t["rstd"])  # the statistics the backward reads
    src = torch.empty(pass_bytes(case) // 2 // t["x"].element_size(), dtype=t["x"].dtype,
                      device=device).normal_()
    dst = torch.empty_like(src)
    providers = {BASE: call(modules[BASE], case, t), AA: call(modules[BASE], case, t)}
    providers.update({name: call(m, case, t) for name, m in modules.items() if name != BASE})
    providers[COPY] = lambda: dst.copy_(src)
    samples = time_in_turns(providers, rounds, timer or cuda_timer(), seed=seed)
    return rows_for(case, samples, ok)
