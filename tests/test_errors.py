"""Every bad input of docs/DESIGN.md's Errors section raises a Python exception naming the
argument; the compiled ops defend themselves too."""
from __future__ import annotations

import pytest
import torch

import fusednorm

ops = torch.ops.fusednorm


def ln(x, shape=(8,), weight=None, bias=None, eps=1e-5):
    return fusednorm.layer_norm(x, shape, weight, bias, eps)


X = torch.randn(4, 8)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: ln(X, (7,)), ValueError, "normalized_shape"),
        (lambda: ln(X, (4, 8, 1)), ValueError, "normalized_shape"),
        (lambda: ln(X, ()), ValueError, "normalized_shape"),
        (lambda: ln(X, "8"), TypeError, "normalized_shape"),
        (lambda: ln(X, (8,), torch.ones(7)), ValueError, "weight"),
        (lambda: ln(X, (8,), None, torch.ones(4, 2)), ValueError, "bias"),
        (lambda: ln(X, (8,), torch.ones(8, dtype=torch.float16)), TypeError, "weight"),
        (lambda: ln(X.double(), (8,), torch.ones(8)), TypeError, "weight"),
        (lambda: ln(X.half(), (8,), torch.ones(8), torch.ones(8, dtype=torch.half)), TypeError, "weight and bias"),
        (lambda: ln(X, (8,), [1.0] * 8), TypeError, "weight"),
        (lambda: ln(X.to(torch.int32)), TypeError, "input"),
        (lambda: ln(X.to(torch.complex64)), TypeError, "input"),
        (lambda: ln(X.bool()), TypeError, "input"),
        (lambda: ln(X.tolist()), TypeError, "input"),
        (lambda: ln(X, eps=-1e-5), ValueError, "eps"),
        (lambda: ln(X, eps=float("nan")), ValueError, "eps"),
        (lambda: ln(X, (8,), torch.ones(8, device="meta")), RuntimeError, "weight"),
    ],
)
def test_python_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: ops.norm_fwd(torch.randn(2, 3, 4), None, None, None, 1e-5, True), "input must be 2-D"),
        (lambda: ops.norm_fwd(torch.randn(4, 6)[:, ::2], None, None, None, 1e-5, True), "contiguous"),
        (lambda: ops.norm_fwd(torch.randn(4, 6), None, torch.ones(5), None, 1e-5, True), "weight"),
        (lambda: ops.norm_fwd(torch.randn(4, 6), None, None, None, -1.0, True), "eps"),
        (lambda: ops.norm_fwd(torch.ones(4, 6, dtype=torch.int64), None, None, None, 1e-5, True), "input"),
        (
            lambda: ops.norm_bwd(torch.randn(4, 5), None, torch.randn(4, 6), torch.zeros(4), torch.ones(4), None, None, True),
            "grad_out",
        ),
        (
            lambda: ops.norm_bwd(torch.randn(4, 6), None, torch.randn(4, 6), torch.zeros(3), torch.ones(4), None, None, True),
            "mean",
        ),
        (
            lambda: ops.norm_bwd(
                torch.randn(4, 6), None, torch.randn(4, 6), torch.zeros(4),
                torch.ones(4, dtype=torch.float64), None, None, True,
            ),
            "rstd",
        ),
    ],
)
def test_op_errors(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_module_rejects_wrong_trailing_shape():
    with pytest.raises(ValueError, match=r"normalized_shape=\[16\]"):
        fusednorm.FusedLayerNorm(16)(torch.randn(2, 8))
