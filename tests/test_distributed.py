"""fusednorm's modules under DistributedDataParallel and FSDP2 (2 processes, gloo, CPU):
the same parameters after a few steps as one process trained on the whole batches.

fusednorm adds only plain parameters and ops, so PyTorch's engines treat its modules
exactly like nn.LayerNorm; these tests check that nothing in them gets in the way.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusednorm
from distributed_workers import make_model_and_optimizer, train, train_distributed, training_batches

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with the gloo backend"),
    pytest.mark.slow,  # each test starts two Python processes that import torch
]

STEPS, BATCH = 3, 8


def _single_process_state() -> dict[str, torch.Tensor]:
    model, optimizer = make_model_and_optimizer()
    assert any(isinstance(m, fusednorm.FusedLayerNorm) for m in model.modules())
    train(model, optimizer, training_batches(STEPS, BATCH))
    return model.state_dict()


def _assert_same_parameters(states: list[dict], expected: dict) -> None:
    initial = make_model_and_optimizer()[0].state_dict()
    for rank, state in enumerate(states):
        assert state.keys() == expected.keys()
        for name, value in state.items():
            # Gradients were summed in another order: float32 rounding, no more.
            torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
    changed = [n for n in expected if not torch.equal(expected[n], initial[n])]
    assert len(changed) == len(expected), "training left some parameters untouched"


def test_ddp_matches_single_process():
    states = train_distributed("ddp", training_batches(STEPS, BATCH))
    _assert_same_parameters(states, _single_process_state())


def _fully_shard_available() -> str | None:
    """Why FSDP2 cannot run here, or None."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as error:
        return f"this torch has no torch.distributed.fsdp.fully_shard ({error})"
    return None


@pytest.mark.skipif(_fully_shard_available() is not None, reason=str(_fully_shard_available()))
def test_fsdp2_matches_single_process():
    states = train_distributed("fsdp2", training_batches(STEPS, BATCH))
    _assert_same_parameters(states, _single_process_state())
