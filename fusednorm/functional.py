"""Functional forms with the signatures of torch.nn.functional.

Each is one call of a compiled op (fusednorm/ops/), which checks its arguments, runs the
kernels and carries the autograd formula in C++; in eager mode through its direct entry in
fusednorm._fast when it can (PyTorch's own functions' host cost per call, where torch.ops
costs about 2 us more), else through torch.ops. Python steps in only when that call
fails: to name an argument of the wrong Python type (the op's schema rejects it with a
generic message), or to fall back to fusednorm.reference where no kernel was compiled for
the input's device (or the library did not load). The checks below serve those two paths.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from typing import Sequence

import torch

from . import _jagged, _loader, ops, reference
from .errors import OP_ERRORS, FusedTypeError, FusedValueError, as_argument_error

try:
    from torch.nn.utils._expanded_weights import ExpandedWeight as _ExpandedWeight
except ImportError:  # a torch without per-sample gradients
    _ExpandedWeight = None

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Each function below calls its op through _call: first its direct entry (ops.FAST), which
# answers NotImplemented where the torch.ops path must decide: tensor subclasses,
# TorchFunctionModes, symbolic sizes, any error (so errors are explained the one way).
# Under torch.compile the check below is a constant True and dynamo traces the torch.ops
# call, a graph node.
_dynamo_compiling = torch.compiler.is_dynamo_compiling
# fusednorm.distributed's _layout(name, args): DTensor activations sharded over several mesh
# dims brought, above autograd, to a layout the sharding rules serve; None before it loads.
_dtensor_layout = None


def _onnx_exporting() -> bool:
    """True while torch.onnx.export traces: with dynamo=True it runs torch.export non-strict,
    with dynamo=False the JIT tracer; the direct entries answer NotImplemented under both, so
    _call reaches this check. torch.onnx is not imported for it (25 ms): an export has
    imported it."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


# Where zero_centered_weight, a bool, sits in a norm op's arguments (filled below the
# functions, from their parameters, which are the op's schema: tests/test_op_table.py).
# torch.ops (and the fallback) would take any int for it, so _call has the op's check name
# a non-bool before either; the direct entries answer NotImplemented for one.
_FLAG_AT: dict[str, int] = {}
# Where normalized_shape sits in a norm op's arguments (for jagged inputs, _jagged).
_SHAPE_AT: dict[str, int] = {}
_warned_fallback: set[tuple[str, str]] = set()


def _normalized_shape_tuple(normalized_shape: int | Sequence[int],
                            fn: str = "fusednorm.layer_norm") -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    if isinstance(normalized_shape, torch.Size) or isinstance(normalized_shape, (list, tuple)):
        if all(isinstance(d, (int, torch.SymInt)) for d in normalized_shape):
            return tuple(normalized_shape)
    raise FusedTypeError(
        f"{fn}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
    )


def _check_dense(fn: str, name: str, t: torch.Tensor) -> None:
    """t is strided (dense), as the kernels index it, or a jagged nested tensor (_jagged
    runs the ops on its strided values)."""
    if t.layout != torch.strided and t.layout != torch.jagged:
        raise FusedTypeError(f"{fn}: {name} must be a dense tensor (torch.strided), got "
                             f"{t.layout}")


def _check_param(name: str, param, input: torch.Tensor, shape: tuple[int, ...],
                 fn: str = "fusednorm.layer_norm") -> None:
    if param is None:
        return
    if not isinstance(param, torch.Tensor):
        raise FusedTypeError(f"{fn}: {name} must be a Tensor or None, got {type(param).__name__}")
    _check_dense(fn, name, param)
    if tuple(param.shape) != shape:
        raise FusedValueError(
            f"{fn}: {name} must have shape normalized_shape={list(shape)}, got {list(param.shape)}"
        )
    if param.device != input.device:
        raise FusedValueError(f"{fn}: {name} is on {param.device} but input is on {input.device}")
    # Which parameter dtypes go with which input is the compiled op's rule (it raises its
    # own TypeError); the reference path computes in the accumulation type whatever they are.


