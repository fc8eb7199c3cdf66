"""The ops on jagged nested tensors (torch.nested, layout=torch.jagged), as nn.LayerNorm
and nn.Linear take them: each row is normalized (or transformed) on its own, so an op over
trailing dims that leave out the ragged one runs on the tensor's packed values and its
outputs are wrapped with the input's offsets. Autograd flows through values() and the
wrapping, both differentiable views.

Normalized dims that include the ragged dim (each sequence normalized as a whole, as
nn.LayerNorm takes it) make rows of unequal lengths, which no kernel takes: an op with a
fallback for them (functional._OVER_RAGGED: PyTorch's own functions) is handed the nested
arguments themselves."""
from __future__ import annotations

import torch

from .errors import FusedTypeError, FusedValueError


def is_nested(input) -> bool:
    return isinstance(input, torch.Tensor) and input.is_nested


def on_values(name: str, args: tuple, outputs: int, trailing: int, call, over_ragged=None):
    """call(values_args) on the packed values of the nested tensors among args (input's
    structure: every nested argument must share input's offsets), its tensor outputs
    wrapped back as nested tensors of input's structure. trailing: the dims the op works
    over, the last of input's. Where they include the ragged dim (not the batch dim),
    over_ragged(*args) on the nested arguments when the op has one; else it raises."""
    fn = f"fusednorm.{name}"
    input = args[0]
    if input.layout != torch.jagged:
        raise FusedTypeError(f"{fn}: input is a nested tensor of layout {input.layout}; only "
                             "torch.jagged nested tensors are supported")
    ragged = input._ragged_idx
    if trailing > input.dim() - 1 - ragged:
        if over_ragged is None:
            raise FusedValueError(
                f"{fn}: the {trailing} normalized dim(s) of input (shape {tuple(input.shape)}) "
                f"must not include its ragged dim {ragged} or its batch dim")
        if trailing > input.dim() - 1:
            raise FusedValueError(
                f"{fn}: the {trailing} normalized dim(s) of input (shape {tuple(input.shape)}) "
                f"must not include its batch dim")
        for i, arg in enumerate(args):
            if i > 0 and is_nested(arg):
                _check_structure(fn, i, arg, input)
        return over_ragged(*args)
    offsets = input.offsets()
    values_args = []
    for i, arg in enumerate(args):
        if i > 0 and is_nested(arg):
            _check_structure(fn, i, arg, input)
            arg = arg.values()
        values_args.append(input.values() if i == 0 else arg)
    result = call(tuple(values_args))
    wrap = lambda values: torch.nested.nested_tensor_from_jagged(  # noqa: E731
        values, offsets, input.lengths(), jagged_dim=ragged,
        min_seqlen=input._maybe_min_seqlen, max_seqlen=input._maybe_max_seqlen)
    if outputs == 1:
        return wrap(result)
    return tuple(wrap(t) for t in result)


def _check_structure(fn: str, i: int, arg, input) -> None:
    """Argument i, a nested tensor, must be a jagged tensor of input's structure."""
    if arg.layout != torch.jagged or arg.offsets() is not input.offsets() \
            or arg._ragged_idx != input._ragged_idx:
        raise FusedValueError(f"{fn}: argument {i} is a nested tensor of another "
                              "structure than input's (a jagged tensor sharing "
                              "input's offsets is needed)")
