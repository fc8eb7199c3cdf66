"""fusednorm under DTensor (tensor and sequence parallelism), FSDP2 and DDP, run in
processes that torch.multiprocessing spawns (so this module must stay importable by name).

Every scenario below runs in each rank, computes the single-process result itself (the
same seeded tensors, whole) and asserts that the parallel one matches it; an assertion in
any rank fails the spawning test with that rank's traceback.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gpt_example  # noqa: F401  (puts examples/ on sys.path: gpt_model, gpt_parallel)
from distributed_workers import _free_port, run_rank

# float32 results of a parallel run against one process: sums in another order.
TOL = dict(atol=2e-5, rtol=1e-5)
LOSS_TOL = 1e-5
SCENARIOS: dict[str, Callable[[int, int], None]] = {}
DEVICE = "cpu"  # each worker sets its own: "cuda" with NCCL


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _random(*shape, seed: int, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(requires_grad)


# --- ops on DTensors ---------------------------------------------------------------------

def _check_op(name: str, fn, inputs: dict, placements: dict, mesh, grad_seed: int = 99,
              out_placement=None) -> None:
    """fn(**tensors) -> tuple of differentiable outputs, on full tensors and on DTensors
    with `placements` (name -> placement; the rest replicated): outputs and every
    gradient equal, and every output in `out_placement` if given."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    ref_out = fn(**inputs)
    grads_out = [_random(*o.shape, seed=grad_seed + i, requires_grad=False)
                 for i, o in enumerate(ref_out)]
    ref_grads = torch.autograd.grad(ref_out, list(inputs.values()), grads_out)

    dt = {k: distribute_tensor(v.detach(), mesh, [placements.get(k, Replicate())]).requires_grad_()
          for k, v in inputs.items()}
    out = fn(**dt)
    if out_placement is not None:
        assert all(o.placements == (out_placement,) for o in out), (
            f"{name}: outputs {[o.placements for o in out]}, not ({out_placement},)")
    for i, (o, r) in enumerate(zip(out, ref_out)):
        _close(_full(o), r, f"{name} output {i}")
    # Each output's gradient in the output's own placement, as autograd would bring it.
    grads = [distribute_tensor(g, mesh, o.placements) for g, o in zip(grads_out, out)]
    got = torch.autograd.grad(out, list(dt.values()), grads)
    for key, g, r, x in zip(dt, got, ref_grads, dt.values()):
        _close(_full(g), r, f"{name} grad of {key} ({x.placements})")