def _check_layer_norm_args(input, shape, weight, bias, eps, fn="fusednorm.layer_norm",
                           names=("weight", "bias")) -> None:
    if not isinstance(input, torch.Tensor):
        raise FusedTypeError(f"{fn}: input must be a Tensor, got {type(input).__name__}")
    _check_dense(fn, "input", input)
    if input.dtype not in _FLOAT_DTYPES:
        raise FusedTypeError(
            f"{fn}: input must be float32, float64, float16 or bfloat16, got {input.dtype}")
    if not shape or input.dim() < len(shape) or tuple(input.shape[-len(shape):]) != shape:
        raise FusedValueError(
            f"{fn}: normalized_shape={list(shape)} must be non-empty and equal "
            f"the trailing dims of input, whose shape is {list(input.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise FusedTypeError(f"{fn}: eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise FusedValueError(f"{fn}: eps must be a float >= 0, got {eps!r}")
    _check_param(names[0], weight, input, shape, fn)
    _check_param(names[1], bias, input, shape, fn)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise FusedTypeError(
            f"{fn}: {names[0]} and {names[1]} must share a dtype, got {weight.dtype} and "
            f"{bias.dtype}"
        )


def _check_flag(fn: str, zero_centered_weight) -> None:
    """torch.ops takes any int for a bool argument; the functions take a bool only."""
    if not isinstance(zero_centered_weight, bool):
        raise FusedTypeError(f"{fn}: zero_centered_weight must be a bool, got "
                             f"{type(zero_centered_weight).__name__}")


def _sum_dtype(fn: str, input: torch.Tensor, residual_dtype) -> torch.dtype:
    """The add ops' sum dtype for residual_dtype: None, the input's; torch.float32, the
    computation type (float32, float64 for float64 input: never narrower than the input)."""
    if residual_dtype is None:
        return input.dtype
    if not isinstance(residual_dtype, torch.dtype):
        raise FusedTypeError(f"{fn}: residual_dtype must be None or torch.float32, got "
                             f"{type(residual_dtype).__name__}")
    if residual_dtype != torch.float32:
        raise FusedTypeError(
            f"{fn}: residual_dtype must be None or torch.float32, got {residual_dtype}")
    return _param_dtype_for(input)


def _check_residual(fn, input, residual, residual_dtype) -> None:
    if not isinstance(residual, torch.Tensor):
        raise FusedTypeError(f"{fn}: residual must be a Tensor, got {type(residual).__name__}")
    _check_dense(fn, "residual", residual)
    if residual.shape != input.shape:
        raise FusedValueError(f"{fn}: residual must have the input's shape "
                              f"{list(input.shape)}, got {list(residual.shape)}")
    if residual.device != input.device:
        raise FusedValueError(
            f"{fn}: residual is on {residual.device} but input is on {input.device}")
    sum_dtype = _sum_dtype(fn, input, residual_dtype)
    if sum_dtype == input.dtype and residual.dtype != input.dtype:
        hint = (" (residual_dtype=torch.float32 takes a float32 residual)"
                if residual.dtype == torch.float32 and input.dtype in _REDUCED else "")
        raise FusedTypeError(f"{fn}: residual must have the input's dtype ({input.dtype}), "
                             f"got {residual.dtype}{hint}")
    if residual.dtype not in (input.dtype, sum_dtype):
        raise FusedTypeError(f"{fn}: residual must have the input's dtype ({input.dtype}) or "
                             f"residual_dtype's ({sum_dtype}), got {residual.dtype}")


_REDUCED = (torch.float16, torch.bfloat16)


def _check_dropout(fn, input, dims, dropout_p, rowscale) -> None:
    """The add ops' dropout_p (a float in [0, 1]) and rowscale (None, or a float tensor of
    the input's leading dims' shape on its device)."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise FusedTypeError(f"{fn}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise FusedValueError(f"{fn}: dropout_p must be in [0, 1], got {dropout_p!r}")
    if rowscale is None:
        return
    if not isinstance(rowscale, torch.Tensor):
        raise FusedTypeError(f"{fn}: rowscale must be a Tensor or None, got "
                             f"{type(rowscale).__name__}")
    _check_dense(fn, "rowscale", rowscale)
    lead = tuple(input.shape[:input.dim() - dims])
    if tuple(rowscale.shape) != lead:
        raise FusedValueError(f"{fn}: rowscale must have the shape of input's leading dims "
                              f"{list(lead)}, got {list(rowscale.shape)}")
    if rowscale.device != input.device:
        raise FusedValueError(f"{fn}: rowscale is on {rowscale.device} but input is on "
                              f"{input.device}")
    if rowscale.dtype not in _FLOAT_DTYPES:
        raise FusedTypeError(f"{fn}: rowscale must be float32, float64, float16 or bfloat16, "
                             f"got {rowscale.dtype}")


def _check_norm_call(fn, input, normalized_shape, weight, bias=None, eps=None,
                     residual=None, has_residual=False, zero_centered_weight=False,
                     residual_dtype=None, dropout_p=0.0, rowscale=None) -> None:
    """The norm family's checks (eps None: RMSNorm's default), with the residual's and the
    dropout's. With zero_centered_weight, weight and bias may have any float dtype (they
    are widened), and so may RMSNorm's weight (_rms_kernel_weight)."""
    _check_flag(fn, zero_centered_weight)
    shape = _normalized_shape_tuple(normalized_shape, fn)
    if zero_centered_weight and isinstance(input, torch.Tensor):
        weight, bias = (p.to(_param_dtype_for(input)) if isinstance(p, torch.Tensor)
                        and p.dtype in _FLOAT_DTYPES else p for p in (weight, bias))
    elif fn in _RMS_FNS:
        weight = _rms_kernel_weight(input, weight)
    if eps is None and fn in _RMS_FNS:  # RMSNorm's default (the dtype's machine epsilon)
        eps = 0.0
    _check_layer_norm_args(input, shape, weight, bias, eps, fn)
    if has_residual:
        _check_residual(fn, input, residual, residual_dtype)
        _check_dropout(fn, input, len(shape), dropout_p, rowscale)


