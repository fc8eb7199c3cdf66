"""Every differentiable public op as a case for the autograd-transform tests: its
differentiated arguments, the fused call and the same op written from PyTorch's
primitives, each returning a tuple of the op's differentiable outputs.

The norms are written out (mean, square, rsqrt), not F.layer_norm / F.rms_norm: PyTorch's
layer_norm derivatives are wrong from the third order and in nested forward mode
(pytorch/pytorch#175754, #196700), which the primitives are not."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import functional
from conftest import random_input

D, H = 7, 9  # odd row length and hidden width


def _tensors(device, dtype, param_dtype=None):
    g = lambda shape, seed, scale=1.0, dt=dtype: random_input(shape, dt, device, scale=scale, seed=seed)  # noqa: E731
    p = param_dtype or dtype
    return {
        "x": g((3, 2, D), 1), "r": g((3, 2, D), 2), "w": g((D,), 3, dt=p), "b": g((D,), 4, dt=p),
        "w1": g((H, D), 5, 0.3), "b1": g((H,), 6), "w2": g((D, H), 7, 0.3), "b2": g((D,), 8),
    }


def _layer_norm(x, w, b, eps=1e-5):
    centered = x - x.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps) * w + b


def _rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _ffn(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


# name -> (the differentiated arguments, fused call, the same op in plain PyTorch)
OPS = {
    "layer_norm": (("x", "w", "b"),
                   lambda x, w, b: (fusednorm.layer_norm(x, (D,), w, b),),
                   lambda x, w, b: (_layer_norm(x, w, b),)),
    "rms_norm": (("x", "w"),
                 lambda x, w: (fusednorm.rms_norm(x, (D,), w, 1e-6),),
                 lambda x, w: (_rms_norm(x, w),)),
    "add_layer_norm": (("x", "r", "w", "b"),
                       lambda x, r, w, b: fusednorm.add_layer_norm(x, r, (D,), w, b),
                       lambda x, r, w, b: (_layer_norm(x + r, w, b), x + r)),
    "add_rms_norm": (("x", "r", "w"),
                     lambda x, r, w: fusednorm.add_rms_norm(x, r, (D,), w, 1e-6),
                     lambda x, r, w: (_rms_norm(x + r, w), x + r)),
    # zero_centered_weight: 1 + w applied, the gradient to w.
    "rms_norm_zero_centered": (("x", "w"),
                               lambda x, w: (fusednorm.rms_norm(x, (D,), w, 1e-6,
                                                                zero_centered_weight=True),),
                               lambda x, w: (_rms_norm(x, 1 + w),)),
    "add_layer_norm_zero_centered": (
        ("x", "r", "w", "b"),
        lambda x, r, w, b: fusednorm.add_layer_norm(x, r, (D,), w, b, zero_centered_weight=True),
        lambda x, r, w, b: (_layer_norm(x + r, 1 + w, b), x + r)),
    # residual_dtype=torch.float32: the sum in float32, float64 for float64 input.
    "add_rms_norm_residual_fp32": (
        ("x", "r", "w"),
        lambda x, r, w: fusednorm.add_rms_norm(x, r, (D,), w, 1e-6, residual_dtype=torch.float32),
        lambda x, r, w: (_rms_norm(x + r, w), x + r)),
    "gelu_ffn": (("x", "w1", "b1", "w2", "b2"),
                 lambda *a: (fusednorm.gelu_ffn(*a),),
                 lambda *a: (_ffn(*a),)),
    "layer_norm_gelu_ffn": (("x", "w", "b", "w1", "b1", "w2", "b2"),
                            lambda x, w, b, w1, b1, w2, b2: (functional.layer_norm_gelu_ffn(
                                x, w, b, 1e-5, w1, b1, w2, b2),),
                            lambda x, w, b, w1, b1, w2, b2: (
                                x + _ffn(_layer_norm(x, w, b), w1, b1, w2, b2),)),
}


def op_args(name, device, dtype, param_dtype=None):
    t = _tensors(device, dtype, param_dtype)
    return [t[k] for k in OPS[name][0]]
