"""fusednorm under tensor and sequence parallelism (DTensor): the sharding rule of every
fusednorm op that DTensor dispatches, and tp_plan(), the tensor-parallel plan of the FFN
modules.

Importing this module registers the rules (`import fusednorm` does it when
torch.distributed.tensor is already imported). The rules, per mesh dimension:

- norms (layer_norm, rms_norm, add_layer_norm, add_rms_norm): input (and residual) sharded
  on one dim outside normalized_shape, weight and bias replicated -> outputs sharded the
  same way. Anything else is redistributed to that or to all-replicated, as PyTorch's own
  native_layer_norm rule does (an input sharded inside normalized_shape is gathered).
- their backward (the backend ops the C++ autograd nodes call on [M, N] rows): rows
  sharded, parameters replicated -> weight and bias gradients Partial(sum), reduced by
  DTensor where the parameter's placement asks (as for nn.LayerNorm under
  SequenceParallel); a Partial incoming gradient stays Partial (the backward is linear in it;
  the add ops' two incoming gradients are then both taken Partial).
- gelu_ffn: rows sharded with replicated weights, or the tensor-parallel layout of
  ColwiseParallel fc1 / RowwiseParallel fc2 (weight1, bias1 Shard(0); weight2 Shard(1);
  input replicated) -> output Partial(sum), computed by the fused kernel on the local
  hidden shard.
- layer_norm_gelu_ffn: computed as its two fused parts, layer_norm then gelu_ffn, plus the
  residual (a Partial FFN output cannot carry the residual inside one kernel).

The per-row statistics (mean, rstd, the FFN's pre-activation) are [rows] tensors: for an
input sharded on dim d > 0 they are _StridedShard(0), the layout DTensor gives the same
flattening of the input's leading dims (their full_tensor() is in row order).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate, Shard,
                                      distribute_tensor)
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from . import ops
from .modules import FusedGeluFFN, FusedLayerNormGeluFFN

__all__ = ["FFN_MODULES", "FFNBoundary", "tp_plan"]

R = Replicate()
SUM = Partial("sum")

# Roles of an op's arguments and outputs in its rules, one letter each:
#   x  a tensor of the input's shape (sharded with it)   r  [rows, ...] rows of the input
#   s  a per-row statistic or [0] ("not computed")        p  a parameter (replicated)
#   g  a parameter's gradient (Partial, [0] replicated)   .  not a tensor
# An argument that is None gets no placement (None), as DTensor expects.


def _rows_placement(shape: Sequence[int], dim: int) -> Placement:
    """The placement of `shape`'s leading dims flattened into rows when `dim` is sharded:
    what DTensor's view gives (Shard(0) when every dim before `dim` has size 1)."""
    split = math.prod(shape[:dim])
    return Shard(0) if split == 1 else _StridedShard(0, split_factor=split)


def _spec(arg):
    """The DTensorSpec of a tensor argument (DTensor passes each as an OpStrategy)."""
    return arg.strategies[0].output_spec if isinstance(arg, OpStrategy) else arg


def _assign(roles: str, values: Sequence, placement_of) -> list:
    return [None if value is None or role == "." else placement_of(role, value)
            for role, value in zip(roles, values)]


def _rule(out_roles: str, arg_roles: str, args: Sequence, by_role: dict) -> list:
    """One single-mesh-dim rule: the placements of the outputs, then of every argument.
    An empty ([0]) statistic or gradient is replicated."""
    def place(role, value):
        if role in "sg" and getattr(value, "shape", (1,)) == (0,):
            return R
        return by_role[role]
    outs = [by_role[role] for role in out_roles]
    return outs + _assign(arg_roles, args, place)


def _no_dim_sharded_twice(input_specs, output_specs) -> bool:
    """Rules are per mesh dim; two mesh dims sharding one tensor dim, or the rows (the dims
    before the last) of one tensor, nest in an order these rules do not track (the row
    statistics' placements, the backward's row views), so DTensor redistributes such inputs
    instead: an input and residual sharded on different leading dims are not brought to
    one shard on each mesh dim."""
    for spec in input_specs:
        dims = [p.dim for p in spec.placements if isinstance(p, (Shard, _StridedShard))]
        if len(dims) != len(set(dims)) or sum(d < len(spec.shape) - 1 for d in dims) > 1:
            return False
    return True