_RMS_FNS = ("fusednorm.rms_norm", "fusednorm.add_rms_norm")


def _rms_kernel_weight(input, weight):
    """RMSNorm's weight as the compiled ops take it (csrc/ops/norm_family.h's
    rms_kernel_weight): torch.nn.functional.rms_norm takes a weight of any float dtype and
    returns the input's, so one of another float dtype than the kernels take is converted,
    to float32 beside float16/bfloat16 input, else to the input's dtype."""
    if not (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)) \
            or input.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        return weight  # the checks name what is wrong
    half = input.dtype in (torch.float16, torch.bfloat16)
    if weight.dtype == input.dtype or (half and weight.dtype == torch.float32):
        return weight
    return weight.to(torch.float32 if half else input.dtype)


def _autocast_to_fp32(input, weight, bias):
    """Under CUDA autocast, torch.nn.functional.layer_norm runs in float32 (it is on
    autocast's float32 list); the reference path does the same (the compiled op has this
    rule in C++). CPU autocast leaves layer_norm alone."""
    if input.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        cast = lambda t: (  # noqa: E731
            t.float() if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        )
        return cast(input), cast(weight), cast(bias)
    return input, weight, bias


def _param_dtype_for(input: torch.Tensor) -> torch.dtype:
    """The computation type: float64 for float64 input, else float32."""
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def _zero_centered(input, weight, bias, zero_centered_weight):
    """The fallback's weight and bias for zero_centered_weight (checked before): 1 + weight
    formed in the computation type, the bias widened alike, as the compiled ops form them."""
    if not zero_centered_weight:
        return weight, bias
    dtype = _param_dtype_for(input)
    return (None if weight is None else weight.to(dtype) + 1,
            None if bias is None else bias.to(dtype))


def _warn_fallback(device_type: str, instead: str = "the plain-PyTorch reference",
                   reason: str | None = None, stacklevel: int = 5) -> None:
    """Warns once per device type (and fallback) that no compiled kernel serves it (reason:
    why, when it is not the device's lack of kernels)."""
    if (device_type, instead) not in _warned_fallback:
        _warned_fallback.add((device_type, instead))
        reason = reason or _loader.LOAD_ERROR or f"no fusednorm kernel for {device_type} tensors"
        # The user's call, above: the function, _call, the fallback, this (stacklevel 5;
        # the jagged fallbacks are one call deeper, _jagged.on_values).
        warnings.warn(f"{reason}; using {instead}", RuntimeWarning, stacklevel=stacklevel)


def _explain(error: Exception, input, backend_op: str, check, *args) -> None:
    """The compiled op raised `error`. Raise the Python error that names a bad argument if
    check(*args) finds one; return when the input's device has no compiled kernel (the
    caller falls back to the reference); re-raise `error` otherwise (a plain TypeError or
    ValueError of the op's checks as fusednorm's, which is a RuntimeError too)."""
    try:
        check(*args)
    except (TypeError, ValueError, RuntimeError) as bad_argument:
        raise bad_argument from None
    if not _loader.has_kernel(backend_op, input.device.type):
        return
    argument_error = as_argument_error(error)
    if argument_error is error:
        raise error
    raise argument_error from None


def _call(name: str, args: tuple, outputs: int, check, backend_op: str, fallback):
    """The compiled op `name` on args: through its direct entry (ops.FAST) when that
    answers, else through its OpOverload; its first output, or its first `outputs` as a
    tuple. A rejected call raises the error that names the argument (_explain with
    check(*args)). fallback(*args) where the input's device has no kernel (backend_op's) or
    the library did not load."""
    fast = ops.FAST
    if fast is not None and not _dynamo_compiling():
        try:
            out = getattr(fast, name)(*args)
        except (TypeError, ValueError) as error:
            # Under a TorchDispatchMode the op's check error comes back through Python, as a
            # plain TypeError / ValueError: the error that names the argument, as without it.
            _explain(error, args[0], backend_op, check, *args)
            raise as_argument_error(error) from None
        if out is not NotImplemented:
            return out
    if _dtensor_layout is not None:  # set by fusednorm.distributed
        args = _dtensor_layout(name, args)
    if _jagged.is_nested(args[0]):
        shape_at = _SHAPE_AT.get(name)  # the FFN ops work on the last dim
        trailing = 1 if shape_at is None or isinstance(args[shape_at], int) \
            else len(args[shape_at])
        return _jagged.on_values(name, args, outputs, trailing,
                                 lambda a: _call(name, a, outputs, check, backend_op, fallback),
                                 _OVER_RAGGED.get(name))
    flag_at = _FLAG_AT.get(name)
    if flag_at is not None and type(args[flag_at]) is not bool:
        check(*args)  # raises, naming zero_centered_weight
    if not _dynamo_compiling() and _onnx_exporting():
        # ONNX has no function for fusednorm's ops: trace their ATen form (ops.decompositions).
        with warnings.catch_warnings():
            # The checks read the sizes as the constants of the trace that they are, which the
            # JIT tracer (dynamo=False) would warn of.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            check(*args)
        return _leading(getattr(ops.decompositions, name)(*args), outputs)
    op = getattr(ops, name.upper())
    if op is not None:
        try:
            result = op(*args)
        except OP_ERRORS as error:
            per_sample = _PER_SAMPLE.get(name)
            if per_sample is not None and _expanded_weights(args):
                return per_sample(*args)
            _explain(error, args[0], backend_op, check, *args)
        else:
            return _leading(result, outputs)
    return fallback(*args)


