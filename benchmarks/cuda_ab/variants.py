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
    """One compiled instance file: a kind, a pass and an input tag of norm_launch.h; with
    grad_sum, the backward is timed with the residual's gradient added to dx (the add ops'
    backward), with residual the forward with a residual added to x and the sum written (the
    add ops' forward): the same file, runtime pointers."""
    kind: str  # "layer_norm" | "rms_norm"
    pass_: str  # "fwd" | "bwd"
    tag: str  # "bf16" | "f16" | "f32" | "f64"
    grad_sum: bool = False
    residual: bool = False

    def __post_init__(self):
        if (self.grad_sum and self.pass_ != "bwd") or (self.residual and self.pass_ != "fwd"):
            raise ValueError(f"{self}: grad_sum is the backward's, residual the forward's")

    @property
    def label(self) -> str:
        return self.pass_ + ("+grad_sum" if self.grad_sum else "") + (
            "+residual" if self.residual else "")


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


_BWD_TABLE = ("{{32, 1},  {32, 2},  {32, 4}, {64, 4},\n" + " " * 37
              + "{128, 4}, {256, 4}, {512, 4}};")


def _bwd_table(buckets: str) -> Edit:
    """BwdVecBucketList (every backward of 16-byte packs but 16-bit LayerNorm with a
    grad_sum) replaced."""
    return Edit(CONFIG, "struct BwdVecBucketList {\n  static constexpr Bucket kList[] = "
                + _BWD_TABLE,
                "struct BwdVecBucketList {\n  static constexpr Bucket kList[] = " + buckets + ";")


# The backward's row-to-row state where a block holds one row (TPR >= 128) of 16-byte packs:
# norm_config.cuh's two knobs (the column sums in shared memory; with them the next row
# loaded ahead), on in production for float's clustered rows only. BWD_ROW_STATE_EVERYWHERE
# turns both on for every one-row kernel (the emulation checks that tree too); the
# _BWD_NEXT_ROW_AS_IS edit keeps the next row's loads where production has them. (The
# one-element kernels, at 64 registers, spilled 24 bytes with the next row's loads.)
_BWD_KNOB_RULE = "sizeof(T) == 4 && CLUSTER && VEC > 1 && RowLayout<TPR>::kRows == 1;"
BWD_ROW_STATE_EVERYWHERE = (
    Edit(CONFIG, "constexpr bool kBwdSharedSums =\n    " + _BWD_KNOB_RULE,
         "constexpr bool kBwdSharedSums =\n    VEC > 1 && RowLayout<TPR>::kRows == 1;"),)
_BWD_NEXT_ROW_AS_IS = Edit(
    CONFIG, "constexpr bool kBwdNextRow = kBwdSharedSums<T, VEC, TPR, ITEMS, CLUSTER>;",
    "constexpr bool kBwdNextRow = " + _BWD_KNOB_RULE)

# 16-bit LayerNorm with a grad_sum (add_layer_norm's backward): one-row blocks of 4 packs
# (rows to 16384 halves unchunked), the grad_sum beside them where the sums left registers.
_GRAD_SUM_4_PACKS = (
    Edit(CONFIG, "{{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}, {512, 2}};",
         "{{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}, {512, 2}, {512, 4}};"),
    Edit(CONFIG, "return !centered || vec == 1 || elem_bytes >= 4 || items <= 2;",
         "return !centered || vec == 1 || elem_bytes >= 4 || items <= 2 || tpr >= 128;"),
)


# 16-bit backward rows over 8192 elements cut into chunks of 256 x 4 (8192 halves) held by a
# cluster: blocks of 256 threads at the 512-thread bound, two per multiprocessor, where the
# whole-row 512 x 4 bucket and the clustered 512 x 4 chunks run one (float32 and float64
# keep BwdVecBucketList).
_BWD16_CLUSTERS_OF_256 = Edit(
    CONFIG, "template <typename T>\nusing BwdVecBuckets = BwdVecBucketList;",
    "struct BwdVecBuckets16 {\n  static constexpr Bucket kList[] = {{32, 1}, {32, 2}, {32, 4}, "
    "{64, 4}, {128, 4}, {256, 4}};\n};\ntemplate <typename T>\nusing BwdVecBuckets =\n"
    "    std::conditional_t<sizeof(T) == 2, BwdVecBuckets16, BwdVecBucketList>;")
