"""Tensor + sequence parallelism and FSDP2 for the example GPT (examples/gpt_model.py) built
from fusednorm's modules, with torch.distributed's own APIs and fusednorm.distributed.tp_plan.

Between blocks the residual stream is a DTensor sharded on the sequence dim (Shard(1)):
the LayerNorms run on each rank's tokens (SequenceParallel), the FFN on each rank's shard
of the hidden dim (tp_plan: all-gather in, reduce-scatter out). Attention is kept whole on
every rank (its input gathered, its output sliced back): parallelizing its heads is not
fusednorm's business, and a plan for it is the same as for any PyTorch model.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import fusednorm.distributed


def tp_sp_plan(fused_ffn: bool = True) -> dict:
    """The parallelize_module plan of gpt_model.GPT over a 1-D tensor-parallel mesh;
    fused_ffn: its FFNs are fusednorm's (else gpt_model.GeluFFN: the same plan, spelled
    with PyTorch's styles, as its fc1 and fc2 run as modules)."""
    if fused_ffn:
        ffn = fusednorm.distributed.tp_plan("blocks.*.ffn", sequence_parallel=True,
                                            use_local_output=False)
    else:
        ffn = {"blocks.*.ffn.fc1": ColwiseParallel(input_layouts=Shard(1)),
               "blocks.*.ffn.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    return {
        # The embeddings run whole on every rank; the first block takes its tokens' share.
        "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                       use_local_output=False),
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False),
        "blocks.*.ln2": SequenceParallel(),
        **ffn,
        "ln_f": SequenceParallel(),
        # Logits over the whole vocabulary, replicated: the loss is the single-process one.
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def parallelize_gpt(model: nn.Module, tp_mesh: DeviceMesh | None = None,
                    dp_mesh: DeviceMesh | None = None, mp_policy=None) -> nn.Module:
    """Tensor + sequence parallelism over `tp_mesh`, then FSDP2 (fully_shard, each block and
    the root, with `mp_policy`) over `dp_mesh`; either may be None. In place; returns model."""
    if tp_mesh is not None:
        if model.config.block_size % tp_mesh.size():
            raise ValueError(f"block_size={model.config.block_size} must be a multiple of the "
                             f"tensor-parallel size {tp_mesh.size()} (sequence parallelism)")
        fused = isinstance(model.blocks[0].ffn, fusednorm.distributed.FFN_MODULES)
        parallelize_module(model, tp_mesh, tp_sp_plan(fused))
    if dp_mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = mp_policy or MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