def _leading(result, outputs: int):
    """An op's first output, or its first `outputs` as a tuple; taken one by one, so that
    an FX proxy (torch.fx.symbolic_trace), which cannot be iterated, gives getitem nodes."""
    if outputs == 1:
        return result[0]
    return tuple(result[i] for i in range(outputs))


def _expanded_weights(args: tuple) -> bool:
    """Whether a parameter is an ExpandedWeight: torch's per-sample gradients
    (torch.nn.utils._per_sample_grad.call_for_per_sample_grads) are being computed."""
    return _ExpandedWeight is not None and any(type(a) is _ExpandedWeight for a in args)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_weight: bool = False,
) -> torch.Tensor:
    """LayerNorm over the trailing `normalized_shape` dims; same signature and result as
    torch.nn.functional.layer_norm. Statistics in float32 (float64 for float64 input),
    output in the input's dtype; weight/bias may be float32 for a float16/bfloat16 input.

    zero_centered_weight=True applies 1 + weight (formed in float32, float64 for float64
    input; weight and bias may then have any float dtype), as Gemma's norms do; gradients
    go to weight."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _call("layer_norm", (input, normalized_shape, weight, bias, eps, zero_centered_weight),
                 1, _check_layer_norm_call, "norm_fwd", _reference_layer_norm)


def _check_layer_norm_call(input, normalized_shape, weight, bias, eps,
                           zero_centered_weight=False) -> None:
    _check_norm_call("fusednorm.layer_norm", input, normalized_shape, weight, bias, eps,
                     zero_centered_weight=zero_centered_weight)


def _check_rms_norm_call(input, normalized_shape, weight, eps,
                         zero_centered_weight=False) -> None:
    _check_norm_call("fusednorm.rms_norm", input, normalized_shape, weight, None, eps,
                     zero_centered_weight=zero_centered_weight)


def _check_add_layer_norm_call(input, residual, normalized_shape, weight, bias, eps,
                               zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                               rowscale=None) -> None:
    _check_norm_call("fusednorm.add_layer_norm", input, normalized_shape, weight, bias, eps,
                     residual, True, zero_centered_weight, residual_dtype, dropout_p, rowscale)


def _check_add_rms_norm_call(input, residual, normalized_shape, weight, eps,
                             zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                             rowscale=None) -> None:
    _check_norm_call("fusednorm.add_rms_norm", input, normalized_shape, weight, None, eps,
                     residual, True, zero_centered_weight, residual_dtype, dropout_p, rowscale)


def _reference_layer_norm(input, normalized_shape, weight, bias, eps,
                          zero_centered_weight=False):
    if zero_centered_weight:
        _check_layer_norm_call(input, normalized_shape, weight, bias, eps, True)
        weight, bias = _zero_centered(input, weight, bias, True)
    shape = _normalized_shape_tuple(normalized_shape)
    _check_layer_norm_args(input, shape, weight, bias, eps)
    input, weight, bias = _autocast_to_fp32(input, weight, bias)
    _warn_fallback(input.device.type)
    return reference.layer_norm(input, shape, weight, bias, eps, upcast=False)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    zero_centered_weight: bool = False,
) -> torch.Tensor:
    """RMSNorm over the trailing `normalized_shape` dims: x / sqrt(mean(x²) + eps) * weight;
    same signature, defaults and result as torch.nn.functional.rms_norm (eps=None: the
    machine epsilon of float32, or of float64 for float64 input, as PyTorch computes it).
    Statistics in float32 (float64 for float64), output in the input's dtype.
    zero_centered_weight=True applies 1 + weight, as layer_norm's."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _call("rms_norm", (input, normalized_shape, weight, eps, zero_centered_weight), 1,
                 _check_rms_norm_call, "norm_fwd", _reference_rms_norm)


