"""Random-shape fuzz of the norm family on the device: layer_norm, rms_norm, add_layer_norm and
add_rms_norm, forward and backward, against the float64 reference (fusednorm.reference) with
the three-way bound of conftest.check_outputs_and_grads. Each case draws its op, dtype,
parameter dtype, row count, row length (odd and even, 1 to 70000, so every bucket and the
chunked rows), layout (contiguous, a column slice, a transposed copy's view, a row step) and
affine flags from one seeded generator, so a failure names a case that replays exactly.

CUDA: CUDA_CASES cases (skipped without a GPU). CPU: the first CPU_CASES of the same draw,
capped in size, so CI runs the harness itself in seconds.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from conftest import HAS_CUDA, check_outputs_and_grads, random_input, torch_layer_norm

CUDA_CASES = 512
CPU_CASES = 30
CPU_MAX_ELEMENTS = 1 << 16  # per tensor, so that the CPU subset takes seconds
CUDA_MAX_ELEMENTS = 1 << 22

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "column_slice", "transposed", "row_step")
# Row lengths the draw favours: each bucket's edges (powers of two and one either side), the
# chunked lengths past the largest bucket, and odd ones.
EDGE_N = (1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097,
          8191, 8192, 8193, 12288, 16383, 16384, 16385, 32768, 32769, 65535, 65536, 65537)


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    op: str
    dtype: torch.dtype
    float_params: bool  # float32 weight/bias beside a float16/bfloat16 input
    M: int
    N: int
    layout: str
    weight: bool
    bias: bool  # LayerNorm only

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        params = ("w" if self.weight else "") + ("b" if self.bias else "")
        return (f"{self.index}-{self.op}-{dt}{'-fp32params' if self.float_params else ''}"
                f"-{self.M}x{self.N}-{self.layout}-{params or 'noaffine'}")


def draw_cases(count: int, max_elements: int, seed: int = 41) -> list[Case]:
    """`count` cases from a generator seeded with `seed`, each tensor at most max_elements."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        op = rng.choice(OPS)
        dtype = rng.choice(DTYPES)
        if rng.random() < 0.5:
            N = rng.choice(EDGE_N)
        else:
            N = int(2 ** rng.uniform(0, 16.1)) | rng.choice((0, 1))  # odd half of the time
        N = max(1, min(N, max_elements))
        M = max(1, min(rng.choice((1, 2, 3, 5, 17, 64, 129, 1000, 4099)), max_elements // N))
        centered = op.endswith("layer_norm")
        weight = rng.random() < 0.8
        cases.append(Case(
            index=index, op=op, dtype=dtype,
            float_params=weight and dtype in (torch.float16, torch.bfloat16) and rng.random() < 0.3,
            M=M, N=N, layout=rng.choice(LAYOUTS), weight=weight,
            bias=centered and weight and rng.random() < 0.8))
    return cases


def _laid_out(t: torch.Tensor, layout: str, seed: int) -> torch.Tensor:
    """t's values in a tensor of the given layout (a view whose strides are not [N, 1])."""
    M, N = t.shape
    if layout == "column_slice":  # rows of N inside rows of N + 3
        wide = random_input((M, N + 3), t.dtype, t.device, seed=seed)
        wide[:, 1:N + 1] = t
        return wide[:, 1:N + 1]
    if layout == "transposed":  # column-major storage
        return t.t().contiguous().t()
    if layout == "row_step":  # every other row of a taller tensor
        tall = random_input((2 * M, N), t.dtype, t.device, seed=seed)
        tall[::2] = t
        return tall[::2]
    return t


def _inputs(case: Case, device: str):
    x = _laid_out(random_input((case.M, case.N), case.dtype, device, seed=case.index),
                  case.layout, seed=case.index + 1)
    residual = None
    if case.op.startswith("add_"):
        residual = random_input((case.M, case.N), case.dtype, device, scale=1.0, shift=-0.5,
                                seed=case.index + 2)
    pdtype = torch.float32 if case.float_params else case.dtype
    w = (random_input((case.N,), pdtype, device, scale=1.0, shift=1.0, seed=case.index + 3)
         if case.weight else None)
    b = (random_input((case.N,), pdtype, device, scale=1.0, shift=0.0, seed=case.index + 4)
         if case.bias else None)
    return x, residual, w, b


def _functions(case: Case):
    """(fused, torch, reference) callables over (x[, residual], weight[, bias])."""
    shape = (case.N,)
    if case.op == "layer_norm":
        return (lambda x, w, b: (fusednorm.layer_norm(x, shape, w, b),),
                lambda x, w, b: (torch_layer_norm(x, shape, w, b),),
                lambda x, w, b: (reference.layer_norm(x, shape, w, b),))
    if case.op == "rms_norm":
        eps = reference.rms_eps(case.dtype)
        return (lambda x, w: (fusednorm.rms_norm(x, shape, w),),
                lambda x, w: (F.rms_norm(x.float(), shape, None if w is None else w.float())
                              .to(x.dtype) if case.float_params else F.rms_norm(x, shape, w),),
                lambda x, w: (reference.rms_norm(x, shape, w, eps),))
    if case.op == "add_layer_norm":
        return (lambda x, r, w, b: fusednorm.add_layer_norm(x, r, shape, w, b),
                lambda x, r, w, b: (torch_layer_norm(x + r, shape, w, b), x + r),
                lambda x, r, w, b: reference.add_layer_norm(x, r, shape, w, b))
    eps = reference.rms_eps(case.dtype)
    return (lambda x, r, w: fusednorm.add_rms_norm(x, r, shape, w),
            lambda x, r, w: (F.rms_norm((x + r).float(), shape, None if w is None else w.float())
                             .to(x.dtype) if case.float_params else F.rms_norm(x + r, shape, w),
                             x + r),
            lambda x, r, w: reference.add_rms_norm(x, r, shape, w, eps))


def check_case(case: Case, device: str) -> None:
    """Forward outputs and every gradient of the case within the three-way bound."""
    x, residual, w, b = _inputs(case, device)
    tensors, names = [x], ["input"]
    if residual is not None:
        tensors.append(residual)
        names.append("residual")
    tensors.append(w)
    names.append("weight")
    if case.op.endswith("layer_norm"):
        tensors.append(b)
        names.append("bias")
    fused, eager, ref = _functions(case)
    check_outputs_and_grads(fused, eager, ref, tensors, names)


CPU_PARAMS = [pytest.param(c, id=str(c)) for c in draw_cases(CPU_CASES, CPU_MAX_ELEMENTS)]
CUDA_PARAMS = [pytest.param(c, id=str(c)) for c in draw_cases(CUDA_CASES, CUDA_MAX_ELEMENTS)]


def test_fuzz_draw_covers_every_path():
    """The CUDA draw has every op x dtype, every layout, odd and even N, N past the largest
    bucket, float parameters and no parameters: a draw that missed a path would pass
    without testing it."""
    cases = draw_cases(CUDA_CASES, CUDA_MAX_ELEMENTS)
    assert len(cases) >= 500
    assert {(c.op, c.dtype) for c in cases} == {(o, d) for o in OPS for d in DTYPES}
    assert {c.layout for c in cases} == set(LAYOUTS)
    assert any(c.N % 2 for c in cases) and any(c.N % 8 == 0 for c in cases)
    assert any(c.N > 32768 for c in cases)
    assert any(c.float_params for c in cases) and any(not c.weight for c in cases)
    assert draw_cases(CPU_CASES, CPU_MAX_ELEMENTS) == draw_cases(CPU_CASES, CPU_MAX_ELEMENTS)


@pytest.mark.parametrize("case", CPU_PARAMS)
def test_fuzz_cpu(case):
    check_case(case, "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and fusednorm's CUDA kernels")
@pytest.mark.parametrize("case", CUDA_PARAMS)
def test_fuzz_cuda(case):
    check_case(case, "cuda")
