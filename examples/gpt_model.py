"""A small GPT-style language model whose LayerNorm and feed-forward classes are arguments.

Every block is pre-LN: x + attn(ln1(x)), then x + ffn(ln2(x)); a final LayerNorm feeds the
output head. The model never names a LayerNorm or FFN class itself: `norm_layer` and
`ffn_layer` are constructor arguments, so swapping in fusednorm's modules changes nothing
else (same submodule names, parameters, state_dict keys and initialisation).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    ffn_mult: int = 4  # hidden width of the feed-forward block = ffn_mult * d_model
    gelu: str = "none"  # the feed-forward block's GELU: "none" (exact) or "tanh" (GPT-2's)

    def to_dict(self) -> dict:
        return asdict(self)


class GeluFFN(nn.Module):
    """fc2(gelu(fc1(x))) in plain PyTorch, with the submodule names and the constructor of
    fusednorm.FusedGeluFFN, so the two are interchangeable (and so are their state dicts)."""

    def __init__(self, d_model: int, d_hidden: int | None = None, bias: bool = True,
                 approximate: str = "none", device=None, dtype=None):
        super().__init__()
        d_hidden = 4 * d_model if d_hidden is None else d_hidden
        self.approximate = approximate
        self.fc1 = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_hidden, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError(
                f"d_model={config.d_model} must be divisible by n_head={config.n_head}"
            )
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=-1)
        # [batch, head, time, head_dim]
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, norm_layer: Callable[..., nn.Module],
                 ffn_layer: Callable[..., nn.Module]):
        super().__init__()
        self.ln1 = norm_layer(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = norm_layer(config.d_model)
        self.ffn = ffn_layer(config.d_model, config.ffn_mult * config.d_model,
                             approximate=config.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over a byte vocabulary. forward(idx) -> logits
    [batch, time, vocab]; forward(idx, targets) -> (logits, mean cross-entropy)."""

    def __init__(self, config: GPTConfig, norm_layer: Callable[..., nn.Module] = nn.LayerNorm,
                 ffn_layer: Callable[..., nn.Module] = GeluFFN):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config, norm_layer, ffn_layer) for _ in range(config.n_layer)
        )
        self.ln_f = norm_layer(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Re-initialises every Linear, Embedding and LayerNorm of `model` from a generator
    seeded with `seed`, visiting modules in registration order: two models with the same
    structure get bitwise-equal weights whatever their LayerNorm/FFN classes did in their
    own constructors. Residual output projections get std / sqrt(2 * n_layer) (GPT-2)."""
    generator = torch.Generator().manual_seed(seed)
    n_layer = getattr(getattr(model, "config", None), "n_layer", 1)

    def normal_(tensor: torch.Tensor, std: float) -> None:
        # Drawn on the CPU so that the values do not depend on the model's device.
        values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        tensor.copy_(values)

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                residual = name.endswith(("attn.proj", "ffn.fc2"))
                normal_(module.weight, std / (2 * n_layer) ** 0.5 if residual else std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight, std)
            elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
    return model


def layer_classes(norm: str) -> tuple[Callable[..., nn.Module], Callable[..., nn.Module]]:
    """(norm_layer, ffn_layer) for `norm` in {"torch", "fused"}. "fused" uses
    fusednorm.FusedLayerNorm, and fusednorm.FusedGeluFFN where this fusednorm has it."""
    if norm == "torch":
        return nn.LayerNorm, GeluFFN
    if norm == "fused":
        import fusednorm

        return fusednorm.FusedLayerNorm, getattr(fusednorm, "FusedGeluFFN", GeluFFN)
    raise ValueError(f"norm must be 'torch' or 'fused', got {norm!r}")


def build_model(config: GPTConfig, norm: str, seed: int, device: str | torch.device = "cpu") -> GPT:
    """A GPT with `norm`'s LayerNorm/FFN classes, initialised from `seed` (the same weights
    for every `norm`), on `device`."""
    norm_layer, ffn_layer = layer_classes(norm)
    model = GPT(config, norm_layer=norm_layer, ffn_layer=ffn_layer)
    return init_weights(model, seed).to(device)