def _reference_rms_norm(input, normalized_shape, weight, eps, zero_centered_weight=False):
    _check_rms_norm_call(input, normalized_shape, weight, eps, zero_centered_weight)
    weight, _ = _zero_centered(input, weight, None, zero_centered_weight)
    input, weight, _ = _autocast_to_fp32(input, weight, None)
    _warn_fallback(input.device.type)
    return reference.rms_norm(input, normalized_shape, weight, eps, upcast=False)


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_weight: bool = False,
    residual_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s, normalized_shape, weight, bias, eps), s) with s = input + residual in
    the input's dtype: the pre-norm residual step of a transformer, in one pass over memory
    (reads input and residual once, writes both outputs once). Both are differentiable.
    zero_centered_weight as layer_norm's.

    residual_dtype=torch.float32 keeps the residual stream in float32: s is formed (one
    rounding), returned and normalized in float32 (float64 for float64 input), the output
    stays in the input's dtype; residual may then be float32 or of the input's dtype.

    dropout_p / rowscale: s = dropout(input, dropout_p) * rowscale[..., None] + residual in
    the same pass (always applied, as torch.nn.functional.dropout(training=True); a module
    skips it in eval mode). The mask comes from a Philox generator keyed by the device's
    default torch generator: one seed gives one mask on CPU and CUDA, and the backward
    regenerates it. rowscale (not differentiable): a per-row factor of the input's leading
    dims' shape, e.g. stochastic depth's 0 or 1 / (1 - p) per sample."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    args = (input, residual, normalized_shape, weight, bias, eps, zero_centered_weight,
            residual_dtype, dropout_p, rowscale)
    return _call("add_layer_norm", args, 2, _check_add_layer_norm_call, "norm_fwd",
                 _unfused_add_layer_norm)


def _residual_sum(input, residual, residual_dtype, dims, dropout_p=0.0, rowscale=None):
    """The fallback's s = input + residual in residual_dtype's sum dtype, one rounding; the
    input through torch's dropout (its own mask, not the kernels') and rowscale first."""
    dtype = _sum_dtype("fusednorm", input, residual_dtype)
    if dropout_p > 0:
        input = torch.nn.functional.dropout(input, dropout_p)
    if rowscale is not None:
        input = input * rowscale.detach().reshape(*rowscale.shape, *(1,) * dims).to(input.dtype)
    return input.to(dtype) + residual.to(dtype) if dtype != input.dtype else input + residual


def _unfused_add_layer_norm(input, residual, normalized_shape, weight, bias, eps,
                            zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                            rowscale=None):
    _check_add_layer_norm_call(input, residual, normalized_shape, weight, bias, eps,
                               zero_centered_weight, residual_dtype, dropout_p, rowscale)
    _warn_fallback(input.device.type, "input + residual, then layer_norm (two passes)")
    total = _residual_sum(input, residual, residual_dtype, len(normalized_shape), dropout_p,
                          rowscale)
    out = layer_norm(total, normalized_shape, weight, bias, eps,
                     zero_centered_weight=zero_centered_weight)
    return out.to(input.dtype), total


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    zero_centered_weight: bool = False,
    residual_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    rowscale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s, normalized_shape, weight, eps), s) with s = input + residual in the
    input's dtype, in one pass over memory; both outputs differentiable.
    zero_centered_weight as rms_norm's; residual_dtype, dropout_p and rowscale as
    add_layer_norm's."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    args = (input, residual, normalized_shape, weight, eps, zero_centered_weight, residual_dtype,
            dropout_p, rowscale)
    return _call("add_rms_norm", args, 2, _check_add_rms_norm_call, "norm_fwd",
                 _unfused_add_rms_norm)


def _unfused_add_rms_norm(input, residual, normalized_shape, weight, eps,
                          zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                          rowscale=None):
    _check_add_rms_norm_call(input, residual, normalized_shape, weight, eps,
                             zero_centered_weight, residual_dtype, dropout_p, rowscale)
    _warn_fallback(input.device.type, "input + residual, then rms_norm (two passes)")
    total = _residual_sum(input, residual, residual_dtype, len(normalized_shape), dropout_p,
                          rowscale)
    out = rms_norm(total, normalized_shape, weight, eps,
                   zero_centered_weight=zero_centered_weight)
    return out.to(input.dtype), total


_FLAG_AT.update({fn.__name__: list(inspect.signature(fn).parameters).index("zero_centered_weight")
                 for fn in (layer_norm, rms_norm, add_layer_norm, add_rms_norm)})
_SHAPE_AT.update({fn.__name__: list(inspect.signature(fn).parameters).index("normalized_shape")
                  for fn in (layer_norm, rms_norm, add_layer_norm, add_rms_norm)})

# Jagged nested tensors whose normalized dims include the ragged dim (each sequence
# normalized as a whole: rows of unequal lengths, which no kernel takes) are computed by
# PyTorch's own functions, as nn.LayerNorm / nn.RMSNorm compute them; _jagged.on_values
# calls these with the nested arguments (checked to share input's structure). What PyTorch
# raises for such an input (F.rms_norm, in torch 2.14: any; F.layer_norm: a ragged dim
# other than 1, a tensor with holes) is raised as fusednorm's error, naming the fallback.
_RAGGED_REASON = "no fusednorm kernel normalizes over the ragged dim of a jagged tensor"


def _over_ragged_where(fn: str, input, normalized_shape) -> str:
    return (f"{fn}: normalized_shape={list(normalized_shape)} includes the ragged dim "
            f"{input._ragged_idx} of the jagged input (shape {list(input.shape)})")


