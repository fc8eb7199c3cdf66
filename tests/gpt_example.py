"""The example GPT of examples/gpt_model.py, importable from the tests, with a tiny
configuration and seeded token batches for it."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

from gpt_model import GPT, GPTConfig, GeluFFN, build_model  # noqa: E402

__all__ = ["EXAMPLES_DIR", "GPT", "GPTConfig", "GeluFFN", "TINY", "build_model", "token_batch"]

# Two blocks, so that every kind of layer appears more than once; small enough for
# torch.compile and multi-process tests on a two-core CPU.
TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)


def token_batch(batch_size: int, config: GPTConfig = TINY, seed: int = 0,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of random byte tokens, [batch_size, config.block_size] each."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
