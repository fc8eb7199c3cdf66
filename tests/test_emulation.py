"""The CUDA kernels' logic, run without a GPU (select with `pytest -k emulat`):
tests/emulation compiles csrc/cuda/norm_kernels.cuh (launchers and kernels) as host
C++ against an emulation of the CUDA built-ins they use, and runs every size bucket, the
chunked long-row paths, odd sizes, misaligned views and every parameter case against a
float64 reference, in three thread schedules: LayerNorm fully, and RMSNorm and the residual
variants (forward residual / backward grad_sum) over a subset of sizes in every path, the
forward with dropout / rowscale in every path, and dropout_scale. A second program does the
same for the GELU-FFN's kernels (csrc/cuda/gelu_ffn_kernels.cuh: the gelu pass, the dgelu
pass with db1, the column sum of dy). See tests/emulation/README.md for what the emulation
does and does not see.

Skipped only without a C++ compiler (with FUSEDNORM_REQUIRE_EMULATION=1, set by CI, that is
a failure instead).
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch.utils.cpp_extension

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATION = os.path.join(REPO, "tests", "emulation")
CACHE = os.path.join(REPO, "build", "emulation")

# (T, P) pairs the CUDA op accepts, with T's element size.
PAIRS = [("f32", "f32"), ("f64", "f64"), ("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32")]
SIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
AFFINE = ["wb", "w", "b", "none"]
ORDERS = ["asc", "desc", "shuffle"]

# Row lengths in 16-byte packs: every bucket's capacity (32 ... 8192 packs) and one past it,
# then rows longer than the largest bucket (chunks).
VECTOR_PACKS = [1, 3, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048, 2049,
                4096, 4097, 8192, 8193, 16400]
# Row lengths for the one-element path (N not a multiple of the pack): the scalar buckets'
# capacities (128 ... 8192 elements) and one past, and chunked rows.
SCALAR_N = [1, 7, 127, 129, 511, 513, 2047, 2049, 4095, 4097, 8191, 8193, 20001]


def compiler_flags(only_float=False):
    includes = [os.path.join(EMULATION, "include"), os.path.join(REPO, "csrc")]
    includes += torch.utils.cpp_extension.include_paths()[:1]  # c10's headers (Half, BFloat16)
    flags = ["-std=c++20", "-O1", "-g0", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-pthread",
             "-DFUSEDNORM_EMULATION"] + [f"-I{d}" for d in includes]
    return flags + (["-DEMU_ONLY_FLOAT"] if only_float else [])


def sources(csrc=os.path.join(REPO, "csrc")):
    return sorted(
        glob.glob(os.path.join(EMULATION, "**", "*.*"), recursive=True)
        + glob.glob(os.path.join(csrc, "cuda", "*.cuh"))
        + glob.glob(os.path.join(csrc, "cuda", "*.h"))
        + glob.glob(os.path.join(csrc, "common", "*.h"))
    )


def build_harness(out_dir, csrc=os.path.join(REPO, "csrc"), only_float=False,
                  program="norm_emulated"):
    """Compiles tests/emulation/<program>.cpp against `csrc`; returns the binary."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        if os.environ.get("FUSEDNORM_REQUIRE_EMULATION") == "1":
            pytest.fail("FUSEDNORM_REQUIRE_EMULATION=1 but no C++ compiler (g++) was found")
        pytest.skip("no C++ compiler (g++) to build the emulation")
    flags = compiler_flags(only_float)
    flags = [f.replace(os.path.join(REPO, "csrc"), csrc) for f in flags]
    # Keyed on what is compiled, not where the copy of csrc lies: an edited copy in a
    # temporary folder (the row-state knobs) is built once, not on every run.
    def where(text):
        return text.replace(csrc, "<csrc>")

    digest = hashlib.sha256(" ".join([compiler, program] + [where(f) for f in flags]).encode())
    for path in sources(csrc):
        with open(path, "rb") as f:
            digest.update(where(path).encode() + f.read())
    binary = os.path.join(out_dir, f"{program}-{digest.hexdigest()[:16]}")
    os.makedirs(out_dir, exist_ok=True)
    # One compile per binary, also under pytest-xdist: the other processes wait for it
    # (14 workers compiling at once on a 16-core GPU machine took over 200 s each).
    with open(binary + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(binary):
            tmp = f"{binary}.{os.getpid()}.tmp"
            cmd = [compiler, *flags, os.path.join(EMULATION, f"{program}.cpp"), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, f"emulation build failed:\n{' '.join(cmd)}\n{done.stderr[-6000:]}"
            os.replace(tmp, binary)
    return binary


@pytest.fixture(scope="module")
def harness():
    return build_harness(CACHE)


def run_cases(binary, lines, timeout=600):
    done = subprocess.run([binary], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout, done.stderr


# A variant tree's largest rows (t -> the harness's `largest` answer for the dtype pair
# whose cases are made), set while tests/emulate_variant.py makes its cases; None:
# production's, below.
TABLE_ROWS: dict[str, dict[str, int]] | None = None


def table_rows(binary, t, p=None):
    """The largest bucket's row length of each table the harness compiled for T = t and
    P = p (default t): norm_emulated.cpp's `largest` line as a dict (fwd_vec, fwd_scalar,
    their _dropout tables, bwd_vec, bwd_vec_ln_grad_sum, bwd_scalar)."""
    code, out, err = run_cases(binary, [f"largest {t} {p or t}"])
    line = next(line for line in out.splitlines() if line.startswith(("largest ", "FAIL")))
    assert code == 0 and line.startswith("largest "), f"{line}\n{err[-2000:]}"
    words = line.split()[3:]
    return {k: int(v) for k, v in zip(words[::2], words[1::2])}


# The largest bucket's row length in elements (chunks are cut beyond it), per pass and
# path: csrc/cuda/norm_config.cuh's tables (the forward's 8192 packs of 16 bytes or
# 8192 elements; the backward's 2048 packs, 1024 for 16-bit LayerNorm with a grad_sum, or
# 4096 elements).
def largest_row(pass_, t, vectorized, ln_grad_sum=False, dropout=False):
    """dropout: the forward with dropout's tables (production's hold the same rows)."""
    if TABLE_ROWS is not None:
        kind = "vec" if vectorized else "scalar"
        key = f"{pass_}_{kind}" + ("_ln_grad_sum" if ln_grad_sum and vectorized and pass_ == "bwd" else "")
        key += "_dropout" if dropout and pass_ == "fwd" else ""
        return TABLE_ROWS[t][key]
    vec = 16 // SIZE[t]
    if pass_ == "fwd":
        return 8192 * vec if vectorized else 8192
    if not vectorized:
        return 4096
    return (1024 if ln_grad_sum and SIZE[t] == 2 else 2048) * vec


def cluster_cases(pass_, t, p, ln_grad_sum=False):
    """(case line, expected clustered launches): chunked rows of 2 to 8 chunks take one
    clustered launch when clusters are allowed; 9 chunks, or no clusters, the three-launch
    path."""
    vec = 16 // SIZE[t]
    cases = []
    for vectorized in (True, False):
        big = largest_row(pass_, t, vectorized, ln_grad_sum)
        # Multiples of the pack (the 16-byte path), or odd lengths (the one-element path).
        step = vec if vectorized else 1
        two = 2 * big if vectorized else 2 * big + 1
        for n, clustered, allow in [(two, 1, True), (8 * big - step, 1, True),
                                    (8 * big + step, 0, True), (two, 0, False)]:
            affine = AFFINE[len(cases) % len(AFFINE)]
            order = ORDERS[len(cases) % len(ORDERS)]
            flag = " clusters" if allow else ""
            cases.append((f"{pass_} {t} {p} 3 {n} {affine} 0 0 {order} 2{flag}", clustered))
    return cases


@pytest.mark.parametrize("t", sorted(SIZE))
def test_emulated_tables_are_the_case_generators(harness, t):
    """The largest rows the cases are cut from are those of the tables the harness compiled
    (norm_config.cuh): a table changed without the cases would test other paths than meant."""
    rows = table_rows(harness, t)
    assert rows == {"fwd_vec": largest_row("fwd", t, True), "fwd_scalar": largest_row("fwd", t, False),
                    "fwd_vec_dropout": largest_row("fwd", t, True, dropout=True),
                    "fwd_scalar_dropout": largest_row("fwd", t, False, dropout=True),
                    "bwd_vec": largest_row("bwd", t, True),
                    "bwd_vec_ln_grad_sum": largest_row("bwd", t, True, ln_grad_sum=True),
                    "bwd_scalar": largest_row("bwd", t, False)}


def rows_for(n):
    """Odd row counts: enough for several row groups per block (4 blocks of up to 4 rows
    each), few for long rows."""
    return max(3, min(37, 60000 // max(n, 1))) | 1


def cases_for(pass_, t, p):
    vec = 16 // SIZE[t]
    lines = []
    sizes = [(packs * vec, 0, 0) for packs in VECTOR_PACKS]  # the 16-byte path
    sizes += [(n, 0, 0) for n in SCALAR_N]  # N not a multiple of the pack
    # Misaligned views of x/dy (by one element) and of the parameters: one-element packs.
    sizes += [(100 * vec, SIZE[t], 0), (3000 * vec, SIZE[t], 0), (64 * vec, 0, SIZE[p]), (9000 * vec, SIZE[t], SIZE[p])]
    for i, (n, x_mis, p_mis) in enumerate(sizes):
        affine = AFFINE[i % len(AFFINE)]
        order = ORDERS[i % len(ORDERS)]
        lines.append(f"{pass_} {t} {p} {rows_for(n)} {n} {affine} {x_mis} {p_mis} {order}")
    # Every parameter case at one size, and a grid of 132 multiprocessors (the parameter
    # gradients' reduction then takes 8- and 16-column blocks), and many rows.
    for affine in AFFINE:
        lines.append(f"{pass_} {t} {p} 9 {vec * 96} {affine} 0 0 shuffle 132")
    lines.append(f"{pass_} {t} {p} 2001 {vec * 4} wb 0 0 asc 3")
    # Over 250 blocks of a 132-multiprocessor grid, each with its partial row of the
    # parameter gradients: more partial rows than the row lanes of their final sum
    # (sum_partial_rows_kernel), so that every lane has rows to add.
    lines.append(f"{pass_} {t} {p} 1001 {vec * 32} wb 0 0 shuffle 132")
    return lines


def capped_cluster_cases(pass_, t, p):
    """(case line, blocks of its clustered launch): chunked rows on a device of 4
    multiprocessors of 2 blocks (a grid of 8 blocks: 4 clusters of 2, or 2 of 4) that holds
    only one or three clusters at once. The launch keeps to that many clusters (its grid is
    persistent); in the backward, the parameter gradients' partial rows follow that grid."""
    big = largest_row(pass_, t, True)
    vec = 16 // SIZE[t]
    return [(f"{pass_} {t} {p} {rows} {n} {AFFINE[i % len(AFFINE)]} 0 0 "
             f"{ORDERS[i % len(ORDERS)]} 4 clusters={k}", blocks)
            for i, (rows, n, k, blocks) in enumerate([(9, 2 * big, 1, 2), (13, 2 * big, 3, 6),
                                                      (7, 4 * big - vec, 1, 4)])]


def check_ok_with_cluster_launches(binary, cases):
    """Runs (case line, expected clustered launches) pairs: every case passes and made the
    clustered launches expected of it (so each is known to have taken its path)."""
    code, out, err = run_cases(binary, [line for line, _ in cases])
    results = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    failures = [line for line in results if line.startswith("FAIL")]
    assert code == 0 and not failures, f"exit {code}:\n" + "\n".join(failures) + "\n" + err[-3000:]
    assert len(results) == len(cases)
    for (line, clustered), result in zip(cases, results):
        assert result.startswith(f"ok {line} |") and result.endswith(f"clustered {clustered}"), (line, result)


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_cluster_long_rows(harness, pass_, t, p):
    """Rows of 2 to 8 chunks held by the blocks of a thread-block cluster (sm_90's path), in
    one launch, against float64; 9 chunks (more than a portable cluster) and launches
    without clusters take the chunked three-launch path."""
    check_ok_with_cluster_launches(harness, cluster_cases(pass_, t, p))
    capped = capped_cluster_cases(pass_, t, p)
    code, out, err = run_cases(harness, [line for line, _ in capped])
    results = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert code == 0 and len(results) == len(capped), f"exit {code}:\n{out}\n{err[-3000:]}"
    for (line, blocks), result in zip(capped, results):
        assert result.startswith(f"ok {line} |"), result
        assert result.endswith(f"cluster-blocks {blocks} clustered 1"), result


# The norm family's other variants, as harness flags: RMSNorm, LayerNorm with a residual
# (forward: the sum output; backward: grad_sum), RMSNorm with a residual.
VARIANTS = ["rms", "res", "rms res"]


def variant_affine(variant, i):
    """Parameter cases that the variant allows (RMSNorm has no bias)."""
    return ["w", "none"][i % 2] if "rms" in variant else AFFINE[i % len(AFFINE)]


def family_cases(pass_, t, p, variant):
    """A bucket of each size class and one past it, the largest bucket's chunked rows (fwd:
    8193 packs or elements; bwd: both too), the one-element path, a misaligned x/dy, and
    (with a residual) a residual / grad_sum misaligned alone, which must take one-element
    packs."""
    vec = 16 // SIZE[t]
    sizes = [(packs * vec, 0, "") for packs in (1, 3, 33, 129, 513, 2049, 8193)]
    sizes += [(n, 0, "") for n in (7, 129, 2049, 8193)]
    sizes += [(100 * vec, SIZE[t], "")]
    if "res" in variant:
        # (and the 16-bit LayerNorm grad_sum table's buckets of 2 packs at 64 and 256
        # threads per row, which the sizes above skip)
        sizes += [(65 * vec, 0, ""), (257 * vec, 0, "")]
        sizes += [(64 * vec, 0, "resmis"), (96 * vec, SIZE[t], "resmis")]
    lines = []
    for i, (n, x_mis, extra) in enumerate(sizes):
        flags = variant if not extra else variant.replace("res", extra)
        lines.append(f"{pass_} {t} {p} {rows_for(n)} {n} {variant_affine(variant, i)} {x_mis} 0 "
                     f"{ORDERS[i % len(ORDERS)]} 2 {flags}")
    lines.append(f"{pass_} {t} {p} 9 {vec * 96} {variant_affine(variant, 1)} 0 0 shuffle 132 {variant}")
    return lines


def check_all_ok(binary, lines):
    code, out, err = run_cases(binary, lines)
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 0 and not failures, (
        f"exit {code}; {len(failures)} failed:\n" + "\n".join(failures[:10]) + "\n" + err[-3000:]
    )
    assert sum(line.startswith("ok ") for line in out.splitlines()) == len(lines)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_norm_family_kernels(harness, pass_, t, p, variant):
    """RMSNorm and the residual variants against float64 (the sum output exactly)."""
    check_all_ok(harness, family_cases(pass_, t, p, variant))


@pytest.mark.parametrize("variant", ["rms res", "res"])
@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_norm_family_cluster_long_rows(harness, pass_, t, p, variant):
    """The clustered and three-launch long-row paths of RMSNorm and of the residual add (the
    merge kernel recomputes the row's first sum for LayerNorm's shift)."""
    cases = []
    # LayerNorm's 16-bit backward with a grad_sum takes its own table of 16-byte buckets
    # (BwdVecBucketsGradSum16), of half the capacity: its rows are cut at other lengths.
    base = cluster_cases(pass_, t, p, ln_grad_sum=variant == "res")
    for i, (line, clustered) in enumerate(base):
        tokens = line.split()
        tokens[5] = variant_affine(variant, i)
        cases.append((" ".join(tokens) + " " + variant, clustered))
    check_ok_with_cluster_launches(harness, cases)


@pytest.mark.parametrize("variant", ["", "rms", "res", "rms res"])
@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_backward_with_a_frozen_weight(harness, t, p, variant):
    """A frozen weight (norm_bwd's param_grads): dy scaled by it, its gradient not asked for
    (a null dweight), alone or beside dbias, which then fills the partial rows' first
    columns; every bucket, the one-element path, chunked rows and the clustered launch."""
    frozen = ["F"] if "rms" in variant else ["F", "Fb"]
    lines = list(family_cases("bwd", t, p, variant))
    lines += [line + " " + variant for line, _ in cluster_cases("bwd", t, p, ln_grad_sum=variant == "res")]
    for i, line in enumerate(lines):
        tokens = line.split()
        tokens[5] = frozen[i % len(frozen)]
        lines[i] = " ".join(tokens)
    check_all_ok(harness, lines)


# A float32 residual stream (residual_dtype) beside 16-bit inputs: the float kernels with
# 16-bit x, y and dy (the harness's `wide`); the residual, sum, backward x, grad_sum and dx
# float32. Its buckets are float32's.
WIDE_PAIRS = [("f16", "f32"), ("bf16", "f32")]


@pytest.mark.parametrize("variant", ["res wide", "rms res wide"])
@pytest.mark.parametrize("t, p", WIDE_PAIRS, ids=[f"{t}-{p}" for t, p in WIDE_PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_float32_residual_stream(harness, pass_, t, p, variant):
    """Every path (16-byte and one-element buckets, a misaligned residual, chunked rows, the
    clustered launch) of the float32 sum beside 16-bit inputs against float64, the sum
    exactly; the forward also with a residual of the input's dtype (read as such), the
    backward also without a grad_sum (only the output's gradient)."""
    lines = family_cases(pass_, t, p, variant)
    if pass_ == "bwd":
        lines += [line.replace(" res wide", " wide") for line in lines[:4]]
    else:  # a residual of the input's 16-bit dtype (the first layer's), read as such
        lines += family_cases(pass_, t, p, variant + " narrow")
    check_all_ok(harness, lines)
    big = largest_row(pass_, "f32", True)
    flags = [variant] + ([variant + " narrow"] if pass_ == "fwd" else [])
    check_ok_with_cluster_launches(
        harness, [(f"{pass_} {t} {p} 3 {2 * big} w 0 0 shuffle 2 clusters {f}", 1) for f in flags])


def outlier_cases(t, p, extra_kind="outlier"):
    """(case line, expected clustered launches) of LayerNorm forwards whose rows each have
    one of their first three values 1000 times the row's scale from the rest (which one
    varies by row; "outliers": two of them, so that the statistics' shift is one): the
    16-byte and one-element paths, the chunked three-launch path (its merge kernel finds the
    shift again) and the clustered one, with and without a residual."""
    vec = 16 // SIZE[t]
    big = largest_row("fwd", t, True)
    sizes = [(256 * vec, "", 0), (1000 * vec, "", 0), (4095, "", 0), (2 * big, "", 0),
             (2 * big, " clusters", 1), (2 * largest_row("fwd", t, False) + 1, " clusters", 1),
             (512 * vec, " res", 0),
             (2 * big, " res", 0)]
    return [(f"fwd {t} {p} {rows_for(n)} {n} {AFFINE[i % len(AFFINE)]} 0 0 "
             f"{ORDERS[i % len(ORDERS)]} 2{extra} {extra_kind}", clustered)
            for i, (n, extra, clustered) in enumerate(sizes)]


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_layer_norm_outlier_first_values(harness, t, p):
    """A feature far from the others among a row's first three values: the statistics'
    shift (their median) and y = ((x - mean) - rest) * rstd keep y within 16 units of the
    accumulator's rounding of float64. Shifting by the first value alone lost about sqrt(N)
    units in every output (float32 and float64 failed here before)."""
    cases = outlier_cases(t, p)
    check_ok_with_cluster_launches(harness, cases)


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_layer_norm_shift_among_outliers(harness, t, p):
    """Two features far from the others among a row's first three values, so that the
    statistics' shift (their median) sits 1000 times the row's scale from its mean: the
    statistics within the usual bound of float64 (the forward's shifted sums, where a GPU
    variant takes them, pass over such a row twice)."""
    check_ok_with_cluster_launches(harness, outlier_cases(t, p, "outliers"))


def far_cases(pass_, t, p):
    """(case line, expected clustered launches) of LayerNorm rows far from zero (two rows of
    every three 1e4 times their scale, 16-bit 100 times; the third near zero): a warp per
    row, two rows of two warps per block (a row corrected beside one not), many warps per
    row, one-element packs, a misaligned view, and long rows chunked in three launches or
    in one clustered launch."""
    vec = 16 // SIZE[t]
    big = largest_row(pass_, t, True)
    sizes = [(32 * vec, 0, "", 0), (256 * vec, 0, "", 0), (1024 * vec, 0, "", 0),
             (4095, 0, "", 0), (300 * vec, SIZE[t], "", 0), (2 * big, 0, "", 0),
             (2 * big, 0, " clusters", 1),
             (2 * largest_row(pass_, t, False) + 1, 0, " clusters", 1)]
    # With a weight in every case: dweight shows an uncorrected xhat at once.
    return [(f"{pass_} {t} {p} {rows_for(n)} {n} {('wb', 'w')[i % 2]} {x_mis} 0 "
             f"{ORDERS[i % len(ORDERS)]} 2{extra} far", clustered)
            for i, (n, x_mis, extra, clustered) in enumerate(sizes)]


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_layer_norm_far_from_zero(harness, pass_, t, p):
    """Rows far from zero against float64 with the exact mean: the backward subtracts the
    mean of its xhat (the saved float mean's rounding, up to 4.9e-4 of sigma at 1e4) where
    needs_mean_correction, in every path; without that, float32 and float64 fail here. The
    forward keeps the mean's rest."""
    check_ok_with_cluster_launches(harness, far_cases(pass_, t, p))


def huge_cases(t, p):
    """(case line, expected clustered launches) of forward rows whose statistics overflow
    the accumulator (every other row holds one value of 1e20, float64 1e160): LayerNorm,
    RMSNorm and the residual, a warp per row, many warps per row, one-element packs, and
    long rows chunked in three launches (the merge kernel's rstd) or one clustered launch."""
    vec = 16 // SIZE[t]
    big = largest_row("fwd", t, True)
    sizes = [(32 * vec, "", 0), (1024 * vec, "", 0), (4095, "", 0), (2 * big + vec, "", 0),
             (2 * big, " clusters", 1)]
    kinds = [("wb", ""), ("w", " rms"), ("wb", " res"), ("none", " rms res")]
    return [(f"fwd {t} {p} {rows_for(n)} {n} {affine} 0 0 {ORDERS[i % len(ORDERS)]} 2{extra}"
             f"{kind} huge", clustered)
            for i, (n, extra, clustered) in enumerate(sizes) for affine, kind in kinds]


# float16 input cannot overflow a float32 sum of squares (65504^2 * N < 3.4e38).
@pytest.mark.parametrize("t, p", [pair for pair in PAIRS if pair[0] != "f16"],
                         ids=[f"{t}-{p}" for t, p in PAIRS if t != "f16"])
def test_emulated_forward_rows_whose_statistics_overflow(harness, t, p):
    """A row whose variance (or mean square) overflows the accumulator gives rstd and every
    y NaN, in every path, where 1 / sqrt(inf) = 0 would have made each y 0 (or the bias):
    a wrong answer nothing flags. Its neighbours are unaffected."""
    check_ok_with_cluster_launches(harness, huge_cases(t, p))


@pytest.mark.parametrize("t, p", [("f32", "f32"), ("bf16", "f32"), ("f64", "f64")])
@pytest.mark.parametrize("eps", ["inf", "1e39"])
def test_emulated_forward_with_an_eps_past_the_accumulator(harness, t, p, eps):
    """An eps that overflows the accumulator (inf; 1e39 in float32): rstd = 1 / sqrt(inf) = 0
    and y the bias, as PyTorch's, not the NaN of a row whose own statistics overflow."""
    if t == "f64" and eps == "1e39":
        pytest.skip("1e39 is in float64's range")
    cases = [(line.replace(" huge", f" eps={eps}"), clustered)
             for line, clustered in huge_cases(t, p)]
    check_ok_with_cluster_launches(harness, cases)


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_forward_one_block_per_multiprocessor(harness, t, p):
    """The forward's launch where a multiprocessor holds one of its blocks (the buckets of
    1024 threads on a GPU): one wave of blocks, each looping over row groups, rather than a
    block per row group (fwd_rows_grid), in every path, RMSNorm and the residual too."""
    lines = cases_for("fwd", t, p) + [line for v in VARIANTS for line in family_cases("fwd", t, p, v)]
    lines += [line for line, _ in dropout_cases(t, p, "res")]
    check_all_ok(harness, [line + " lone" for line in lines])


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_emulated_layer_norm_kernels(harness, pass_, t, p):
    lines = cases_for(pass_, t, p)
    code, out, err = run_cases(harness, lines)
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 0 and not failures, (
        f"exit {code}; {len(failures)} failed:\n" + "\n".join(failures[:10]) + "\n" + err[-3000:]
    )
    assert sum(line.startswith("ok ") for line in out.splitlines()) == len(lines)


def test_emulation_catches_a_missing_barrier(tmp_path):
    """The harness can fail: the same kernels without the barrier of the row sums (row_sums,
    csrc copied and edited) give wrong results in the emulation."""
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(REPO, "csrc"), csrc)
    kernels = csrc / "cuda" / "norm_kernels.cuh"
    text = kernels.read_text()
    stores = "      for (int k = 0; k < K; ++k) red[K * warp + k] = v[k];\n    }\n"
    barrier = stores + "    __syncthreads();\n"
    assert text.count(barrier) == 1, "the row reduction's barrier moved: update this test"
    kernels.write_text(text.replace(barrier, stores))
    binary = build_harness(str(tmp_path), csrc=str(csrc), only_float=True)
    code, out, _ = run_cases(binary, ["fwd f32 f32 5 1000 wb 0 0 asc"])
    assert code != 0 and "FAIL fwd f32 f32 5 1000" in out, out


def test_emulation_catches_a_misaligned_vector_access(harness, tmp_path):
    """A 16-byte access at a misaligned address aborts the emulation (as it faults on a GPU):
    the dispatch is edited to take the vector path for a misaligned x."""
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(REPO, "csrc"), csrc)
    kernels = csrc / "cuda" / "norm_kernels.cuh"
    text = kernels.read_text()
    check = "a.N % kVec<T> == 0 && is_16b_aligned(a.x) && is_16b_aligned(a.y)"
    assert check in text, "the forward's alignment dispatch moved: update this test"
    kernels.write_text(text.replace(check, "a.N % kVec<T> == 0 && is_16b_aligned(a.y)"))
    binary = build_harness(str(tmp_path), csrc=str(csrc), only_float=True)
    code, _, err = run_cases(binary, ["fwd f32 f32 5 1000 wb 4 0 asc"])
    assert code != 0 and "misaligned 16-byte access" in err, err[-2000:]


@pytest.mark.parametrize("t, p", [("f64", "f64"), ("f32", "f32")])
def test_emulated_layer_norm_more_chunks_than_a_warp(harness, t, p):
    """Rows of 34 chunks, the three-launch path: a lane of the statistics' merge kernel
    (layer_norm_merge_stats_kernel) then merges two chunks' summaries (WelfordState::merge,
    Chan's formula), which rows of up to 32 chunks never reach."""
    n = 33 * largest_row("fwd", t, True) + 16 // SIZE[t]
    lines = [f"fwd {t} {p} 2 {n} wb 0 0 asc 2"]
    code, out, err = run_cases(harness, lines)
    results = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert code == 0 and len(results) == 1 and results[0].startswith("ok "), (
        f"exit {code}:\n{out[-2000:]}\n{err[-2000:]}")


# Dropout and rowscale in the forward with a residual (add_layer_norm / add_rms_norm:
# norm_fwd_dropout_cuda), as harness flags: dropout_p, a rowscale, rowscale alone (p = 0: no
# draws), the generator's state as a CUDA graph capture leaves it (pointers), and a p > 0
# whose threshold rounds to 0 (no draws, rng_state still written).
DROPOUT_FLAGS = ["drop=0.1", "drop=0.5 rowscale", "drop=1 rowscale", "rowscale",
                 "drop=0.5 captured", "drop=1e-12"]


def dropout_cases(t, p, variant):
    """(case line, expected clustered launches) of forwards with multipliers: buckets of
    several sizes in 16-byte packs, odd rows (one-element packs), a misaligned x, a residual
    misaligned alone, and long rows chunked in three launches or held by a cluster, each
    flag set of DROPOUT_FLAGS in turn. The sum must be exact: one rounding of x * m in the
    accumulator, then of + residual, with the mask from common/philox.h's rule."""
    vec = 16 // SIZE[t]
    sizes = [(packs * vec, 0, "", 0, None) for packs in (1, 3, 33, 129, 2049)]
    sizes += [(n, 0, "", 0, None) for n in (7, 129, 2049)]
    sizes += [(100 * vec, SIZE[t], "", 0, None), (64 * vec, 0, "resmis", 0, "drop=0.5 rowscale")]
    # Long rows each with a mask drawn (the three-launch path draws it in two launches).
    for vectorized, flags in ((True, ("drop=0.5 rowscale", "drop=0.1 captured")),
                              (False, ("drop=0.1", "drop=0.5 rowscale"))):
        big = largest_row("fwd", t, vectorized, dropout=True)
        two = 2 * big if vectorized else 2 * big + 1
        sizes += [(two, 0, " clusters", 1, flags[0]), (two, 0, "", 0, flags[1])]
    cases = []
    for i, (n, x_mis, extra, clustered, drop) in enumerate(sizes):
        flags = variant.replace("res", "resmis") if extra == "resmis" else variant
        flags += extra if extra != "resmis" else ""
        drop = drop or DROPOUT_FLAGS[i % len(DROPOUT_FLAGS)]
        cases.append((f"fwd {t} {p} {rows_for(n)} {n} {variant_affine(variant, i)} {x_mis} 0 "
                      f"{ORDERS[i % len(ORDERS)]} 2 {flags} {drop}", clustered))
    return cases


@pytest.mark.parametrize("variant", ["res", "rms res"])
@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_dropout_forward(harness, t, p, variant):
    """s = dropout(x) * rowscale + residual, then the norm, in every forward path, against
    float64 (the sum exactly), with rng_state checked to hold the (seed, offset) drawn with."""
    check_ok_with_cluster_launches(harness, dropout_cases(t, p, variant))


@pytest.mark.parametrize("variant", ["res wide", "rms res wide", "res wide narrow"])
@pytest.mark.parametrize("t, p", WIDE_PAIRS, ids=[f"{t}-{p}" for t, p in WIDE_PAIRS])
def test_emulated_dropout_float32_residual_stream(harness, t, p, variant):
    """The same for a float32 sum beside 16-bit inputs (residual_dtype; narrow: a residual of
    the input's dtype): x * m and the add in float32."""
    cases = dropout_cases(t, p, variant)
    big = largest_row("fwd", "f32", True)
    cases = [case for case in cases if f" {2 * largest_row('fwd', t, True)} " not in case[0]]
    cases += [(f"fwd {t} {p} 3 {2 * big} w 0 0 shuffle 2 clusters {variant} drop=0.5 rowscale", 1),
              (f"fwd {t} {p} 3 {2 * big} w 0 0 desc 2 {variant} drop=0.1", 0)]
    check_ok_with_cluster_launches(harness, cases)


# dropout_scale: (out dtype, grad dtype), grad of out's dtype or float32 beside 16-bit.
DSCALE_PAIRS = [("f32", "f32"), ("f64", "f64"), ("f16", "f16"), ("f16", "f32"),
                ("bf16", "bf16"), ("bf16", "f32")]


@pytest.mark.parametrize("o, g", DSCALE_PAIRS, ids=[f"{o}-{g}" for o, g in DSCALE_PAIRS])
def test_emulated_dropout_scale(harness, o, g):
    """dropout_scale's kernel (grad * m, a thread per quad of flat indices): rows shorter than
    a quad and odd lengths (quads across rows), aligned and misaligned grad / out, a grid
    that strides (132 multiprocessors of work on 2), every flag set; exact against the rule."""
    lines = []
    for i, (m, n, g_mis, o_mis, sms) in enumerate([
            (5, 1, 0, 0, 2), (7, 3, 0, 0, 2), (9, 7, SIZE[g], 0, 2), (3, 64, 0, 0, 2),
            (37, 1000, 0, 0, 2), (5, 4097, 0, SIZE[o], 132), (301, 129, 0, 0, 2),
            (2, 2, 0, 0, 2)]):
        flags = DROPOUT_FLAGS[i % len(DROPOUT_FLAGS)].replace(" captured", "")
        lines.append(f"dscale {o} {g} {m} {n} none {g_mis} {o_mis} {ORDERS[i % 3]} {sms} {flags}")
    check_all_ok(harness, lines)


# The backward that also writes the add ops' input gradient (norm_bwd_input_grad_cuda: the
# harness's `xgrad`): dx times the forward's multipliers, rounded once to the input's dtype,
# exact against the host's value from the dx the kernels wrote.
XGRAD_FLAGS = ["xgrad drop=0.1", "xgrad drop=0.5 rowscale", "xgrad rowscale", "xgrad drop=1",
               "xgrad drop=1e-12"]


def xgrad_cases(t, p, variant, flags=XGRAD_FLAGS):
    """(case line, expected clustered launches): every backward path of family_cases
    (buckets, one-element packs, a misaligned dy, a grad_sum misaligned alone, chunked rows in
    three launches) and the clustered long rows of cluster_cases, each with a flag set in
    turn. Rows are cut by the buckets of the sum's type (float32's for `wide`); 16-bit
    LayerNorm's input-gradient kernels take the grad_sum table, with or without one."""
    cases = [(f"{line} {flags[i % len(flags)]}", 0)
             for i, line in enumerate(family_cases("bwd", t, p, variant))]
    sum_t = "f32" if "wide" in variant else t
    long_rows = cluster_cases("bwd", sum_t, p, ln_grad_sum="rms" not in variant)
    for i, (line, clustered) in enumerate(long_rows):
        if clustered:
            tokens = line.split()
            tokens[1], tokens[5] = t, variant_affine(variant, i)
            cases.append((" ".join(tokens) + f" {variant} {flags[i % len(flags)]}", clustered))
    return cases


@pytest.mark.parametrize("variant", ["res", "rms res", ""])
@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_backward_input_grad_dropout(harness, t, p, variant):
    """dropout / rowscale: the input gradient in every backward path, with a grad_sum
    (LayerNorm, RMSNorm) and without one (LayerNorm)."""
    check_ok_with_cluster_launches(harness, xgrad_cases(t, p, variant))


@pytest.mark.parametrize("variant", ["res wide", "rms res wide", "wide"])
@pytest.mark.parametrize("t, p", WIDE_PAIRS, ids=[f"{t}-{p}" for t, p in WIDE_PAIRS])
def test_emulated_backward_input_grad_float32_sum(harness, t, p, variant):
    """A float32 sum beside 16-bit inputs: the input gradient dx rounded to 16 bits (no
    multipliers), and with dropout / rowscale, in every backward path."""
    check_ok_with_cluster_launches(
        harness, xgrad_cases(t, p, variant, ["xgrad", "xgrad drop=0.5 rowscale"]))


def _edited_harness(tmp_path_factory, name, edits):
    """The harness built on a copy of csrc/ with the CUDA A/B tool's edits made (each must
    change its file)."""
    from benchmarks.cuda_ab.variants import apply_edits

    csrc = tmp_path_factory.mktemp(name) / "csrc"
    shutil.copytree(os.path.join(REPO, "csrc"), csrc)
    files = {e.path: (csrc / e.path).read_text() for e in edits}
    for path, text in apply_edits(files, edits).items():
        assert text != files[path]
        (csrc / path).write_text(text)
    return build_harness(CACHE, csrc=str(csrc))


@pytest.fixture(scope="module")
def row_state_harness(tmp_path_factory):
    """The harness with norm_config.cuh's kBwdSharedSums and kBwdNextRow on for every
    one-row backward kernel (production: float's clustered rows only), the tree the CUDA A/B
    tool's add_bwd_long_rows variants start from, so that what a GPU times is what passed
    here."""
    sys.path.insert(0, REPO)
    from benchmarks.cuda_ab.variants import BWD_ROW_STATE_EVERYWHERE

    return _edited_harness(tmp_path_factory, "row_state", BWD_ROW_STATE_EVERYWHERE)


@pytest.fixture(scope="module")
def shifted_sums_harness(tmp_path_factory):
    """The harness with norm_config.cuh's kFwdShiftedSums on for 16-bit inputs (production:
    off), the CUDA A/B tool's fwd16_shifted_sums variant."""
    sys.path.insert(0, REPO)
    from benchmarks.cuda_ab.variants import QUESTIONS

    edits = QUESTIONS["fwd16_shifted_sums"].variants["shifted_sums"]
    return _edited_harness(tmp_path_factory, "shifted_sums", edits)


SIXTEEN_BIT_PAIRS = [(t, p) for t, p in PAIRS if SIZE[t] == 2]


@pytest.mark.parametrize("t, p", SIXTEEN_BIT_PAIRS, ids=[f"{t}-{p}" for t, p in SIXTEEN_BIT_PAIRS])
def test_emulated_forward_shifted_sums(shifted_sums_harness, t, p):
    """The 16-bit LayerNorm forward with its statistics from shifted sums, in every path
    (buckets, one-element packs, misaligned views, chunked and clustered rows, the residual
    variants, rows far from zero, dropout), and rows whose shift sits among outliers, which
    take its second pass (without that pass they fail here)."""
    check_all_ok(shifted_sums_harness,
                 cases_for("fwd", t, p)
                 + [line for v in VARIANTS for line in family_cases("fwd", t, p, v)])
    check_ok_with_cluster_launches(
        shifted_sums_harness, cluster_cases("fwd", t, p) + far_cases("fwd", t, p)
        + outlier_cases(t, p) + outlier_cases(t, p, "outliers") + dropout_cases(t, p, "res"))


@pytest.fixture(scope="module")
def fwd_staged_rows_harness(tmp_path_factory):
    """The harness with norm_config.cuh's kFwdStagedRow on for the forward kernels of 4096
    packs and more (production: off), the CUDA A/B tool's fwd_staged_rows variant of the
    widest reach: the next row's x copied by cp.async, landed by the emulator only at the
    wait that covers it."""
    sys.path.insert(0, REPO)
    from benchmarks.cuda_ab.variants import QUESTIONS

    edits = QUESTIONS["fwd_staged_rows"].variants["from_4096_packs"]
    return _edited_harness(tmp_path_factory, "fwd_staged_rows", edits)


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_forward_staged_rows(fwd_staged_rows_harness, t, p):
    """The forward with the next row's x staged in shared memory, in every path (buckets,
    one-element packs, misaligned views, chunked rows in three launches, clustered rows, the
    residual variants, rows far from zero, dropout, which keeps its loads)."""
    check_all_ok(fwd_staged_rows_harness,
                 cases_for("fwd", t, p)
                 + [line for v in VARIANTS for line in family_cases("fwd", t, p, v)])
    check_ok_with_cluster_launches(
        fwd_staged_rows_harness, cluster_cases("fwd", t, p) + far_cases("fwd", t, p)
        + dropout_cases(t, p, "res"))


def check_every_backward_path(harness, t, p):
    """The backward's cases in every path on a variant's harness: buckets, one-element packs,
    misaligned views, chunked and clustered rows, RMSNorm and grad_sum, rows far from zero,
    the input gradient with dropout."""
    check_all_ok(harness,
                 cases_for("bwd", t, p)
                 + [line for v in VARIANTS for line in family_cases("bwd", t, p, v)])
    check_ok_with_cluster_launches(
        harness, cluster_cases("bwd", t, p) + far_cases("bwd", t, p)
        + xgrad_cases(t, p, "res", ["xgrad drop=0.5 rowscale"]))


@pytest.mark.parametrize("t, p", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_emulated_backward_row_state_in_shared_memory(row_state_harness, t, p):
    """The backward with its column sums in shared memory and the next row loaded ahead, in
    every path."""
    check_every_backward_path(row_state_harness, t, p)


@pytest.fixture(scope="module")
def staged_rows_harness(tmp_path_factory):
    """The harness with norm_config.cuh's kBwdStagedRow on for the 16-bit one-row backward
    kernels (production: off), the CUDA A/B tool's bwd16_staged_rows variant: the next row's
    x and dy copied by cp.async, which the emulator lands only at the wait that covers it
    (a wait one group short failed 24 cases)."""
    sys.path.insert(0, REPO)
    from benchmarks.cuda_ab.variants import QUESTIONS

    edits = QUESTIONS["bwd16_staged_rows"].variants["staged"]
    return _edited_harness(tmp_path_factory, "staged_rows", edits)


@pytest.mark.parametrize("t, p", SIXTEEN_BIT_PAIRS, ids=[f"{t}-{p}" for t, p in SIXTEEN_BIT_PAIRS])
def test_emulated_backward_staged_rows(staged_rows_harness, t, p):
    """The 16-bit backward with the next row staged in shared memory, in every path."""
    check_every_backward_path(staged_rows_harness, t, p)


# ---- the GELU-FFN's kernels (tests/emulation/gelu_ffn_emulated.cpp) ----------------------

@pytest.fixture(scope="module")
def gelu_harness():
    return build_harness(CACHE, program="gelu_ffn_emulated")


def gelu_ffn_cases(t, kind):
    """(case line, expected launches, expected 16-byte path) for every path of the gelu
    pass, the dgelu pass (with and without db1) and the column sum: 16-byte packs and one
    element (odd widths, lengths not a multiple of the pack, h / a / dg / x one element off
    16-byte alignment), row counts that leave the last slab and the last row step partial,
    columns that leave the last block partial, a grid smaller than the work (1
    multiprocessor: the gelu and slab-sum kernels stride), one element."""
    vec, e = 16 // SIZE[t], SIZE[t]
    cases = []
    # gelu: packs may cross rows, so only M * N and the two pointers choose the path.
    for m, n, m1, m2, sms in [(7, 33, 0, 0, 2), (vec, 3, 0, 0, 2), (33, 128 * vec, 0, 0, 1),
                              (5, 8 * vec, e, 0, 2), (5, 8 * vec, 0, e, 2), (1, 1, 0, 0, 2),
                              (129, 255, 0, 0, 1)]:
        cases.append((f"gelu {t} {kind} {m} {n} {m1} {m2}", 1, (m * n) % vec == 0 and m1 == m2 == 0, sms))
    # dgelu: rows of N, packs when N and both pointers allow them.
    for m, n, m1, m2, sms, flag in [(1001, 40 * vec, 0, 0, 2, ""), (1001, 101, 0, 0, 2, ""),
                                    (37, 2 * vec, 0, 0, 2, ""), (300, 64 * vec, e, 0, 2, ""),
                                    (300, 64 * vec, 0, e, 2, ""), (129, 5125, 0, 0, 1, ""),
                                    (65, 8 * vec, 0, 0, 2, " nobias"), (67, 33, 0, 0, 2, " nobias"),
                                    (2, 1, 0, 0, 2, ""), (2049, 3 * vec, 0, 0, 132, "")]:
        cases.append((f"dgelu {t} {kind} {m} {n} {m1} {m2}", 1 if flag else 2,
                      n % vec == 0 and m1 == m2 == 0, sms, flag))
    if kind == "none":  # (the column sum takes no GELU)
        for m, n, m1, sms in [(2001, 3 * vec, 0, 2), (130, 7, 0, 2), (64, 16 * vec, e, 2),
                              (33, 4099, 0, 1), (1, 2 * vec, 0, 2)]:
            cases.append((f"colsum {t} {kind} {m} {n} {m1} 0", 2, n % vec == 0 and m1 == 0, sms))
    lines = []
    for i, case in enumerate(cases):
        head, launches, vectorized, sms = case[:4]
        flag = case[4] if len(case) > 4 else ""
        lines.append((f"{head} {ORDERS[i % len(ORDERS)]} {sms}{flag}", launches, vectorized))
    return lines


def check_gelu_ffn_cases(binary, cases):
    code, out, err = run_cases(binary, [line for line, _, _ in cases])
    results = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    failures = [line for line in results if line.startswith("FAIL")]
    assert code == 0 and not failures, f"exit {code}:\n" + "\n".join(failures) + "\n" + err[-3000:]
    assert len(results) == len(cases)
    for (line, launches, vectorized), result in zip(cases, results):
        # each case took the path it tests: its launches, and 16-byte packs or single elements
        assert result == f"ok {line} | launches {launches} vec {int(vectorized)}", (line, result)


GELU_KINDS = ["none", "tanh"]
GELU_DTYPES = ["f32", "f64", "f16", "bf16"]


@pytest.mark.parametrize("kind", GELU_KINDS)
@pytest.mark.parametrize("t", GELU_DTYPES)
def test_emulated_gelu_ffn_kernels(gelu_harness, t, kind):
    """The GELU-FFN's gelu pass (a = gelu(h)), dgelu pass (dh = dg * gelu'(h) over dg, db1
    = its column sums; h left as it was) and column sum (db2) against long double, in
    every path, with both GELU forms."""
    check_gelu_ffn_cases(gelu_harness, gelu_ffn_cases(t, kind))


def test_emulation_catches_a_missing_barrier_in_the_gelu_ffn_slabs(tmp_path):
    """The GELU-FFN harness can fail: column_slab_kernel without the barrier between the
    threads' sums and the block's sum of them gives a wrong db1 (csrc copied and edited)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(REPO, "csrc"), csrc)
    kernels = csrc / "cuda" / "gelu_ffn_kernels.cuh"
    text = kernels.read_text()
    barrier = "block_sums[threadIdx.y][threadIdx.x * kVec + j] = sum[j];\n    __syncthreads();\n"
    assert text.count(barrier) == 1, "the slab reduction's barrier moved: update this test"
    kernels.write_text(text.replace(barrier, barrier.replace("    __syncthreads();\n", "")))
    binary = build_harness(str(tmp_path), csrc=str(csrc), only_float=True, program="gelu_ffn_emulated")
    code, out, _ = run_cases(binary, ["dgelu f32 none 1001 40 0 0 asc 2"])
    assert code != 0 and "FAIL dgelu f32 none 1001 40" in out and "db1" in out, out