def _refuse_over_ragged(fn, input, normalized_shape, **options) -> None:
    """The arguments the ragged-dim fallback cannot honour, by name: weight and bias (no
    dense tensor has the ragged size, which normalized_shape holds; PyTorch's nested
    layer_norm would ignore them), dropout_p > 0 (the kernels' mask is drawn over rows of one
    length) and rowscale (applied by the kernels with their rounding)."""
    where = _over_ragged_where(fn, input, normalized_shape)
    for name in ("weight", "bias"):
        if options.get(name) is not None:
            ignored = (" (torch.nn.functional.layer_norm would ignore it)"
                       if fn.endswith("layer_norm") else "")
            raise FusedValueError(
                f"{where}: {name} must be None there, as no dense {name} has the shape "
                f"normalized_shape, which holds the ragged size{ignored}")
    if options.get("dropout_p"):
        raise FusedValueError(
            f"{where}: dropout_p={options['dropout_p']!r} is not supported there: no fused "
            f"kernel runs, and fusednorm's dropout mask is the kernels' (dropout_p must be 0; "
            f"a module's dropout applies in training mode only)")
    if options.get("rowscale") is not None:
        raise FusedValueError(
            f"{where}: rowscale is not supported there: no fused kernel runs to apply it "
            f"(rowscale must be None)")


def _torch_norm_over_ragged(fn, torch_fn, input, normalized_shape, *args):
    """torch_fn (torch.nn.functional's layer_norm or rms_norm) on the nested input; its
    error, for a nested input it does not support, as fusednorm's naming the fallback."""
    try:
        return torch_fn(input, list(normalized_shape), *args)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError) as error:
        raise FusedValueError(
            f"{_over_ragged_where(fn, input, normalized_shape)}: fusednorm falls back to "
            f"torch.nn.functional.{torch_fn.__name__} there, which does not support it: "
            f"{error}") from error


def _over_ragged_layer_norm(input, normalized_shape, weight, bias, eps,
                            zero_centered_weight=False):
    fn = "fusednorm.layer_norm"
    _refuse_over_ragged(fn, input, normalized_shape, weight=weight, bias=bias)
    _check_layer_norm_call(input, normalized_shape, None, None, eps, zero_centered_weight)
    out = _torch_norm_over_ragged(fn, torch.nn.functional.layer_norm, input, normalized_shape,
                                  None, None, eps)
    _warn_fallback(input.device.type, "torch.nn.functional.layer_norm", _RAGGED_REASON, 6)
    return out


def _over_ragged_rms_norm(input, normalized_shape, weight, eps, zero_centered_weight=False):
    fn = "fusednorm.rms_norm"
    _refuse_over_ragged(fn, input, normalized_shape, weight=weight)
    _check_rms_norm_call(input, normalized_shape, None, eps, zero_centered_weight)
    out = _torch_norm_over_ragged(fn, torch.nn.functional.rms_norm, input, normalized_shape,
                                  None, eps)
    _warn_fallback(input.device.type, "torch.nn.functional.rms_norm", _RAGGED_REASON, 6)
    return out


def _over_ragged_add_norm(fn, torch_fn, input, residual, normalized_shape, eps,
                          residual_dtype, *params):
    """The add ops' composition, norm(input + residual): the sum in residual_dtype's sum
    dtype, one rounding (the kernels' sum), the norm's output in the input's dtype."""
    total = _residual_sum(input, residual, residual_dtype, len(normalized_shape))
    out = _torch_norm_over_ragged(fn, torch_fn, total, normalized_shape, *params, eps)
    _warn_fallback(input.device.type, f"input + residual, then torch.nn.functional."
                   f"{torch_fn.__name__}", _RAGGED_REASON, 7)
    return out.to(input.dtype), total


def _over_ragged_add_layer_norm(input, residual, normalized_shape, weight, bias, eps,
                                zero_centered_weight=False, residual_dtype=None,
                                dropout_p=0.0, rowscale=None):
    fn = "fusednorm.add_layer_norm"
    _refuse_over_ragged(fn, input, normalized_shape, weight=weight, bias=bias)
    _check_add_layer_norm_call(input, residual, normalized_shape, None, None, eps,
                               zero_centered_weight, residual_dtype, dropout_p, rowscale)
    _refuse_over_ragged(fn, input, normalized_shape, dropout_p=dropout_p, rowscale=rowscale)
    return _over_ragged_add_norm(fn, torch.nn.functional.layer_norm, input, residual,
                                 normalized_shape, eps, residual_dtype, None, None)


def _over_ragged_add_rms_norm(input, residual, normalized_shape, weight, eps,
                              zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                              rowscale=None):
    fn = "fusednorm.add_rms_norm"
    _refuse_over_ragged(fn, input, normalized_shape, weight=weight)
    _check_add_rms_norm_call(input, residual, normalized_shape, None, eps,
                             zero_centered_weight, residual_dtype, dropout_p, rowscale)
    _refuse_over_ragged(fn, input, normalized_shape, dropout_p=dropout_p, rowscale=rowscale)
    return _over_ragged_add_norm(fn, torch.nn.functional.rms_norm, input, residual,
                                 normalized_shape, eps, residual_dtype, None)


