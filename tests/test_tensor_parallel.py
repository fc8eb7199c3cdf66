"""fusednorm under tensor and sequence parallelism (DTensor), 2-D FSDP2 x TP, FSDP2 with
mixed precision, DDP with static_graph, torch.compile, and torchtitan's composition
(activation checkpointing, torch.compile and FSDP2 per block): gloo processes on the CPU (and
NCCL on GPUs where there are), each run against one process
(tests/tensor_parallel_workers.py holds the scenarios).

The scenarios of one world size share one spawn: starting processes that import torch
is most of the time here.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with the gloo backend"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world, scenarios", [
    (2, ["ops", "modules", "ffn_modules", "gpt_tensor_parallel", "gpt_fsdp_bf16",
         "gpt_ddp_static_graph", "gpt_compiled_tensor_parallel", "gpt_titan"]),
    (4, ["ops", "modules", "ffn_modules", "gpt_tensor_parallel", "gpt_fsdp_tensor_parallel"]),
])
def test_against_one_process(world, scenarios):
    from tensor_parallel_workers import run

    run(scenarios, world)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="needs a CUDA device and NCCL")
def test_against_one_process_nccl():
    """The device path of every rule: NCCL, one process per GPU (up to 2)."""
    from tensor_parallel_workers import run

    world = min(torch.cuda.device_count(), 2)
    run(["ops", "modules", "ffn_modules", "gpt_tensor_parallel", "gpt_fsdp_bf16",
         "gpt_ddp_static_graph", "gpt_compiled_tensor_parallel"], world, device="cuda")


def test_ffn_plan_names_an_unsupported_placement():
    from torch.distributed.tensor import Partial, Shard

    from fusednorm.distributed import FFNBoundary, tp_plan

    with pytest.raises(ValueError, match=r"input_layout=Partial\(sum\)"):
        FFNBoundary(input_layout=Partial())
    with pytest.raises(ValueError, match=r"output_layout=Shard\(dim=-1\)"):
        FFNBoundary(output_layout=Shard(-1))
    with pytest.raises(ValueError, match=r"Shard\(dim=-1\)"):
        tp_plan("ffn", sequence_parallel=True, sequence_dim=-1)


def test_ffn_plan_serves_fusednorm_ffn_modules_only():
    from torch import nn

    from fusednorm.distributed import FFNBoundary

    with pytest.raises(TypeError, match="got Linear"):
        FFNBoundary()._apply(nn.Linear(4, 4), None)  # checked before the mesh is used


def test_tp_plan_keys():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fusednorm.distributed import FFNBoundary, tp_plan

    plan = tp_plan("blocks.*.ffn")
    assert list(plan) == ["blocks.*.ffn", "blocks.*.ffn.fc1", "blocks.*.ffn.fc2"]
    assert [type(s) for s in plan.values()] == [FFNBoundary, ColwiseParallel, RowwiseParallel]
    assert list(tp_plan()) == ["", "fc1", "fc2"]