# The row-to-row knobs of float's clustered rows (shared-memory sums, next row ahead) on for
# 16-bit clustered rows too.
_BWD16_CLUSTER_ROW_STATE = Edit(
    CONFIG, "constexpr bool kBwdSharedSums =\n    " + _BWD_KNOB_RULE,
    "constexpr bool kBwdSharedSums =\n    sizeof(T) <= 4 && CLUSTER && VEC > 1 && "
    "RowLayout<TPR>::kRows == 1;")
# 16-bit LayerNorm with a grad_sum: chunks of 256 x 2 (4096 halves), two blocks per
# multiprocessor (rows to 32768 halves in clusters of up to 8).
_GRAD_SUM_CLUSTERS_OF_256 = Edit(
    CONFIG, "{{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}, {512, 2}};",
    "{{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}};")

# The 16-bit LayerNorm forward's statistics from shifted sums (kFwdShiftedSums on for T of 2
# bytes; float32 and float64 keep Welford's lanes).
_FWD16_SHIFTED_SUMS = Edit(CONFIG, "template <typename T>\nconstexpr bool kFwdShiftedSums = false;",
                           "template <typename T>\nconstexpr bool kFwdShiftedSums = sizeof(T) == 2;")

# The forward's next row of x staged in shared memory by cp.async (kFwdStagedRow), for the
# one-row kernels of 16-byte packs of x without dropout whose rows hold `rule`.
def _fwd_staged_rows(rule: str) -> Edit:
    return Edit(CONFIG, "constexpr bool kFwdStagedRow = false;",
                "constexpr bool kFwdStagedRow =\n"
                "    std::is_same_v<T, IO> && VEC * sizeof(T) == 16 && !DROPOUT &&\n"
                "    RowLayout<TPR>::kRows == 1 && " + rule + ";")


