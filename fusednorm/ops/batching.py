"""torch.func.vmap rules for the forward ops, so that vmap (per-sample gradients with
vmap(grad(...)), batched inference) runs one fused call instead of functorch's fallback, which
calls the op once per batch element and warns about it.

Every op normalizes (or transforms) rows independently with the same parameters, so a batch
dimension on the data only (input, residual) folds into the rows: move it to the front and
call the op once; each output has it in front. With batched parameters (an ensemble of
models, torch.func.stack_module_state) the rows no longer share them: then one call per
batch element, stacked, whose results are those of the unbatched op bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._loader import PUBLIC_OPS
from ._library import OPS


def _batch_rule(op, data: Sequence[int]):
    """The vmap rule of `op` whose arguments at positions `data` are row data (the rest are
    parameters or non-tensors; a None among the data stays None)."""
    schema = op._schema
    names = [arg.name for arg in schema.arguments]
    dropout_at = names.index("dropout_p") if "dropout_p" in names else None
    # The add ops' rng_state: one (seed, offset) per call, not per batch element.
    unbatched_out = {i for i, ret in enumerate(schema.returns) if ret.name == "rng_state"}
    # Outputs over the rows flattened (mean, rstd, hidden_pre: [rows, ...]): a folded call's
    # rows are the batch's, whose leading dim is split back into [batch, rows of one], the
    # unbatched op's shape (so that an outer vmap finds what it batched: nested vmap).
    per_row_out = {i for i, ret in enumerate(schema.returns)
                   if ret.name not in ("out", "sum", "rng_state")}
    # The dims a row spans: normalized_shape's, or the FFN ops' last.
    shape_at = names.index("normalized_shape") if "normalized_shape" in names else None

    def rule(info, in_dims, *args):
        batch = info.batch_size
        dropout_p = args[dropout_at] if dropout_at is not None and dropout_at < len(args) else 0
        if dropout_p > 0 and info.randomness != "different":
            # vmap's own rule for random ops: 'error' by default; 'same' (one mask for every
            # batch element) is not what one fused call over the folded rows draws.
            raise RuntimeError(
                f"vmap: fusednorm.{schema.name.split('::')[-1]} with dropout_p > 0 is a random "
                f"operation; under vmap it needs randomness='different' (got "
                f"{info.randomness!r})")
        # in_dims: an int for a batched tensor; None (or, for a list such as
        # normalized_shape, a list of Nones) otherwise.
        in_dims = [d if isinstance(d, int) else None for d in in_dims]
        params_batched = any(d is not None for i, d in enumerate(in_dims) if i not in data)
        if not params_batched:
            folded = list(args)
            for i in data:
                if i >= len(args) or args[i] is None:
                    continue
                if in_dims[i] is None:  # unbatched data beside batched: the same for each
                    folded[i] = args[i].expand(batch, *args[i].shape)
                else:
                    folded[i] = args[i].movedim(in_dims[i], 0)
            x = folded[data[0]]  # the input, batch in front
            trailing = len(args[shape_at]) if shape_at is not None else 1
            rows = math.prod(x.shape[1:x.dim() - trailing])
            outputs = tuple(t.reshape(batch, rows, *t.shape[1:]) if i in per_row_out else t
                            for i, t in enumerate(op(*folded)))
            return outputs, tuple(None if i in unbatched_out else 0 for i in range(len(outputs)))
        per_element = [
            op(*[a.select(d, b) if d is not None else a for a, d in zip(args, in_dims)])
            for b in range(batch)
        ]
        outputs = tuple(torch.stack(parts) for parts in zip(*per_element))
        return outputs, (0,) * len(outputs)

    return rule


# Op name -> positions of its row data: the arguments named input and residual (and the
# add ops' rowscale, one factor per row) of each public op's schema (csrc/op_table.h).
_DATA_ARGS = {
    name: tuple(i for i, arg in enumerate(getattr(OPS, name).default._schema.arguments)
                if arg.name in ("input", "residual", "rowscale"))
    for name in (PUBLIC_OPS if OPS is not None else ())
}

for _name, _data in _DATA_ARGS.items():
    torch.library.register_vmap(f"fusednorm::{_name}", _batch_rule(getattr(OPS, _name).default, _data))