@scenario
def ops(rank: int, world: int) -> None:
    """Every public op with its input sharded on each dim outside the normalized ones, on
    the normalized dim (gathered), and the FFN's tensor-parallel layouts; uneven shards of
    [rows, features] inputs, and the error for an uneven one of several leading dims."""
    import fusednorm
    import fusednorm.distributed  # noqa: F401  (registers the rules)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from fusednorm.functional import layer_norm_gelu_ffn

    mesh = init_device_mesh(DEVICE, (world,))
    B, S, D, H = max(world, 2), 2 * world, 8, 12
    x = lambda s: _random(B, S, D, seed=s)  # noqa: E731
    w, b = _random(D, seed=3), _random(D, seed=4)
    norms = {
        "layer_norm": (lambda input, w, b: (fusednorm.layer_norm(input, (D,), w, b),),
                       dict(input=x(1), w=w, b=b)),
        "layer_norm 2 dims": (lambda input, w, b: (fusednorm.layer_norm(input, (S, D), w, b),),
                              dict(input=x(1), w=_random(S, D, seed=5), b=_random(S, D, seed=6))),
        "rms_norm": (lambda input, w: (fusednorm.rms_norm(input, (D,), w),), dict(input=x(1), w=w)),
        "add_layer_norm": (lambda input, residual, w, b: fusednorm.add_layer_norm(input, residual, (D,), w, b),
                           dict(input=x(1), residual=x(2), w=w, b=b)),
        "add_rms_norm": (lambda input, residual, w: fusednorm.add_rms_norm(input, residual, (D,), w),
                         dict(input=x(1), residual=x(2), w=w)),
        # residual_dtype reaches DTensor's rule as one more argument
        "add_rms_norm residual_dtype": (
            lambda input, residual, w: fusednorm.add_rms_norm(input, residual, (D,), w,
                                                              residual_dtype=torch.float32),
            dict(input=x(1), residual=x(2), w=w)),
        # a bfloat16 input beside the float32 sum: norm_bwd's grad_x (x_dtype) under the rule
        "add_layer_norm residual_dtype bfloat16": (
            lambda input, residual, w, b: fusednorm.add_layer_norm(
                input, residual, (D,), w, b, residual_dtype=torch.float32),
            dict(input=x(1).detach().bfloat16().requires_grad_(), residual=x(2), w=w, b=b)),
    }
    for name, (fn, inputs) in norms.items():
        sharded = [k for k in ("input", "residual") if k in inputs]
        normalized_dims = 2 if "2 dims" in name else 1
        for dim in range(3):  # 0, 1 outside normalized_shape (kept); 2 inside: gathered
            kept = Shard(dim) if dim < 3 - normalized_dims else None
            _check_op(f"{name} Shard({dim})", fn, inputs, {k: Shard(dim) for k in sharded}, mesh,
                      out_placement=kept)
        if normalized_dims == 1:  # input sequence-sharded, residual replicated: redistributed
            _check_op(f"{name} mixed", fn, inputs, {"input": Shard(1)}, mesh)
    # zero_centered_weight: 1 + weight is formed of the (replicated) DTensor weight by ATen
    # ops before the op; the input sequence-sharded (kept) and feature-sharded (gathered).
    zero_centered = {
        "layer_norm": (lambda input, w, b: (
            fusednorm.layer_norm(input, (D,), w, b, zero_centered_weight=True),),
            dict(input=x(1), w=w, b=b)),
        "rms_norm": (lambda input, w: (fusednorm.rms_norm(input, (D,), w, zero_centered_weight=True),),
                     dict(input=x(1), w=w)),
    }
    for name, (fn, inputs) in zero_centered.items():
        for dim in (1, 2):
            _check_op(f"{name} zero_centered_weight Shard({dim})", fn, inputs, {"input": Shard(dim)},
                      mesh, out_placement=Shard(dim) if dim == 1 else None)

    w1, b1 = _random(H, D, seed=7), _random(H, seed=8)
    w2, b2 = _random(D, H, seed=9), _random(D, seed=10)
    ffn = lambda input, w1, b1, w2, b2: (fusednorm.gelu_ffn(input, w1, b1, w2, b2),)  # noqa: E731
    ffn_inputs = dict(input=x(1), w1=w1, b1=b1, w2=w2, b2=b2)
    tp = {"w1": Shard(0), "b1": Shard(0), "w2": Shard(1)}
    block = lambda input, lw, lb, w1, b1, w2, b2: (  # noqa: E731
        layer_norm_gelu_ffn(input, lw, lb, 1e-5, w1, b1, w2, b2, "tanh"),)
    block_inputs = dict(input=x(1), lw=w, lb=b, w1=w1, b1=b1, w2=w2, b2=b2)
    for name, fn, inputs in (("gelu_ffn", ffn, ffn_inputs),
                             ("layer_norm_gelu_ffn", block, block_inputs)):
        for dim in range(2):
            _check_op(f"{name} Shard({dim})", fn, inputs, {"input": Shard(dim)}, mesh)
        _check_op(f"{name} tensor-parallel", fn, inputs, tp, mesh)
        _check_op(f"{name} tensor- and sequence-parallel", fn, inputs, {**tp, "input": Shard(1)}, mesh)
    _statistics_in_row_order(mesh)
    _partial_grad_of_normed_output(mesh)
    rows = _random(2 * world + 1, D, seed=11)  # one rank holds one row more
    for name, (fn, inputs) in (("layer_norm", norms["layer_norm"]), ("gelu_ffn", (ffn, ffn_inputs))):
        _check_op(f"{name} uneven rows", fn, {**inputs, "input": rows}, {"input": Shard(0)}, mesh)
    if world > 1:
        _uneven_leading_dim_raises(mesh)
    if world == 4:
        _two_mesh_dims()


