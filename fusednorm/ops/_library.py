"""What every op module needs: the loaded library's ops (None when it did not load), and
small helpers of the fake kernels."""
from __future__ import annotations

import math

import torch

from .. import _loader
from ..errors import OP_ERRORS, as_argument_error

OPS = torch.ops.fusednorm if _loader.AVAILABLE else None
# fusednorm._fast: direct entries into the same ops, about 2 us faster per call than
# torch.ops; each returns NotImplemented where the torch.ops path must decide (see
# fusednorm.functional). None when it is not loaded.
FAST = _loader.FAST_CALLS


def overload(name: str):
    """torch.ops.fusednorm.<name>.default, called directly (an OpOverload call skips the
    packet's overload resolution); None when the library is not loaded."""
    return getattr(OPS, name).default if OPS is not None else None


def register_fake(name: str):
    """torch.library.register_fake for fusednorm::<name>, a no-op without the library."""
    if OPS is None:
        return lambda fn: fn
    return torch.library.register_fake(f"fusednorm::{name}")


def require_library() -> None:
    if OPS is None:
        raise RuntimeError(f"fusednorm's compiled ops are not available: {_loader.LOAD_ERROR}")


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_stat(input: torch.Tensor, rows) -> torch.Tensor:
    """An empty [rows] statistic (mean or rstd) of input's rows."""
    return input.new_empty((rows,), dtype=stats_dtype(input.dtype))


def rng_state(input: torch.Tensor, dropout_p) -> torch.Tensor:
    """The add ops' dropout state: int64 (seed, offset) with dropout_p > 0, else empty."""
    return input.new_empty((2 if dropout_p > 0 else 0,), dtype=torch.int64)


def leading_rows(input: torch.Tensor, trailing_dims: int):
    """The number of rows when the last `trailing_dims` dims of input form a row."""
    return math.prod(input.shape[: input.dim() - trailing_dims])


def call_op(op, *args):
    """op(*args) for a Function's apply: an argument rejected by the op's checks raises
    fusednorm's error (a RuntimeError too), as through fusednorm.functional."""
    try:
        return op(*args)
    except OP_ERRORS as error:
        argument_error = as_argument_error(error)
        if argument_error is error:
            raise
        raise argument_error from None
