"""Static checks of the compiled CUDA kernels' machine code, run without a GPU (select them
with `pytest -k sass`): the LayerNorm kernels' global stores are 16 bytes wide where their
data is, no kernel spills to local memory, and every kernel's registers allow the block
size it is launched with. They read the library the tests import, for every arch it holds.

Skipped (with the reason) only when fusednorm was built without CUDA kernels or cuobjdump is
nowhere; with FUSEDNORM_REQUIRE_SASS=1 (set by CI) those are failures instead.
"""
from __future__ import annotations

import functools
import os

import pytest

import fusednorm
from sass_inspect import (
    extension_path,
    find_tool,
    launch_block,
    read_kernels,
    registers_fit,
    row_kernel,
)

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _unavailable() -> str | None:
    if not fusednorm.build_info().get("cuda_kernels"):
        return "fusednorm was built without its CUDA kernels"
    if find_tool("cuobjdump") is None:
        return "cuobjdump not found (CUDA toolkit or the triton wheel)"
    if extension_path() is None:
        return "the compiled fusednorm._C library was not found"
    return None


@functools.lru_cache(maxsize=1)
def kernels():
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("FUSEDNORM_REQUIRE_SASS") == "1":
            pytest.fail(f"FUSEDNORM_REQUIRE_SASS=1 but {reason}")
        pytest.skip(reason)
    return read_kernels(extension_path(), find_tool("cuobjdump"))


def row_kernels():
    """Every norm row kernel, the forwards with dropout (rk.dropout) included."""
    found = [(k, row_kernel(k.name, dropout=True)) for k in kernels().values()]
    return [(k, rk) for k, rk in found if rk is not None]


def test_sass_inventory_has_every_row_kernel_path():
    """The parse found sm_ cubins and, per arch, both passes of every dtype in both layouts,
    with and without clusters, for LayerNorm and RMSNorm (centered or not): the other checks
    cannot pass by finding nothing."""
    found = {}
    for k, rk in row_kernels():
        if rk.dropout or rk.input_grad:
            continue
        found.setdefault(k.arch, set()).add(
            (rk.direction, rk.dtype, rk.vectorized, rk.cluster, rk.centered))
    assert found, "no norm row kernels in the library's SASS"
    for arch, paths in found.items():
        missing = {
            (d, t, v, c, centered)
            for d in ("fwd", "bwd")
            for t in DTYPES
            for v in (True, False)
            for c in (True, False)
            for centered in (True, False)
        } - paths
        assert not missing, f"{arch}: no SASS for {sorted(missing)}"
    # The float32 residual stream's kernels: float math, 16-bit x, y and dy.
    wide = {(rk.direction, rk.io, rk.vectorized) for k, rk in row_kernels()
            if rk.io != rk.dtype and not rk.input_grad}
    assert wide == {(d, io, v) for d in ("fwd", "bwd") for io in ("float16", "bfloat16")
                    for v in (True, False)}, sorted(wide)
    assert all(sum(k.ops.values()) > 0 for k, _ in row_kernels()), "kernels without instructions"


def test_sass_inventory_has_every_dropout_forward_path():
    """The forwards with dropout / rowscale (norm_fwd_dropout_kernel): every dtype and the
    float32 sum beside 16-bit inputs, both layouts, with and without clusters, LayerNorm and
    RMSNorm; and LayerNorm's merge kernel of their chunked rows."""
    found = {}
    for k, rk in row_kernels():
        if rk.dropout:
            found.setdefault(k.arch, set()).add((rk.dtype, rk.io, rk.vectorized, rk.cluster,
                                                 rk.centered))
    assert found, "no dropout forward kernels in the library's SASS"
    ios = {(t, t) for t in DTYPES} | {("float32", "float16"), ("float32", "bfloat16")}
    for arch, paths in found.items():
        missing = {(t, io, v, c, centered) for t, io in ios for v in (True, False)
                   for c in (True, False) for centered in (True, False)} - paths
        assert not missing, f"{arch}: no dropout SASS for {sorted(missing)}"
        merges = [k for k in kernels().values()
                  if k.arch == arch and "norm_merge_stats_dropout_kernel" in k.name]
        assert merges, f"{arch}: no norm_merge_stats_dropout_kernel"


def test_sass_inventory_has_every_input_grad_backward_path():
    """The backwards that also write the add ops' input gradient (norm_bwd_kernel with an
    InputGradParams argument): every dtype and the float32 sum beside 16-bit inputs, both
    layouts, with and without clusters, LayerNorm and RMSNorm."""
    found = {}
    for k, rk in row_kernels():
        if rk.input_grad:
            assert rk.direction == "bwd", k.name
            found.setdefault(k.arch, set()).add((rk.dtype, rk.io, rk.vectorized, rk.cluster,
                                                 rk.centered))
    assert found, "no input-gradient backward kernels in the library's SASS"
    ios = {(t, t) for t in DTYPES} | {("float32", "float16"), ("float32", "bfloat16")}
    for arch, paths in found.items():
        missing = {(t, io, v, c, centered) for t, io in ios for v in (True, False)
                   for c in (True, False) for centered in (True, False)} - paths
        assert not missing, f"{arch}: no input-gradient SASS for {sorted(missing)}"


