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


_BWD_TABLE = ("{{32, 1},  {32, 2},  {32, 4}, {64, 4},\n" + " " * 37
              + "{128, 4}, {256, 4}, {512, 4}};")


def _bwd_table(buckets: str) -> Edit:
    """BwdVecBucketList (every backward of 16-byte packs but 16-bit LayerNorm with a
    grad_sum) replaced."""
    return Edit(CONFIG, "struct BwdVecBucketList {\n  static constexpr Bucket kList[] = "
                + _BWD_TABLE,
                "struct BwdVecBucketList {\n  static constexpr Bucket kList[] = " + buckets + ";")


KERNELS = "cuda/norm_kernels.cuh"


def _fwd_grid(blocks: str) -> Edit:
    """The forward launcher's grid.x (rows_grid's one wave of resident blocks) replaced by
    `blocks`, an expression of that grid and row_groups (a block per group of rows)."""
    return Edit(KERNELS, "const dim3 grid = rows_grid<kTpr>(kernel, p, dev, occupancy);",
                "dim3 grid = rows_grid<kTpr>(kernel, p, dev, occupancy);\n"
                "    const int64_t row_groups = std::max<int64_t>(\n"
                "        1, std::min<int64_t>(ceil_div(p.M, RowLayout<kTpr>::kRows), INT_MAX));\n"
                f"    grid.x = static_cast<unsigned>({blocks});")


_FWD_ROW_LOOP = ("    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {\n"
                 "      const int64_t row = g * Layout::kRows + slot;\n"
                 "      const bool row_ok = row < p.M;\n"
                 "      const int64_t row_start = row_ok ? row * p.N : 0;\n")

# The forward reads the x packs of a block's next row before the current row's reductions
# (software pipelining across the row loop), in the buckets of up to 4 packs a thread (those of
# 8 spilled with it even at 128 registers), with the 768-thread bound (80 registers: at 64 the
# 4-pack buckets spilled 20 bytes).
_FWD_PREFETCH_768 = (
    Edit(KERNELS, _FWD_ROW_LOOP,
         "    constexpr bool kAhead = ITEMS <= 4;\n"
         "    Pack<IO, VEC> ahead[kAhead ? ITEMS : 1];  // x of this block's next row\n"
         "    const auto fetch = [&](int64_t g2) {\n"
         "      const int64_t row2 = g2 * Layout::kRows + slot;\n"
         "      if constexpr (kAhead) {\n"
         "        if (g2 < groups && row2 < p.M) {\n"
         "          const int64_t first2 = row2 * p.N + col0 + int64_t(tid) * VEC;\n"
         "          for (int i = 0; i < ITEMS; ++i) {\n"
         "            if ((i * TPR + tid) * VEC < len) {\n"
         "              ahead[i] = load_pack<VEC>(p.x + first2 + int64_t(i) * TPR * VEC);\n"
         "            }\n"
         "          }\n"
         "        }\n"
         "      }\n"
         "    };\n"
         "    fetch(blockIdx.x);\n" + _FWD_ROW_LOOP),
    Edit(KERNELS, "xs[i] = pack_as<T>(load_pack<VEC>(p.x + first + i * kStride));",
         "xs[i] = pack_as<T>([&] {\n"
         "            if constexpr (kAhead) {\n"
         "              return ahead[i];\n"
         "            } else {\n"
         "              return load_pack<VEC>(p.x + first + i * kStride);\n"
         "            }\n"
         "          }());"),
    Edit(KERNELS, "      acc_t shift = 0;\n", "      fetch(g + gridDim.x);\n      acc_t shift = 0;\n"),
    Edit(CONFIG, "(sizeof(T) == 8 || (sizeof(P) > sizeof(T) && ITEMS >= 8) ? 512 : 1024)",
         "(sizeof(T) == 8 || (sizeof(P) > sizeof(T) && ITEMS >= 8) ? 512 : 768)"),
)