def _register(op, static_argnum: int, rules_fn) -> None:
    """Registers rules_fn(*args) -> [single-mesh-dim rule] (plus the all-replicated rule)
    as op's DTensor strategy, expanded over every mesh dim.

    DTensor's op-strategy registration rather than register_sharding: register_sharding
    marks only int arguments static, so a list such as normalized_shape would not be part
    of DTensor's sharding cache key, and layer_norm over [D] and over [S, D] of one input
    would share the first call's rule."""
    n_out = len(op._schema.returns)

    def strategy(op_schema: OpSchema):
        args = [_spec(a) for a in op_schema.args_schema]
        replicated = [R] * n_out + [R if hasattr(a, "placements") else None for a in args]
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, [*rules_fn(*args), replicated],
            input_index=n_out, full_mesh_strategy_filter=_no_dim_sharded_twice)

    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
        op, strategy, RuntimeSchemaInfo(static_argnum, needs_pytree=True))


def _check_even(op: str, spec, axis: int) -> None:
    """The C++ backward views the leading `axis` dims as rows, which DTensor refuses for an
    uneven shard of one of several leading dims: refused here, before the forward."""
    if axis < 2 or not hasattr(spec, "placements"):
        return
    for mesh_dim, p in enumerate(spec.placements):
        if type(p) is Shard and p.dim < axis and spec.shape[p.dim] % spec.mesh.size(mesh_dim):
            raise ValueError(
                f"fusednorm.{op}: input placement {p!r} on mesh dim {mesh_dim} splits dim "
                f"{p.dim} (size {spec.shape[p.dim]}) unevenly over {spec.mesh.size(mesh_dim)} "
                "ranks; fusednorm's backward views the leading dims as rows, which DTensor "
                "does only for even shards: make that size a multiple of the mesh size, or "
                "distribute the input as [rows, features] (its leading dims flattened "
                "first), whose uneven shards of rows work")


def _norm_rules(op: str, out_roles: str, arg_roles: str, shape_arg: int):
    """Public norm ops: input (and residual) sharded on any dim before normalized_shape.
    The add ops' dropout and rowscale are refused: each shard would draw the mask of its
    local rows, the same one on every rank."""
    dropout_at = arg_roles.find("d")
    arg_roles = arg_roles.replace("d", ".")

    def rules(*args):
        given = args[dropout_at:dropout_at + 2] if dropout_at >= 0 else ()
        if (len(given) > 0 and given[0] > 0) or (len(given) > 1 and given[1] is not None):
            raise NotImplementedError(
                f"fusednorm.{op}: dropout_p > 0 and rowscale are not supported for DTensor "
                "inputs (the mask would repeat on every shard); apply dropout before the op")
        shape = args[0].shape
        axis = len(shape) - len(args[shape_arg])
        for role, arg in zip(arg_roles, args):
            if role == "x":
                _check_even(op, arg, axis)
        return [_rule(out_roles, arg_roles, args,
                      {"x": Shard(d), "s": _rows_placement(shape, d), "p": R, "R": R})
                for d in range(axis)]
    return rules


def _row_placements(spec) -> list[Placement]:
    """Placements of [M, N] rows to offer: the input's own strided one if it has one (rows
    of a sequence-sharded input), else Shard(0). Offered both, DTensor's cost model took
    Shard(0) for _StridedShard inputs on 4 ranks, a layout the rows' view back to the
    input's shape then refused."""
    found = [p for p in spec.placements if isinstance(p, _StridedShard) and p.dim == 0]
    return list(dict.fromkeys(found)) or [Shard(0)]


def _partial(spec) -> bool:
    return any(isinstance(p, Partial) for p in getattr(spec, "placements", ()))


def _row_rules(out_roles: str, arg_roles: str, rows_arg: int, linear_in: tuple[int, ...] = ()):
    """Backend ops over [M, N] rows: rows sharded alike, parameters replicated, parameter
    gradients Partial. `linear_in`: the op is linear in those arguments (the incoming
    gradients) together, so Partial ones with everything else replicated give Partial
    outputs. Every one of them is Partial in that rule: a term of a replicated one (norm_bwd
    adds grad_sum to the input's gradient) would be counted once per rank in the sum."""
    def rules(*args):
        out = [_rule(out_roles, arg_roles, args, {"r": p, "s": p, "p": R, "g": SUM})
               for p in _row_placements(args[rows_arg])]
        # Offered only for a Partial incoming gradient: DTensor's costs do not tell that a
        # row-sharded one cannot become Partial (a _StridedShard -> Partial redistribution
        # is refused on 2-D meshes), and a replicated one is better served replicated.
        if any(_partial(args[i]) for i in linear_in):
            roles = "".join("L" if i in linear_in else ("." if c == "." else "R")
                            for i, c in enumerate(arg_roles))
            out.append(_rule(out_roles.replace("r", "g").replace("s", "g"), roles, args,
                             {"g": SUM, "L": SUM, "R": R}))
        return out
    return rules