def _two_mesh_dims() -> None:
    """A 2x2 mesh, the input sharded or reduced on both mesh dims (a batch- and
    sequence-sharded input, one dim over both, a pending sum beside a shard) or sequence-
    sharded on the second only: output and gradients of one process."""
    import fusednorm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE, (2, 2))
    D, H = 8, 8
    x, r = _random(4, 4, D, seed=1), _random(4, 4, D, seed=2)
    w, w1, w2 = _random(D, seed=3), _random(H, D, seed=4), _random(D, H, seed=5)
    y = [_random(4, 4, D, seed=s, requires_grad=False) for s in (6, 7)]
    calls = {
        "layer_norm": (lambda x, r, w, w1, w2: (fusednorm.layer_norm(x, (D,), w, w),)),
        "add_rms_norm": (lambda x, r, w, w1, w2: fusednorm.add_rms_norm(x, r, (D,), w)),
        "gelu_ffn": (lambda x, r, w, w1, w2: (fusednorm.gelu_ffn(x, w1, w, w2, w),)),
    }
    loss = lambda outs: sum((_full(o) * g).sum() for o, g in zip(outs, y))  # noqa: E731
    # (input's placements, the residual's when they differ)
    cases = [((Shard(0), Shard(1)), None), ((Shard(1), Shard(1)), None),
             ((Shard(0), Partial()), None), ((Replicate(), Shard(1)), None),
             # sharded on different leading dims: not joined as both, one per mesh dim
             ((Shard(0), Replicate()), (Shard(1), Replicate()))]
    for placements, residual_placements in cases:
        for name, fn in calls.items():
            if residual_placements is not None and name != "add_rms_norm":
                continue
            whole = (x, r, w, w1, w2)
            ref_out = fn(*whole)
            ref = torch.autograd.grad(loss(ref_out), whole, allow_unused=True)
            dt = []
            for i, t in enumerate(whole):
                if i > 1:
                    dt.append(distribute_tensor(t.detach(), mesh, [Replicate()] * 2).requires_grad_())
                elif isinstance(placements[1], Partial):  # half of the value on each rank of dim 1
                    local = distribute_tensor(t.detach(), mesh, [placements[0], Replicate()]).to_local()
                    dt.append(DTensor.from_local(local / 2, mesh, placements).detach().requires_grad_())
                else:
                    given = residual_placements if i == 1 and residual_placements else placements
                    dt.append(distribute_tensor(t.detach(), mesh, given).requires_grad_())
            out = fn(*dt)
            what = f"{name} {placements} residual {residual_placements or placements}"
            for i, (o, e) in enumerate(zip(out, ref_out)):
                _close(_full(o), e, f"{what} output {i}")
            for key, g, e in zip(("input", "residual", "weight", "weight1", "weight2"),
                                 torch.autograd.grad(loss(out), dt, allow_unused=True), ref):
                if e is not None:
                    _close(_full(g), e, f"{what} grad of {key}")


def _partial_grad_of_normed_output(mesh) -> None:
    """The add ops on replicated inputs, the normed output read by a column-parallel Linear
    (its gradient comes back Partial) and the sum by a replicated residual path (Replicate):
    the input's and residual's gradients are those of one process (the sum's gradient once,
    not once per rank)."""
    import fusednorm
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    world = mesh.size()
    x, r, w, b = (_random(2, 3, 8, seed=1), _random(2, 3, 8, seed=2), _random(8, seed=3),
                  _random(8, seed=4))
    grads = [_random(2, 3, 8, seed=s, requires_grad=False) for s in (5, 6)]
    dgrads = (DTensor.from_local(grads[0] / world, mesh, [Partial()]),
              distribute_tensor(grads[1], mesh, [Replicate()]))
    for name, fn in (("add_layer_norm", lambda x, r, w, b: fusednorm.add_layer_norm(x, r, (8,), w, b)),
                     ("add_rms_norm", lambda x, r, w, b: fusednorm.add_rms_norm(x, r, (8,), w))):
        ref = torch.autograd.grad(fn(x, r, w, b), (x, r, w), grads)
        dt = [distribute_tensor(t.detach(), mesh, [Replicate()]).requires_grad_() for t in (x, r, w, b)]
        got = torch.autograd.grad(fn(*dt), dt[:3], dgrads)
        for what, g, expected in zip(("input", "residual", "weight"), got, ref):
            _close(_full(g), expected, f"{name} grad of {what}, the output's gradient Partial")


def _uneven_leading_dim_raises(mesh) -> None:
    import fusednorm
    from torch.distributed.tensor import Shard, distribute_tensor

    for dim in (1, 0):  # the advice fits either (no "shard the first dim" for the first)
        shape = [2, 2, 8]
        shape[dim] = mesh.size() + 1
        x = distribute_tensor(_random(*shape, seed=1, requires_grad=False), mesh, [Shard(dim)])
        for call in (lambda: fusednorm.layer_norm(x, (8,)), lambda: fusednorm.add_rms_norm(x, x, (8,))):
            try:
                call()
            except RuntimeError as error:
                assert f"Shard(dim={dim})" in str(error) and "unevenly" in str(error) \
                    and "[rows, features]" in str(error), str(error)
            else:
                raise AssertionError("an uneven shard of a leading dim did not raise")


