"""Functional forms with the signatures of torch.nn.functional."""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from . import _loader, ops, reference

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_warned_fallback: set[str] = set()


def _normalized_shape_tuple(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    if isinstance(normalized_shape, torch.Size) or isinstance(normalized_shape, (list, tuple)):
        if all(isinstance(d, int) for d in normalized_shape):
            return tuple(normalized_shape)
    raise TypeError(
        f"fusednorm.layer_norm: normalized_shape must be an int or a sequence of ints, "
        f"got {normalized_shape!r}"
    )


def _check_param(name: str, param, input: torch.Tensor, shape: tuple[int, ...]) -> None:
    if param is None:
        return
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"fusednorm.layer_norm: {name} must be a Tensor or None, got {type(param).__name__}")
    if tuple(param.shape) != shape:
        raise ValueError(
            f"fusednorm.layer_norm: {name} must have shape normalized_shape={list(shape)}, "
            f"got {list(param.shape)}"
        )
    if param.device != input.device:
        raise RuntimeError(
            f"fusednorm.layer_norm: {name} is on {param.device} but input is on {input.device}"
        )
    mixed_ok = input.dtype in (torch.float16, torch.bfloat16) and param.dtype == torch.float32
    if param.dtype != input.dtype and not mixed_ok:
        raise TypeError(
            f"fusednorm.layer_norm: {name} must have the input's dtype ({input.dtype}) or "
            f"float32 for a float16/bfloat16 input, got {param.dtype}"
        )


def _check_layer_norm_args(input, shape, weight, bias, eps) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"fusednorm.layer_norm: input must be a Tensor, got {type(input).__name__}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            "fusednorm.layer_norm: input must be float32, float64, float16 or bfloat16, "
            f"got {input.dtype}"
        )
    if not shape or input.dim() < len(shape) or tuple(input.shape[-len(shape):]) != shape:
        raise ValueError(
            f"fusednorm.layer_norm: normalized_shape={list(shape)} must be non-empty and equal "
            f"the trailing dims of input, whose shape is {list(input.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"fusednorm.layer_norm: eps must be a float >= 0, got {eps!r}")
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(
            f"fusednorm.layer_norm: weight and bias must share a dtype, got {weight.dtype} "
            f"and {bias.dtype}"
        )


def _autocast_to_fp32(input, weight, bias):
    """Under CUDA autocast, torch.nn.functional.layer_norm runs in float32 (it is on
    autocast's float32 list); fusednorm does the same so that swapping it in changes no
    dtype. CPU autocast leaves layer_norm alone, and so do we."""
    if input.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        cast = lambda t: t.float() if t is not None and t.is_floating_point() else t  # noqa: E731
        return cast(input), cast(weight), cast(bias)
    return input, weight, bias


def _warn_fallback(device_type: str) -> None:
    if device_type not in _warned_fallback:
        _warned_fallback.add(device_type)
        reason = _loader.LOAD_ERROR or f"no fusednorm kernel for {device_type} tensors"
        warnings.warn(f"{reason}; using the plain-PyTorch reference", RuntimeWarning, stacklevel=3)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the trailing `normalized_shape` dims; same signature and result as
    torch.nn.functional.layer_norm. Statistics in float32 (float64 for float64 input),
    output in the input's dtype; weight/bias may be float32 for a float16/bfloat16 input."""
    shape = _normalized_shape_tuple(normalized_shape)
    _check_layer_norm_args(input, shape, weight, bias, eps)
    input, weight, bias = _autocast_to_fp32(input, weight, bias)
    if not _loader.has_kernel("layer_norm_fwd", input.device.type):
        _warn_fallback(input.device.type)
        return reference.layer_norm(input, shape, weight, bias, eps, upcast=False)
    return ops.fused_layer_norm(input, shape, weight, bias, float(eps))
