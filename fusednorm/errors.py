"""The exceptions fusednorm raises for a bad argument.

Each is both the Python exception that names the kind of mistake (TypeError: a wrong Python
type or dtype; ValueError: a wrong shape, value or device) and RuntimeError, which is what
PyTorch raises for most of the same bad calls: code written around nn.LayerNorm or
F.layer_norm with `except RuntimeError` catches fusednorm's errors too.
"""
from __future__ import annotations


class FusedTypeError(TypeError, RuntimeError):
    """An argument of the wrong Python type or dtype."""


class FusedValueError(ValueError, RuntimeError):
    """An argument of the wrong shape, value or device."""


# What a compiled op raises for a bad argument: TORCH_CHECK_TYPE / TORCH_CHECK_VALUE reach
# Python as plain TypeError / ValueError, TORCH_CHECK and the schema's checks as RuntimeError.
OP_ERRORS = (RuntimeError, ValueError, TypeError)

_DUAL = {TypeError: FusedTypeError, ValueError: FusedValueError}


def as_argument_error(error: BaseException) -> BaseException:
    """A compiled op's plain TypeError / ValueError as FusedTypeError / FusedValueError with
    the same message and traceback; any other exception as it is."""
    dual = _DUAL.get(type(error))
    if dual is None:
        return error
    return dual(*error.args).with_traceback(error.__traceback__)