def _statistics_in_row_order(mesh) -> None:
    """mean and rstd of a sequence-sharded input gather to the single-process ones."""
    import fusednorm
    from torch.distributed.tensor import Shard, distribute_tensor

    x = _random(3, 2 * mesh.size(), 8, seed=1, requires_grad=False)
    ref = fusednorm.FusedLayerNormFunction.apply(x, (8,), None, None, 1e-5)
    out = fusednorm.FusedLayerNormFunction.apply(distribute_tensor(x, mesh, [Shard(1)]), (8,),
                                                 None, None, 1e-5)
    for i in range(3):
        _close(out[i].full_tensor(), ref[i], f"FusedLayerNormFunction output {i}")


@scenario
def modules(rank: int, world: int) -> None:
    """The issue's first attempts: fusednorm's norm modules under SequenceParallel, as
    nn.LayerNorm / nn.RMSNorm are, with the same output and parameter gradients."""
    import fusednorm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = init_device_mesh(DEVICE, (world,))
    for cls, torch_cls in ((fusednorm.FusedLayerNorm, nn.LayerNorm),
                           (fusednorm.FusedRMSNorm, nn.RMSNorm)):
        ref = cls(16, device=DEVICE)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(_random(*p.shape, seed=5, requires_grad=False))
        module = cls(16, device=DEVICE)
        module.load_state_dict(ref.state_dict())
        parallelize_module(module, mesh, SequenceParallel())
        x = _random(2, 2 * world, 16, seed=1, requires_grad=False)
        ref(x).square().sum().backward()
        out = module(distribute_tensor(x, mesh, [Shard(1)]))
        assert out.placements == (Shard(1),), out.placements
        out.square().sum().backward()
        _close(out.full_tensor(), ref(x), f"{cls.__name__} output")
        torch_module = parallelize_module(torch_cls(16, device=DEVICE), mesh, SequenceParallel())
        torch_module(distribute_tensor(x, mesh, [Shard(1)])).square().sum().backward()
        for (name, p), r, t in zip(module.named_parameters(), ref.parameters(),
                                   torch_module.parameters()):
            _close(p.grad.full_tensor(), r.grad, f"{cls.__name__}.{name} grad")
            # Reduced where PyTorch reduces its own norm's: the same placements.
            assert p.grad.placements == t.grad.placements, (p.grad.placements, t.grad.placements)