def _gelu_ffn_rules(*args):
    """gelu_ffn(input, weight1, bias1, weight2, bias2, approximate) -> (out, hidden)."""
    shape = args[0].shape
    _check_even("gelu_ffn", args[0], len(shape) - 1)
    rules = [_rule("xs", "xpppp.", args, {"x": Shard(d), "s": _rows_placement(shape, d), "p": R})
             for d in range(len(shape) - 1)]
    # hidden = x W1^T + b1 sharded on the hidden dim; out = the local hidden shard's share
    # of gelu(hidden) W2^T, plus bias2 as Partial (DTensor splits a replicated one).
    rules.append(_rule("PH", "RABCP.", args,
                       {"P": SUM, "H": Shard(1), "R": R, "A": Shard(0), "B": Shard(0),
                        "C": Shard(1)}))
    return rules


def _gelu_ffn_bwd_rules(*args):
    """gelu_ffn_bwd(grad_out, input, hidden, weight1, weight2, has_bias1, has_bias2, approx)
    -> (grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2)."""
    has_b1 = args[5]
    rules = _row_rules("rgggg", "rrrpp...", 1, linear_in=(0,))(*args)
    rules.append([SUM, Shard(0), Shard(0) if has_b1 else R, Shard(1), R,
                  R, R, Shard(1), Shard(0), Shard(1), None, None, None])
    return rules


def _layer_norm_gelu_ffn(op_call, args, kwargs):
    """DTensor's handler of layer_norm_gelu_ffn (called below autograd: its C++ backward
    node is already recorded, and reads these outputs): its two fused parts and the
    residual, each through its own rule."""
    names = [a.name for a in op_call._schema.arguments]
    values = [*args, *(kwargs[name] for name in names[len(args):] if name in kwargs)]
    input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate = values
    normed, mean, rstd = ops.LAYER_NORM(input, input.shape[-1:], ln_weight, ln_bias, eps)
    out, hidden = ops.GELU_FFN(normed, weight1, bias1, weight2, bias2, approximate)
    return input + out, mean, rstd, hidden


# The activations of each public op (argument positions) and where its normalized_shape is
# (None: the FFN ops, over the last dim).
_ACTIVATIONS = {"layer_norm": ((0,), 1), "rms_norm": ((0,), 1), "add_layer_norm": ((0, 1), 2),
                "add_rms_norm": ((0, 1), 2), "gelu_ffn": ((0,), None),
                "layer_norm_gelu_ffn": ((0,), None)}


def _one_mesh_dim(placements: Sequence[Placement], axis: int) -> list[Placement]:
    """`placements` with at most one mesh dim not replicated: the first that shards one of
    the `axis` leading dims (the rows) kept, every other replicated (Partial reduced)."""
    kept = next((i for i, p in enumerate(placements)
                 if type(p) is Shard and p.dim < axis), None)
    return [p if i == kept else R for i, p in enumerate(placements)]


def _layout(name: str, args: tuple) -> tuple:
    """DTensor activations on a mesh of 2+ dims that more than one mesh dim shards or
    reduces are redistributed (differentiably, before the op's autograd node saves them) to
    one mesh dim sharding their rows: the rules are per mesh dim, and rows sharded over two
    mesh dims nest in an order the row statistics and the backward's views of the saved
    input cannot follow (a wrong result, or an error, otherwise)."""
    spec = _ACTIVATIONS.get(name)
    if spec is None:
        return args
    positions, shape_at = spec
    out = None
    for i in positions:
        t = args[i]
        if not isinstance(t, DTensor) or t.device_mesh.ndim < 2:
            continue
        if sum(not isinstance(p, Replicate) for p in t.placements) < 2:
            continue
        normalized = 1 if shape_at is None else len(args[shape_at])
        placements = [Shard(p.dim % t.ndim) if type(p) is Shard else p for p in t.placements]
        wanted = _one_mesh_dim(placements, t.ndim - normalized)
        if out is None:
            out = list(args)
        out[i] = t.redistribute(t.device_mesh, wanted)
    return args if out is None else tuple(out)