_OVER_RAGGED = {
    "layer_norm": _over_ragged_layer_norm,
    "rms_norm": _over_ragged_rms_norm,
    "add_layer_norm": _over_ragged_add_layer_norm,
    "add_rms_norm": _over_ragged_add_rms_norm,
}

_APPROXIMATE = ("none", "tanh")


def _check_ffn_tensors(fn: str, input, tensors: dict) -> None:
    """input is a floating tensor; each of `tensors` (name -> tensor or None) is None or a
    tensor on input's device with input's dtype."""
    if not isinstance(input, torch.Tensor):
        raise FusedTypeError(f"{fn}: input must be a Tensor, got {type(input).__name__}")
    _check_dense(fn, "input", input)
    if input.dtype not in _FLOAT_DTYPES:
        raise FusedTypeError(
            f"{fn}: input must be float32, float64, float16 or bfloat16, got {input.dtype}"
        )
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise FusedTypeError(f"{fn}: {name} must be a Tensor, got {type(t).__name__}")
        _check_dense(fn, name, t)
        if t.device != input.device:
            raise FusedValueError(f"{fn}: {name} is on {t.device} but input is on {input.device}")
        if t.dtype != input.dtype:
            raise FusedTypeError(
                f"{fn}: {name} must have the input's dtype ({input.dtype}), got {t.dtype}"
            )


def _check_gelu_ffn_args(fn: str, input, weight1, bias1, weight2, bias2, approximate) -> None:
    if not isinstance(approximate, str) or approximate not in _APPROXIMATE:
        raise FusedValueError(f"{fn}: approximate must be 'none' or 'tanh', got {approximate!r}")
    if weight1 is None or weight2 is None:
        raise FusedTypeError(f"{fn}: weight1 and weight2 must be Tensors, got None")
    _check_ffn_tensors(
        fn, input,
        {"weight1": weight1, "bias1": bias1, "weight2": weight2, "bias2": bias2},
    )
    if input.dim() < 1:
        raise FusedValueError(
            f"{fn}: input must have at least one dim (the features), got a scalar")
    in_features = input.shape[-1]
    if weight1.dim() != 2 or weight1.shape[1] != in_features:
        raise FusedValueError(
            f"{fn}: weight1 must have shape [hidden, {in_features}] to match input of shape "
            f"{list(input.shape)}, got {list(weight1.shape)}"
        )
    hidden = weight1.shape[0]
    if weight2.dim() != 2 or weight2.shape[1] != hidden:
        raise FusedValueError(
            f"{fn}: weight2 must have shape [out_features, {hidden}] to match weight1 of shape "
            f"{list(weight1.shape)}, got {list(weight2.shape)}"
        )
    for name, bias, size in (("bias1", bias1, hidden), ("bias2", bias2, weight2.shape[0])):
        if bias is not None and tuple(bias.shape) != (size,):
            raise FusedValueError(f"{fn}: {name} must have shape [{size}], got {list(bias.shape)}")


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for device_type; False for a device type autocast does not
    know (meta, where torch.is_autocast_enabled raises)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_linear_dtype(device_type: str, tensors: list) -> list:
    """Under autocast, torch.nn.functional.linear runs in the autocast dtype (float16 or
    bfloat16) whatever its inputs' dtypes; the FFN does the same."""
    if not _autocast_on(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in tensors]


def _autocast_ffn_args(input, *tensors) -> list:
    """The reference path's autocast rule, nn.Linear's: every floating tensor in the
    autocast dtype (the compiled op has this rule in C++)."""
    if isinstance(input, torch.Tensor):
        return _autocast_linear_dtype(input.device.type, [input, *tensors])
    return [input, *tensors]


def _check_gelu_ffn_call(input, weight1, bias1, weight2, bias2, approximate) -> None:
    fn = "fusednorm.gelu_ffn"
    _check_ffn_tensors(fn, input, {})
    _check_gelu_ffn_args(fn, *_autocast_ffn_args(input, weight1, bias1, weight2, bias2), approximate)


def gelu_ffn(
    input: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str = "none",
) -> torch.Tensor:
    """linear(gelu(linear(input, weight1, bias1), approximate=approximate), weight2, bias2):
    the result of nn.Sequential(nn.Linear, nn.GELU(approximate), nn.Linear) over the last
    dim of input, computed by fusednorm's fused kernels.

    weight1 is [hidden, in_features], weight2 [out_features, hidden] (nn.Linear layout);
    biases may be None. All tensors share input's dtype and device (under autocast they are
    cast to the autocast dtype, as nn.Linear's are). approximate is 'none' (exact, erf) or
    'tanh'. The backward keeps one [tokens, hidden] activation instead of eager's two.
    """
    return _call("gelu_ffn", (input, weight1, bias1, weight2, bias2, approximate), 1,
                 _check_gelu_ffn_call, "gelu_ffn_fwd", _reference_gelu_ffn)