def test_sass_16bit_vector_kernels_have_no_2_byte_stores():
    bad = [
        (k.arch, k.name)
        for k, rk in row_kernels()
        if rk.vectorized and rk.io in ("float16", "bfloat16") and k.ops["STG.E.U16"] > 0
    ]
    assert not bad, f"2-byte global stores (STG.E.U16) in 16-bit vector kernels: {bad}"


def test_sass_vector_kernels_store_16_bytes():
    """Every vector kernel writes its output packs with 128-bit stores: at least one per pack
    a thread holds (ITEMS); the float32 residual stream's forwards also their 16-bit y packs
    of 8 bytes with 64-bit stores."""
    bad = []
    for k, rk in row_kernels():
        if not rk.vectorized:
            continue
        wide = sum(n for op, n in k.ops.items() if op.startswith("STG.E.128"))
        if wide < rk.items:
            bad.append((k.arch, rk, wide))
        narrow_y = rk.direction == "fwd" and rk.io != rk.dtype
        if narrow_y and sum(n for op, n in k.ops.items() if op.startswith("STG.E.64")) < rk.items:
            bad.append((k.arch, rk, "64-bit stores"))
    assert not bad, f"vector kernels with fewer 128-bit stores (STG.E.128) than packs: {bad}"


def test_sass_no_local_memory_in_norm_kernels():
    """No spills (stack frame, local memory, LDL/STL) in any norm-family kernel (LayerNorm,
    RMSNorm, their forwards with dropout, the apply kernels, dropout_scale), float64 ones
    included."""
    bad = []
    for k in kernels().values():
        if not any(f in k.name for f in ("norm_", "sum_partial_rows", "dropout_scale")):
            continue
        spill_ops = sum(n for op, n in k.ops.items() if op.startswith(("LDL", "STL")))
        if k.stack or k.local or spill_ops:
            bad.append((k.arch, k.name, f"stack={k.stack} local={k.local} LDL/STL={spill_ops}"))
    assert not bad, f"local memory in norm kernels: {bad}"


def test_sass_registers_allow_the_launch_block_size():
    unknown, bad = [], []
    for k in kernels().values():
        block = launch_block(k.name)
        if block is None:
            unknown.append(k.name)
        elif not registers_fit(k.regs, block):
            bad.append((k.arch, k.name, k.regs, block))
    assert not unknown, (
        f"kernels without a known launch block size (add them to sass_inspect.OTHER_BLOCKS): {unknown}"
    )
    assert not bad, f"registers forbid the launch block size (arch, kernel, regs, block): {bad}"


def test_sass_registers_fit_rule():
    """The occupancy arithmetic itself: 64 registers fit a block of 1024, 65 do not; 128 fit
    512; 255 is the most a thread may have."""
    assert registers_fit(64, 1024) and not registers_fit(65, 1024)
    assert registers_fit(128, 512) and not registers_fit(129, 512)
    assert registers_fit(255, 256) and not registers_fit(256, 32)


# The (input, parameter) dtype pairs of FUSEDNORM_CUDA_NORM_DTYPES (csrc/cuda/norm_launch.h).
DTYPE_PAIRS = {("float32", "float32"), ("float64", "float64"), ("float16", "float16"),
               ("float16", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")}


def test_sass_figures_cover_every_bucket(tmp_path):
    """benchmarks.sass_figures on the library the tests import: one row per norm row kernel
    (every bucket of both passes, both kinds, every dtype pair, both layouts), each with a
    positive instruction count, written as JSON and Markdown with its definition."""
    import json

    from benchmarks import sass_figures

    rows = sass_figures.figures(kernels())
    got = {(r["arch"], r["pass"], r["kind"] == "layer_norm", r["dtype"], r["io_dtype"],
            r["param_dtype"], r["vec"], r["tpr"], r["items"], r["cluster"]) for r in rows}
    # (the figures leave the dropout forwards and the input-gradient backwards out)
    want = {(k.arch, rk.direction, rk.centered, rk.dtype, rk.io, rk.param, rk.vec, rk.tpr,
             rk.items, rk.cluster) for k, rk in row_kernels()
            if not rk.dropout and not rk.input_grad}
    assert got == want and len(rows) == len(want)
    for arch in {r["arch"] for r in rows}:
        paths = {(r["pass"], r["kind"], r["dtype"], r["param_dtype"], r["layout"])
                 for r in rows if r["arch"] == arch}
        missing = {(p, kind, t, q, layout) for p in ("fwd", "bwd")
                   for kind in ("layer_norm", "rms_norm") for t, q in DTYPE_PAIRS
                   for layout in ("pack", "scalar")} - paths
        assert not missing, f"{arch}: no figures for {sorted(missing)}"
    assert all(r["instructions"] > 0 and r["instr_per_elem"] > 0 for r in rows)
    sass_figures.write(sass_figures.result_of(rows), tmp_path)
    written = json.loads((tmp_path / "sass_figures.json").read_text())
    assert written["rows"] == rows and "ITEMS x VEC" in written["definition"]
    assert (tmp_path / "sass_figures.md").read_text().count("\n| sm_") == len(rows)
