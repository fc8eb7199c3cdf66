"""CUDA LayerNorm on rows longer than one block holds: on sm_90 and newer, 2 to 8 chunks
are held by a thread-block cluster (one launch); 9 or more chunks, and older GPUs, take the
chunked three-launch path. Row lengths at the cluster sizes' edges, every dtype, against the
float64 reference (tests/emulation runs the same paths on the CPU). Skipped without a GPU.
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, random_input
from test_layer_norm import check_forward_backward, make_params

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Largest row a block holds, in elements, with 16-byte packs: forward 8192 packs, backward
# 1024 packs (16-bit) or 2048 (float, double); see csrc/cuda/norm_kernels.cuh.
PACK = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4, torch.float64: 2}
BWD_PACKS = {torch.float16: 1024, torch.bfloat16: 1024, torch.float32: 2048, torch.float64: 2048}


def lengths(dtype):
    """Rows of 2 and 8 backward chunks (clusters), 9 chunks (no cluster), and forward rows of
    2 and 8 chunks; 65536 columns in every dtype."""
    bwd = BWD_PACKS[dtype] * PACK[dtype]
    fwd = 8192 * PACK[dtype]
    return sorted({2 * bwd, 8 * bwd - PACK[dtype], 8 * bwd + PACK[dtype], 65536, 2 * fwd, 8 * fwd - PACK[dtype]})


# The sanitizer (tests/sanitize.sh) runs the 65536-column rows: the clustered forward and
# backward on sm_90+, 8 backward chunks for 16-bit and float inputs.
CASES = [
    pytest.param(dtype, n, marks=[pytest.mark.sanitize] if n == 65536 and dtype != torch.float64 else [],
                 id=f"{str(dtype)[6:]}-{n}")
    for dtype in PACK
    for n in lengths(dtype)
]


@pytest.mark.parametrize("dtype, N", CASES)
def test_long_rows_match_reference(dtype, N):
    param_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x = random_input((3, N), dtype, "cuda")
    weight, bias = make_params((N,), "affine", param_dtype, "cuda")
    check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_rows_bitwise_deterministic(dtype):
    """The clustered reduction merges the blocks' statistics in a fixed order."""
    N = 65536
    x = random_input((5, N), dtype, "cuda")
    weight, bias = make_params((N,), "affine", torch.float32 if dtype == torch.bfloat16 else dtype, "cuda")
    dy = random_input((5, N), dtype, "cuda", scale=1.0, shift=0.0, seed=3)
    runs = []
    for _ in range(2):
        out, _, mean, rstd = torch.ops.fusednorm.norm_fwd(x, None, weight, bias, 1e-5, True)
        grads = torch.ops.fusednorm.norm_bwd(dy, None, x, mean, rstd, weight, bias, True)
        runs.append((out, mean, rstd, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