def _reference_gelu_ffn(input, weight1, bias1, weight2, bias2, approximate):
    _check_gelu_ffn_call(input, weight1, bias1, weight2, bias2, approximate)
    input, weight1, bias1, weight2, bias2 = _autocast_ffn_args(input, weight1, bias1, weight2, bias2)
    _warn_fallback(input.device.type)
    return reference.gelu_ffn(input, weight1, bias1, weight2, bias2, approximate, upcast=False)


def _check_layer_norm_gelu_ffn_call(
    input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate
) -> None:
    fn = "fusednorm.layer_norm_gelu_ffn"
    _check_ffn_tensors(fn, input, {})
    if _autocast_on(input.device.type):  # checked as its two parts
        _check_layer_norm_call(input, input.shape[-1:], ln_weight, ln_bias, eps)
        _check_gelu_ffn_call(input, weight1, bias1, weight2, bias2, approximate)
        return
    _check_gelu_ffn_args(fn, input, weight1, bias1, weight2, bias2, approximate)
    d = input.shape[-1]
    if weight2.shape[0] != d:
        raise FusedValueError(
            f"{fn}: weight2 must have shape [{d}, {weight1.shape[0]}] for the residual "
            f"connection to input of shape {list(input.shape)}, got {list(weight2.shape)}"
        )
    _check_layer_norm_args(input, (d,), ln_weight, ln_bias, eps, fn, ("ln_weight", "ln_bias"))


def layer_norm_gelu_ffn(
    input: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    eps: float,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str = "none",
) -> torch.Tensor:
    """input + gelu_ffn(layer_norm(input, [d], ln_weight, ln_bias, eps), weight1, bias1,
    weight2, bias2, approximate): the pre-LN transformer feed-forward sub-block, whose
    backward recomputes the LayerNorm output instead of keeping it. The LayerNorm weight and
    bias may be float32 for a float16/bfloat16 input; the FFN's tensors have input's dtype.
    Under autocast it runs as layer_norm then gelu_ffn, each with autocast's dtypes."""
    args = (input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate)
    return _call("layer_norm_gelu_ffn", args, 1, _check_layer_norm_gelu_ffn_call, "gelu_ffn_fwd",
                 _reference_layer_norm_gelu_ffn)


def _reference_layer_norm_gelu_ffn(*args):
    _check_layer_norm_gelu_ffn_call(*args)
    input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate = args
    if _autocast_on(input.device.type):
        normed = layer_norm(input, input.shape[-1:], ln_weight, ln_bias, eps)
        return input + gelu_ffn(normed, weight1, bias1, weight2, bias2, approximate)
    _warn_fallback(input.device.type)
    return reference.layer_norm_gelu_ffn(*args, upcast=False)


# torch's per-sample gradients (call_for_per_sample_grads, as DP-SGD uses them) hand the
# parameters in as ExpandedWeight, whose rules cover torch.nn.functional's layer_norm and
# linear but no fusednorm op: such calls compute with those functions, unfused, so each
# parameter gets its grad_sample as under nn.LayerNorm and nn.Linear. torch has no rule for
# rms_norm, so the RMSNorm ops raise ExpandedWeight's error, as F.rms_norm does.
def _per_sample_layer_norm(input, normalized_shape, weight, bias, eps,
                           zero_centered_weight=False):
    if zero_centered_weight:
        raise FusedTypeError(
            "fusednorm.layer_norm: zero_centered_weight=True has no per-sample gradients "
            "(ExpandedWeight): torch's rule expands weight itself, not 1 + weight")
    return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


def _per_sample_add_layer_norm(input, residual, normalized_shape, weight, bias, eps,
                               zero_centered_weight=False, residual_dtype=None, dropout_p=0.0,
                               rowscale=None):
    total = _residual_sum(input, residual, residual_dtype, len(normalized_shape), dropout_p,
                          rowscale)
    out = _per_sample_layer_norm(total, normalized_shape, weight, bias, eps,
                                 zero_centered_weight)
    return out.to(input.dtype), total


def _per_sample_gelu_ffn(input, weight1, bias1, weight2, bias2, approximate="none"):
    # the eager reference is F.linear -> F.gelu -> F.linear, which ExpandedWeight covers
    return reference.gelu_ffn(input, weight1, bias1, weight2, bias2, approximate, upcast=False)


def _per_sample_layer_norm_gelu_ffn(input, ln_weight, ln_bias, eps, weight1, bias1, weight2,
                                    bias2, approximate="none"):
    normed = _per_sample_layer_norm(input, input.shape[-1:], ln_weight, ln_bias, eps)
    return input + _per_sample_gelu_ffn(normed, weight1, bias1, weight2, bias2, approximate)


_PER_SAMPLE = {
    "layer_norm": _per_sample_layer_norm,
    "add_layer_norm": _per_sample_add_layer_norm,
    "gelu_ffn": _per_sample_gelu_ffn,
    "layer_norm_gelu_ffn": _per_sample_layer_norm_gelu_ffn,
}