@scenario
def ffn_modules(rank: int, world: int) -> None:
    """FusedGeluFFN and FusedLayerNormGeluFFN under tp_plan, input and output replicated or
    sequence-sharded: output, input gradient and every parameter's gradient."""
    import fusednorm
    from fusednorm.distributed import tp_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(DEVICE, (world,))
    for cls in (fusednorm.FusedGeluFFN, fusednorm.FusedLayerNormGeluFFN):
        for sequence_parallel in (False, True):
            what = f"{cls.__name__} sequence_parallel={sequence_parallel}"
            torch.manual_seed(0)  # the same parameters in every rank
            ref = cls(8, 4 * world, device=DEVICE)
            module = cls(8, 4 * world, device=DEVICE)
            module.load_state_dict(ref.state_dict())
            parallelize_module(module, mesh, tp_plan(sequence_parallel=sequence_parallel))
            assert isinstance(module.fc1.weight, DTensor)
            x = _random(2, 2 * world, 8, seed=1)
            y = _random(2, 2 * world, 8, seed=2, requires_grad=False)
            (ref(x) * y).sum().backward()
            x_local = x.detach().clone()
            if sequence_parallel:
                x_local = distribute_tensor(x_local, mesh, [Shard(1)]).to_local()
            x_local.requires_grad_()
            out = module(x_local)  # local tensors in and out (use_local_output)
            assert not isinstance(out, DTensor)
            y_local = y.chunk(world, dim=1)[rank] if sequence_parallel else y
            (out * y_local).sum().backward()
            expected_out = ref(x).detach()
            if sequence_parallel:
                expected_out = expected_out.chunk(world, dim=1)[rank]
                grad = x.grad.chunk(world, dim=1)[rank]
            else:  # every rank's input is the whole one: each gets the whole gradient
                grad = x.grad
            _close(out, expected_out, f"{what} output")
            _close(x_local.grad, grad, f"{what} input grad")
            for (name, p), r in zip(module.named_parameters(), ref.parameters()):
                _close(_full(p.grad), r.grad, f"{what} {name} grad")
            assert any(n.startswith("fusednorm.") for n in _graph_nodes(out)), what

        # PyTorch's own plan for the two Linears: the module calls them with their hooks,
        # unfused, and gets the same result.
        torch.manual_seed(0)
        ref = cls(8, 4 * world, device=DEVICE)
        module = cls(8, 4 * world, device=DEVICE)
        module.load_state_dict(ref.state_dict())
        parallelize_module(module, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        x = _random(2, 3, 8, seed=3)
        out = module(x)
        assert not any(n.startswith("fusednorm.gelu") for n in _graph_nodes(out))
        _close(out, ref(x), f"{cls.__name__} under ColwiseParallel/RowwiseParallel")


def _graph_nodes(t) -> set[str]:
    """The names of the autograd nodes t was computed through."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node.name() in seen:
            continue
        seen.add(node.name())
        todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


# --- the example GPT, trained ------------------------------------------------------------

STEPS, BATCH, LR = 3, 8, 0.1


def _gpt(config=None):
    from gpt_example import TINY, build_model

    return build_model(config or TINY, "fused", seed=0, device=DEVICE)


def _sgd(model):
    # foreach=False: plain and DTensor parameters side by side (attention stays whole).
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)


def _train_against_single_process(model, optimizer, shard: Callable, dp_group=None,
                                  loss_tol: float = LOSS_TOL, check_grads: bool = True,
                                  config=None) -> None:
    """STEPS steps of `model` on shard(batch) against one process on whole batches: the
    loss of every step (averaged over `dp_group`) and, after the first backward, every
    parameter's gradient."""
    from gpt_example import TINY, token_batch

    ref = _gpt(config)
    ref_optimizer = _sgd(ref)
    for step in range(STEPS):
        x, y = token_batch(BATCH, config or TINY, seed=step, device=DEVICE)
        ref_logits, ref_loss = ref(x, y)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        logits, loss = model(*shard(x, y))
        optimizer.zero_grad()
        loss.backward()
        loss = loss.detach().float()
        if dp_group is not None:
            dist.all_reduce(loss, dist.ReduceOp.AVG, group=dp_group)
        assert abs(loss.item() - ref_loss.item()) <= loss_tol, (
            f"step {step}: loss {loss.item()} against {ref_loss.item()} in one process")
        if step == 0 and check_grads:
            named = {_unwrapped(n): p for n, p in model.named_parameters()}
            for name, r in ref.named_parameters():
                name = name if name in named else f"module.{name}"  # DDP's wrapper
                _close(_full(named[name].grad), r.grad, f"grad of {name}")
        ref_optimizer.step()
        optimizer.step()


def _unwrapped(name: str) -> str:
    """A parameter's name without the levels that torch.compile (_orig_mod) and
    checkpoint_wrapper (_checkpoint_wrapped_module) put around a module."""
    return ".".join(part for part in name.split(".")
                    if part not in ("_orig_mod", "_checkpoint_wrapped_module"))


def _dp_share(rank: int, size: int):
    return lambda x, y: (x.chunk(size)[rank], y.chunk(size)[rank])


@scenario
def gpt_tensor_parallel(rank: int, world: int) -> None:
    """TP + SP over every rank (tp_plan on the FFNs, SequenceParallel on the norms)."""
    from torch.distributed.device_mesh import init_device_mesh
    from gpt_parallel import parallelize_gpt

    model = parallelize_gpt(_gpt(), tp_mesh=init_device_mesh(DEVICE, (world,)))
    _train_against_single_process(model, _sgd(model), lambda x, y: (x, y))


@scenario
def gpt_fsdp_tensor_parallel(rank: int, world: int) -> None:
    """A 2-D mesh: FSDP2 over "dp", TP + SP over "tp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from gpt_parallel import parallelize_gpt

    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(_gpt(), tp_mesh=mesh["tp"], dp_mesh=mesh["dp"])
    dp = mesh["dp"]
    _train_against_single_process(model, _sgd(model), _dp_share(dp.get_local_rank(), dp.size()),
                                  dp_group=dp.get_group())


@scenario
def gpt_fsdp_bf16(rank: int, world: int) -> None:
    """FSDP2 with bfloat16 parameters and float32 gradient reduction: fusednorm runs in
    bfloat16; losses within bfloat16's rounding of one float32 process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from gpt_parallel import parallelize_gpt

    mesh = init_device_mesh(DEVICE, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize_gpt(_gpt(), dp_mesh=mesh, mp_policy=policy)
    seen = []
    model.blocks[0].ln1.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    _train_against_single_process(model, _sgd(model), _dp_share(rank, world),
                                  dp_group=dist.group.WORLD, loss_tol=3e-2, check_grads=False)
    assert seen[0] == (torch.bfloat16, torch.bfloat16), seen[0]
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@scenario
def gpt_ddp_static_graph(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_gpt(), static_graph=True)
    _train_against_single_process(model, _sgd(model), _dp_share(rank, world),
                                  dp_group=dist.group.WORLD)


@scenario
def gpt_compiled_tensor_parallel(rank: int, world: int) -> None:
    """TP + SP, every block compiled with fullgraph=True (any graph break raises), as
    torchtitan compiles its blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from gpt_example import GPTConfig
    from gpt_parallel import parallelize_gpt

    config = GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=16)
    model = parallelize_gpt(_gpt(config), tp_mesh=init_device_mesh(DEVICE, (world,)))
    for block in model.blocks:
        block.compile(fullgraph=True, backend="aot_eager")  # in place: the same names
    _train_against_single_process(model, _sgd(model), lambda x, y: (x, y), config=config)


def _recording(backend: str, seen: set):
    """torch.compile backend `backend` that first adds to `seen` the targets of every
    call in the graphs dynamo hands it (subgraphs of higher-order ops included)."""
    from torch._dynamo import lookup_backend

    def compile_fn(gm, example_inputs):
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                seen.update(str(n.target) for n in module.graph.nodes if n.op == "call_function")
        return lookup_backend(backend)(gm, example_inputs)

    return compile_fn


def _titan(model, mesh, mp_policy=None, backend: str = "aot_eager") -> set:
    """torchtitan's composition: each block activation-checkpointed (checkpoint_wrapper,
    non-reentrant, preserve_rng_state=False), then compiled whole with fullgraph=True (any
    graph break raises), then FSDP2 on each block and on the root. In place; returns the
    set that collects the compiled graphs' call targets."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    seen: set = set()
    compile_fn = _recording(backend, seen)  # one for every block: no recompilation
    for i, block in enumerate(model.blocks):
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        model.blocks[i] = torch.compile(block, backend=compile_fn, fullgraph=True)
    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return seen


TITAN_CONFIG = dict(block_size=8, n_layer=2, n_head=2, d_model=16)


@scenario
def gpt_titan(rank: int, world: int) -> None:
    """torchtitan's per-block activation checkpointing, torch.compile(fullgraph=True) and
    FSDP2 (_titan), the fused norms and FFNs inside the checkpointed compiled blocks: in
    float32 (losses and gradients), then with bfloat16 parameters and float32 gradient
    reduction (losses within bfloat16's rounding of one float32 process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from gpt_example import GPTConfig

    config = GPTConfig(**TITAN_CONFIG)
    mesh = init_device_mesh(DEVICE, (world,))
    model = _gpt(config)
    seen = _titan(model, mesh)
    _train_against_single_process(model, _sgd(model), _dp_share(rank, world),
                                  dp_group=dist.group.WORLD, config=config)
    assert "tag_activation_checkpoint" in seen, sorted(seen)
    for op in ("fusednorm.layer_norm.default", "fusednorm.gelu_ffn.default"):
        assert op in seen, f"{op} not in the compiled blocks: {sorted(seen)}"

    model = _gpt(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _titan(model, mesh, mp_policy=policy)
    _train_against_single_process(model, _sgd(model), _dp_share(rank, world),
                                  dp_group=dist.group.WORLD, loss_tol=3e-2, check_grads=False,
                                  config=config)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


# --- spawning ----------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, names: list[str], device: str) -> None:
    global DEVICE
    DEVICE = device
    if device == "cuda":
        torch.cuda.set_device(rank)

    def body() -> None:
        for name in names:
            SCENARIOS[name](rank, world)

    run_rank(rank, world, port, "nccl" if device == "cuda" else "gloo", body)


def run(names: list[str], world: int, device: str = "cpu") -> None:
    """Runs the scenarios `names` in `world` processes (gloo on the CPU, NCCL with one GPU
    each on "cuda"); raises what a rank raised."""
    mp.spawn(_worker, args=(world, _free_port(), names, device), nprocs=world, join=True)