def _register_all() -> None:
    O = torch.ops.fusednorm
    # Public ops (their Autograd kernel runs first, then DTensor sees the op itself).
    _register(O.layer_norm.default, 1, _norm_rules("layer_norm", "xss", "x.pp..", 1))
    _register(O.rms_norm.default, 1, _norm_rules("rms_norm", "xs", "x.p..", 1))
    # d: dropout_p, then rowscale (refused); rng_state, empty then, replicated.
    _register(O.add_layer_norm.default, 2,
              _norm_rules("add_layer_norm", "xxssR", "xx.pp...d.", 2))
    _register(O.add_rms_norm.default, 2, _norm_rules("add_rms_norm", "xxsR", "xx.p...d.", 2))
    _register(O.gelu_ffn.default, 5, _gelu_ffn_rules)
    DTensor._op_dispatcher._custom_op_handlers[O.layer_norm_gelu_ffn.default] = _layer_norm_gelu_ffn
    # Backend ops that the C++ backward nodes call on [M, N] rows (the forward's backend
    # ops run inside the public ops' kernels, on local tensors: DTensor never sees them).
    _register(O.layer_norm_apply.default, 5, _row_rules("r", "rsspp", 0))
    # grad_x (the add ops' input gradient, [0] unless x_dtype) and rowscale follow the rows;
    # rng_state is replicated (under DTensor dropout is refused: both are None).
    # Linear in grad_out and grad_sum (the add ops' sum's gradient, added to the input's).
    _register(O.norm_bwd.default, 7, _row_rules("rggr", "rrrsspp...sp.", 2, linear_in=(0, 1)))
    _register(O.gelu_ffn_bwd.default, 5, _gelu_ffn_bwd_rules)

if ops.LAYER_NORM is not None:
    _register_all()
    from . import functional as _functional

    _functional._dtensor_layout = _layout


# --- tensor-parallel plan of the FFN modules ---

# The modules tp_plan serves.
FFN_MODULES = (FusedGeluFFN, FusedLayerNormGeluFFN)


def _check_layout(name: str, placement: Placement, ndim: int | None = None) -> Placement:
    """Activations enter and leave the FFN replicated or sharded on a dim other than the
    features (the last; with `ndim` unknown, only -1 is known to be it)."""
    last = -1 if ndim is None else ndim - 1
    if isinstance(placement, Replicate) or (
        type(placement) is Shard and (placement.dim if ndim is None else placement.dim % ndim) != last
    ):
        return placement
    raise ValueError(
        f"fusednorm.distributed.tp_plan: {name}={placement!r} is not supported: the FFN's "
        "input and output must be Replicate() or Shard(d) on a dim other than the last "
        "(the features)"
    )


class FFNBoundary(ParallelStyle):
    """The FFN module's own part of tp_plan(): its input redistributed from `input_layout`
    to replicated (the fused op reads fc1's shards of the hidden dim), its Partial output
    redistributed to `output_layout` (a local tensor unless use_local_output=False), and
    a FusedLayerNormGeluFFN's LayerNorm parameters replicated over the mesh."""

    def __init__(self, input_layout: Placement = R, output_layout: Placement = R,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layout = _check_layout("input_layout", input_layout)
        self.output_layout = _check_layout("output_layout", output_layout)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, FFN_MODULES):
            raise TypeError("fusednorm.distributed.tp_plan serves FusedGeluFFN and "
                            f"FusedLayerNormGeluFFN modules, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError("fusednorm.distributed.tp_plan: the tensor-parallel mesh must be "
                             f"1-D (a 2-D mesh's 'tp' dim), got {device_mesh.ndim}-D")
        norm = getattr(module, "norm", None)
        if norm is not None:
            for name, param in list(norm.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.data, device_mesh, [R],
                                                   src_data_rank=self.src_data_rank)
                    norm.register_parameter(name, nn.Parameter(replicated, param.requires_grad))

        def prepare_input(_module, inputs):
            (x, *rest) = inputs
            _check_layout("input_layout", self.input_layout, x.ndim)
            _check_layout("output_layout", self.output_layout, x.ndim)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False)
            return (x.redistribute(device_mesh, [R]), *rest)

        def prepare_output(_module, _inputs, out):
            out = out.redistribute(device_mesh, [self.output_layout])
            return out.to_local() if self.use_local_output else out

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        module._tp_hooks_bypassed = True
        return module


def tp_plan(fqn: str = "", *, sequence_parallel: bool = False, sequence_dim: int = 1,
            use_local_output: bool = True) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a FusedGeluFFN or FusedLayerNormGeluFFN at `fqn` (the
    module path in the model given to parallelize_module; wildcards as there, "" for the
    module itself): ColwiseParallel on fc1, RowwiseParallel on fc2, and FFNBoundary on the
    module, so the fused op runs on each rank's shard of the hidden dim.

    sequence_parallel=False: the input is replicated over the mesh and the output is
    all-reduced. True: input and output are sharded on `sequence_dim` (all-gather in,
    reduce-scatter out), as SequenceParallel norms around it expect."""
    layout = Shard(sequence_dim) if sequence_parallel else R
    join = (lambda name: f"{fqn}.{name}") if fqn else (lambda name: name)
    return {
        fqn: FFNBoundary(layout, layout, use_local_output),
        join("fc1"): ColwiseParallel(),
        join("fc2"): RowwiseParallel(),
    }