# The launch bound of the 16-bit backward kernels of 16-byte packs and at most 2 packs per
# thread (16-bit LayerNorm with a grad_sum, BwdVecBucketsGradSum16, and the plain table's
# 32 x 1 and 32 x 2) that also meet `rule` (C++ appended to the condition): `threads` per
# multiprocessor instead of 512.
def _bwd16_two_pack_threads(threads: int, rule: str) -> Edit:
    return Edit(CONFIG, "    : sizeof(T) != 2 || ITEMS != 4                       ? 512\n",
                f"    : sizeof(T) == 2 && VEC > 1 && ITEMS <= 2{rule}            ? {threads}\n"
                "    : sizeof(T) != 2 || ITEMS != 4                       ? 512\n")


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question(
        "rows_of_12288",
        "H200, 2026-11-27: the 16-bit LayerNorm forward reaches 80-82% of copy at N <= 8192 "
        "but 70-75% at N = 12288, where a row (1536 packs) takes the 512 x 4 bucket with a "
        "quarter of its threads idle; float32 (3072 packs) takes 512 x 8 likewise, and the "
        "backward's 512 x 4. Do 384-thread buckets (12 warps, an exact fit) close the gap?",
        _units(["layer_norm"], ["fwd"], ["bf16", "f32"])
        + _units(["layer_norm", "rms_norm"], ["bwd"], ["bf16"]),
        {
            "fwd_384": (_fwd_table("{{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}, "
                                   "{384, 4}, {512, 4}, {384, 8}, {512, 8}, {1024, 8}}"),),
            "bwd_384": (_bwd_table("{{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, {256, 4}, "
                                   "{384, 4}, {512, 4}}"),),
        }),
    Question(
        "fwd_mid_rows",
        "H200, 2026-11-27 (fwd_packs_per_thread): 8 packs per thread everywhere gave the "
        "16-bit LayerNorm forward 1.11x at N = 12288 and 1.03x at 16384 but 0.98x at "
        "4096-8192. Does 256 x 8 in place of 512 x 4 alone (rows of 1025-2048 packs) keep the "
        "gain without the loss?",
        _units(["layer_norm", "rms_norm"], ["fwd"], ["bf16", "f16"]),
        {
            "packs_8_from_1025": (_fwd_table("{{32, 1}, {32, 2}, {32, 4}, {64, 4}, {128, 4}, "
                                             "{256, 4}, {256, 8}, {512, 8}, {1024, 8}}"),),
        }),
    Question(
        "f32_fwd_bounds",
        "H200, 2026-11-27: the float32 forward reaches 85-88% of copy where torch.compile and "
        "Liger reach 95-96%. The 512-thread bound (128 registers) for every forward gave "
        "float32 1.036x at N = 1024-2048 (blocks of 128 threads) but 0.74x at 8192 (one "
        "block of 512). Does it help float32's blocks of 128 threads alone?",
        _units(["layer_norm", "rms_norm"], ["fwd"], ["f32"]),
        {
            "small_blocks_512": (Edit(
                CONFIG, "(sizeof(T) == 8 || (sizeof(P) > sizeof(T) && ITEMS >= 8) ? 512 : 1024)",
                "(sizeof(T) == 8 || (sizeof(P) > sizeof(T) && ITEMS >= 8) ||\n"
                "                     (sizeof(T) == 4 && RowLayout<TPR>::kBlock == 128) ? 512 : 1024)"),),
        }),
    Question(
        "add_bwd_long_rows",
        "H200 (17cf9a2 file): add_layer_norm's bf16 backward at 36-49% of copy for N = "
        "16384-65536. 16-bit LayerNorm with a grad_sum takes buckets of at most 2 packs "
        "(BwdVecBucketsGradSum16: with 4, the grad_sum packs beside the dbias sums spilled at "
        "128 registers), so its rows over 8192 halves are cut into 2-8 chunks (clusters). With "
        "the column sums in shared memory, does a 512 x 4 bucket (rows to 16384 halves whole, "
        "half the chunks beyond) fit and win, with or without the next row loaded ahead? "
        "(RMSNorm, whose table has 512 x 4 already, for the knobs alone. Without a grad_sum "
        "the knobs cost 16-bit rows 5-15% at N >= 4096: bwd_in_flight, H200 2026-11-27.)",
        (Unit("layer_norm", "bwd", "bf16", grad_sum=True),
         Unit("rms_norm", "bwd", "bf16", grad_sum=True)),
        {
            "shared_sums_4": BWD_ROW_STATE_EVERYWHERE + (_BWD_NEXT_ROW_AS_IS,) + _GRAD_SUM_4_PACKS,
            "next_row_4": BWD_ROW_STATE_EVERYWHERE + _GRAD_SUM_4_PACKS,
        }),
    Question(
        "bwd16_long_rows",
        "H200, 2026-11-27 (eighth run, bwd_in_flight base): the 16-bit backward reaches "
        "77-89% of copy to N = 8192 (256 x 4 and smaller: two or more blocks per "
        "multiprocessor) but 48-68% (LayerNorm) and 53-76% (RMSNorm) at N = 12288-65536, "
        "where a lone block of 512 x 4 per multiprocessor (whole rows to 16384, clustered "
        "chunks beyond) loads, reduces and writes a row with nothing else in flight; the "
        "shared-memory sums and the next row ahead cost those rows 5-15%. Do clusters of "
        "256 x 4 chunks, two blocks per multiprocessor (2 chunks at 12288-16384, 4 at 32768, "
        "8 at 65536), overlap one block's reductions with the other's loads? With the knobs "
        "on too?",
        _units(["layer_norm", "rms_norm"], ["bwd"], ["bf16"])
        + (Unit("layer_norm", "bwd", "bf16", grad_sum=True),),
        {
            "clusters_of_256": (_BWD16_CLUSTERS_OF_256, _GRAD_SUM_CLUSTERS_OF_256),
            "clusters_of_256_row_state": (_BWD16_CLUSTERS_OF_256, _GRAD_SUM_CLUSTERS_OF_256,
                                          _BWD16_CLUSTER_ROW_STATE),
        }),
    Question(
        "bwd16_staged_rows",
        "H200, 2026-11-28 (ninth run): the 16-bit backward's one-row blocks (128-512 x 4, "
        "N >= 4096; one block of 512 x 4 per multiprocessor at 128 registers for N = "
        "8193-16384, clustered chunks beyond) reach 47-58% of copy (LayerNorm) and 51-73% "
        "(RMSNorm) at N >= 12288: while a lone block reduces and writes a row, nothing is "
        "loaded. The next row in registers (kBwdNextRow) needs the column sums in shared "
        "memory, and lost 5-15%. Does the next row's x and dy staged in shared memory by "
        "cp.async (each thread its own packs, two buffers: 128 KB at 512 x 4; no barrier, no "
        "registers) keep loads in flight and win?",
        _units(["layer_norm", "rms_norm"], ["bwd"], ["bf16"])
        + (Unit("layer_norm", "bwd", "bf16", grad_sum=True),),
        {
            "staged": (Edit(
                CONFIG, "constexpr bool kBwdStagedRow = false;",
                "constexpr bool kBwdStagedRow = sizeof(T) == 2 && VEC * sizeof(T) == 16 &&\n"
                "                                RowLayout<TPR>::kRows == 1 &&\n"
                "                                !kBwdSharedSums<T, VEC, TPR, ITEMS, CLUSTER>;"),),
        }),
    Question(
        "fwd_staged_rows",
        "H200, 2026-11-28 (ninth run): the forward's rows in a lone block per multiprocessor "
        "(the 1024 x 8 bucket: 16-bit N = 32769-65536, float32 16385-32768, and float32's "
        "clustered chunks beyond) reach 70-78% (16-bit N = 65536) and 57-86% (float32) of "
        "copy where rows in blocks that share a multiprocessor reach 79-96%: a lone block "
        "loads its row, then reduces and writes it with no loads in flight (its 91 us at "
        "2^26 bf16 elements against an instruction floor of about 69 us). The next row in "
        "registers has no room at 64 registers, and chunks of 512 x 8 in clusters lost "
        "(fwd_long_rows). Does the next row's x, copied by cp.async into shared memory (each "
        "thread its own packs, 128 KB, issued once the row's statistics are reduced), keep "
        "loads in flight while a row is written, and win? In the lone blocks only, or in "
        "the 512 x 8 blocks (two a multiprocessor) too?",
        _units(["layer_norm"], ["fwd"], ["bf16", "f32"])
        + _units(["rms_norm"], ["fwd"], ["bf16"])
        + (Unit("layer_norm", "fwd", "bf16", residual=True),),
        {
            "lone_blocks": (_fwd_staged_rows("kFwdMinBlocks<T, P, TPR, ITEMS> == 1"),),
            "from_4096_packs": (_fwd_staged_rows("TPR * ITEMS >= 4096"),),
        }),
    Question(
        "bwd16_two_pack_bounds",
        "H200, 2026-11-28 (ninth run): add_layer_norm's bf16 backward reaches 61-65% of copy "
        "at N = 1024-8192, where LayerNorm's plain backward reaches 77-89%. Its kernels (the "
        "grad_sum table, BwdVecBucketsGradSum16: at most 2 packs per thread) are compiled for "
        "512 threads per multiprocessor and take 110-117 registers, so a multiprocessor holds "
        "16 warps with 48 KB of loads in flight. At 768 or 1024 threads they spill (24-168 "
        "bytes, static SASS); with their column sums in shared memory (kBwdSharedSums) the "
        "one-row ones (128 x 2, 256 x 2) fit 768 threads at 80 registers without spilling. "
        "Do the warps they add win (N = 2048-4096; 512 x 2 keeps one block of 512)? "
        "(shared_sums: the sums in shared memory at 512 threads, the control.)",
        (Unit("layer_norm", "bwd", "bf16", grad_sum=True),),
        {
            "shared_sums": BWD_ROW_STATE_EVERYWHERE + (_BWD_NEXT_ROW_AS_IS,),
            "shared_sums_768": BWD_ROW_STATE_EVERYWHERE + (_BWD_NEXT_ROW_AS_IS, _bwd16_two_pack_threads(
                768, " && RowLayout<TPR>::kRows == 1")),
        }),
    Question(
        "fwd16_shifted_sums",
        "H200, 2026-11-27 (eighth run): the 16-bit LayerNorm forward reaches 86-95% of copy "
        "where RMSNorm's reaches 94-97%, and the kernels are bound by their instruction "
        "issue. Per element, Welford's lanes take 5 operations (shift, delta, mean, v - mean, "
        "m2) and two reductions in turn; shifted sums take 3 (shift, sum, fma) and one "
        "reduction of two values, a second pass over the registers only for a row whose "
        "shift sits more than 4 standard deviations from its mean. Do they bring LayerNorm "
        "to RMSNorm's speed, the add ops' forward (the same kernel) with it?",
        _units(["layer_norm"], ["fwd"], ["bf16", "f16"])
        + (Unit("layer_norm", "fwd", "bf16", residual=True),),
        {
            "shifted_sums": (_FWD16_SHIFTED_SUMS,),
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
