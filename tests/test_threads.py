"""Calls from several Python threads at once (an inference server, a data pipeline that
normalizes): each op releases the GIL, so the calls really overlap, each with its own
OpenMP team. Their results must be those of the same calls made one at a time: the
kernels' per-thread scratch (widened parameters) and the backward's partial rows must never
be shared between concurrent calls."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fusednorm

# Shapes and dtypes differ from case to case, so that a scratch buffer two calls shared
# would hold the wrong parameters (another N, another dtype) for one of them.
CASES = [(torch.float32, 33, 1000), (torch.bfloat16, 64, 768), (torch.float16, 7, 4097),
         (torch.float64, 128, 256), (torch.bfloat16, 5, 1030), (torch.float16, 96, 512)]


def _inputs(case: int):
    dtype, M, N = CASES[case]
    g = torch.Generator().manual_seed(case)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, r, dy = rand(M, N), rand(M, N), rand(M, N)
    # 16-bit inputs take float32 norm parameters too (widened per call into the scratch).
    wide = case % 2 and dtype in (torch.float16, torch.bfloat16)
    w = (torch.randn(N, generator=g) + 1).to(torch.float32 if wide else dtype)
    b = torch.randn(N, generator=g).to(w.dtype)
    w1, w2 = rand(64, N, scale=N ** -0.5), rand(N, 64, scale=0.125)
    return x, r, w, b, dy, w1, w2


# The FFN's results come out of the GEMM library, whose split of the work is its own: they
# are compared within rounding (a shared scratch would be far off), the norms' bitwise.
FFN_RESULTS = 4  # the last _run results: the FFN's output and its three gradients


def _run(case: int) -> list[torch.Tensor]:
    """Forward and backward of every op on the case's tensors: outputs and gradients."""
    x, r, w, b, dy, w1, w2 = _inputs(case)
    for t in (x, r, w, b, w1, w2):
        t.requires_grad_()
    n = (x.shape[-1],)
    # A 16-bit add op takes its float32 residual stream too.
    sum_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    results = []
    for out, wrt in [
        (fusednorm.layer_norm(x, n, w, b), (x, w, b)),
        (fusednorm.rms_norm(x, n, w), (x, w)),
        (fusednorm.add_layer_norm(x, r, n, w, b)[0], (x, r, w, b)),
        (fusednorm.add_rms_norm(x, r, n, w, residual_dtype=sum_dtype)[0], (x, r, w)),
        (fusednorm.gelu_ffn(x, w1, None, w2, None), (x, w1, w2)),
    ]:
        results.append(out.detach())
        results.extend(torch.autograd.grad(out, wrt, dy))
    return results


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_calls_equal_serial_calls(threads):
    serial = {case: _run(case) for case in range(len(CASES))}
    jobs = [case for _ in range(6) for case in range(len(CASES))]
    with ThreadPoolExecutor(threads) as pool:
        for case, got in zip(jobs, pool.map(_run, jobs)):
            assert len(got) == len(serial[case])
            for i, (a, e) in enumerate(zip(got, serial[case])):
                if i >= len(got) - FFN_RESULTS:
                    torch.testing.assert_close(a, e, msg=lambda m: f"case {CASES[case]}: {m}")
                else:
                    assert torch.equal(a, e), f"case {CASES[case]}, result {i} differs from serial"
