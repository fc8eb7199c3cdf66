"""The questions the CUDA A/B tool asks: each a set of variants of the norm kernels, a variant
being textual edits of a copy of csrc/ (the production files stay untouched, so their code and
SASS cannot change), compiled for the (kind, pass, input dtype) units the question is about and
timed against the unedited tree ("base") and a copy of the same bytes.

An edit names a file under csrc/, a text that must occur in it exactly once and its
replacement: a variant whose text has moved fails to build, loudly, instead of silently
timing the base again. Where the tuning sits: csrc/cuda/norm_config.cuh (bucket tables,
launch bounds, rows per block, Welford lanes).
"""
from __future__ import annotations

import dataclasses

CONFIG = "cuda/norm_config.cuh"


@dataclasses.dataclass(frozen=True)
class Edit:
    path: str  # under csrc/
    old: str  # occurs exactly once in the file
    new: str


@dataclasses.dataclass(frozen=True)
class Unit:
    """One compiled instance file: a kind, a pass and an input tag of norm_launch.h."""
    kind: str  # "layer_norm" | "rms_norm"
    pass_: str  # "fwd" | "bwd"
    tag: str  # "bf16" | "f16" | "f32" | "f64"


@dataclasses.dataclass(frozen=True)
class Question:
    name: str
    why: str  # the finding that asks it
    units: tuple[Unit, ...]
    variants: dict[str, tuple[Edit, ...]]


def _units(kinds, passes, tags):
    return tuple(Unit(k, p, t) for k in kinds for p in passes for t in tags)


_FWD_TABLE = ("{{32, 1},  {32, 2},  {32, 4},  {64, 4},  {128, 4},\n" + " " * 37
              + "{256, 4}, {512, 4}, {512, 8}, {1024, 8}};")


def _fwd_table(buckets: str) -> Edit:
    """FwdVecBuckets (16-bit and float32 inputs with parameters of their dtype) replaced."""
    return Edit(CONFIG, "struct FwdVecBuckets {\n  static constexpr Bucket kList[] = "
                + _FWD_TABLE,
                "struct FwdVecBuckets {\n  static constexpr Bucket kList[] = " + buckets + ";")


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question(
        "fwd_launch_bounds",
        "Nsight (2026-11-26, H200): the LayerNorm forward is issue-bound, 64 registers, 38% "
        "achieved occupancy. Does the 128-register bound (fewer resident threads, room for "
        "more independent work) or more rows per block (256-thread blocks for rows of < 256 "
        "threads) issue faster?",
        _units(["layer_norm"], ["fwd"], ["bf16", "f32"]),
        {
            "min_threads_512": (Edit(CONFIG, "? 512 : 1024) /", "? 512 : 512) /"),),
            "block_256": (Edit(CONFIG, "kBlock = TPR >= 128 ? TPR : 128;",
                               "kBlock = TPR >= 256 ? TPR : 256;"),),
        }),
    Question(
        "fwd_packs_per_thread",
        "36 instructions per element in the forward: fewer packs per thread spreads a row over "
        "more threads (shorter per-thread loops, more warps to hide latency); more packs per "
        "thread amortizes each thread's row reductions over more elements.",
        _units(["layer_norm", "rms_norm"], ["fwd"], ["bf16"]),
        {
            "two_packs": (_fwd_table("{{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}, "
                                     "{512, 2}, {1024, 2}, {1024, 4}, {1024, 8}}"),),
            "eight_packs": (_fwd_table("{{32, 1}, {32, 2}, {32, 4}, {32, 8}, {64, 8}, "
                                       "{128, 8}, {256, 8}, {512, 8}, {1024, 8}}"),),
        }),
    Question(
        "welford_lanes",
        "Independent Welford summaries per thread (4 today): each lane costs its own merge at "
        "the row's end; 2 lanes halve that work, 8 (one per bf16 element of a pack) shorten "
        "the dependent chains further.",
        _units(["layer_norm"], ["fwd"], ["bf16", "f32"]),
        {
            "lanes_2": (Edit(CONFIG, "kWelfordLanes = VEC < 4 ? VEC : 4;",
                             "kWelfordLanes = VEC < 2 ? VEC : 2;"),),
            "lanes_8": (Edit(CONFIG, "kWelfordLanes = VEC < 4 ? VEC : 4;",
                             "kWelfordLanes = VEC < 8 ? VEC : 8;"),),
        }),
    Question(
        "bwd_long_rows",
        "The backward falls from 68-91% of copy up to N = 8192 to 43-62% from N = 12288: 16-bit "
        "rows over 8192 elements leave the largest bucket (256 x 4 packs) for the chunked "
        "path. Does a 512 x 4 bucket (rows to 16384 in one block) or 2 packs per thread up "
        "to 1024 threads keep them whole and faster?",
        _units(["layer_norm", "rms_norm"], ["bwd"], ["bf16"]),
        {
            "bucket_512x4": (Edit(
                CONFIG,
                "= {{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}};",
                "= {{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}, {512, 4}};"),),
            "bucket_1024x2": (Edit(
                CONFIG,
                "= {{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}};",
                "= {{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}, {1024, 2}};"),),
        }),
)}


def apply_edits(files: dict[str, str], edits: tuple[Edit, ...]) -> dict[str, str]:
    """files (path under csrc/ -> text) with the edits made; ValueError naming the edit when
    its text does not occur exactly once."""
    out = dict(files)
    for e in edits:
        text = out.get(e.path)
        if text is None:
            raise ValueError(f"edit of {e.path}: no such file under csrc/")
        count = text.count(e.old)
        if count != 1:
            raise ValueError(f"edit of {e.path}: {e.old!r} occurs {count} times (must be once)")
        out[e.path] = text.replace(e.old, e.new)
    return out