# The backward's row-to-row state where a block holds one row (TPR >= 128) of 16-byte packs:
# norm_config.cuh's two knobs, off in the production tree. (The one-element kernels, at 64
# registers, spilled 24 bytes with the next row's loads.)
_BWD_SHARED_SUMS = Edit(CONFIG, "constexpr bool kBwdSharedSums = false;",
                        "constexpr bool kBwdSharedSums = RowLayout<TPR>::kRows == 1 && VEC > 1;")
_BWD_NEXT_ROW = Edit(CONFIG, "constexpr bool kBwdNextRow = false;",
                     "constexpr bool kBwdNextRow = RowLayout<TPR>::kRows == 1 && VEC > 1;")


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
        "fwd_ceiling",
        "H200: the 16-bit forwards stop at 80-84% of copy at N = 1024-16384, LayerNorm's "
        "(2026-11-27, 46ed965) and RMSNorm's alike (781b7f6), though RMSNorm's kernels "
        "issue about a quarter fewer SASS instructions per element; torch.compile reaches "
        "93-99% at N = 8192-16384, and the add ops' forwards (two input streams) up to 94%. "
        "Is it the bytes in flight (a block loads a row, then reduces and writes it with no "
        "load outstanding), the one-wave grid (blocks in step), or the caching of x and y "
        "(each touched once)?",
        _units(["layer_norm", "rms_norm"], ["fwd"], ["bf16"]) + _units(["layer_norm"], ["fwd"], ["f32"]),
        {
            # Four times the resident blocks: the hardware hands rows out as blocks finish.
            "grid_x4": (_fwd_grid("std::min<int64_t>(int64_t(grid.x) * 4, row_groups)"),),
            # A block per row group: no loop over rows.
            "grid_all_rows": (_fwd_grid("row_groups"),),
            # The next row's x loaded before this row's reductions (more bytes in flight).
            "prefetch_768": _FWD_PREFETCH_768,
            # x read and y (and the sum) written with the evict-first (streaming) hint.
            "stream_hints": (
                Edit("cuda/device_utils.cuh", '"st.global.v4.b32 [%0]',
                     '"st.global.cs.v4.b32 [%0]'),
                Edit("cuda/device_utils.cuh",
                     "// Whether p may be read by 16-byte accesses",
                     "template <int VEC, typename T>\n"
                     "__device__ __forceinline__ Pack<T, VEC> load_pack_cs(const T* p) {\n"
                     "#ifndef FUSEDNORM_EMULATION\n"
                     "  if constexpr (sizeof(Pack<T, VEC>) == 16) {\n"
                     "    const uint4 w = __ldcs(reinterpret_cast<const uint4*>(p));\n"
                     "    Pack<T, VEC> out;\n"
                     "    memcpy(&out, &w, sizeof(w));\n"
                     "    return out;\n"
                     "  }\n"
                     "#endif\n"
                     "  return load_pack<VEC>(p);\n"
                     "}\n\n"
                     "// Whether p may be read by 16-byte accesses"),
                Edit(KERNELS, "xs[i] = pack_as<T>(load_pack<VEC>(p.x + first + i * kStride));",
                     "xs[i] = pack_as<T>(load_pack_cs<VEC>(p.x + first + i * kStride));"),
            ),
        }),
    Question(
        "bwd_in_flight",
        "H200, 2026-11-27 (46ed965): the backward reaches 68-91% of copy up to N = 8192 but "
        "62-73% at 12288-16384 with the 512 x 4 bucket (a lone block of 512 threads per "
        "multiprocessor: 128 registers, half of them the dweight/dbias column sums) and "
        "43-62% beyond. A block loads a row, then reduces, computes and writes it with no "
        "load outstanding. Do the column sums in shared memory (registers freed), and with "
        "them the next row's x and dy loaded before this row's reductions, close the gap?",
        _units(["layer_norm", "rms_norm"], ["bwd"], ["bf16"]) + _units(["layer_norm"], ["bwd"], ["f32"]),
        {
            "shared_sums": (_BWD_SHARED_SUMS,),
            "next_row": (_BWD_SHARED_SUMS, _BWD_NEXT_ROW),
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
