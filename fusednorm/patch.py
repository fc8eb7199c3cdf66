"""Swapping fusednorm's modules into an existing model."""
from __future__ import annotations

from torch import nn

from .modules import FusedLayerNorm


def replace_layernorm(model: nn.Module) -> nn.Module:
    """Turns every plain nn.LayerNorm in `model` (the model itself included) into a
    FusedLayerNorm, in place, and returns the model.

    The modules keep their identity, Parameter objects (so optimizer state stays valid),
    device, dtype, hooks and train/eval mode: only their class changes. Subclasses of
    nn.LayerNorm are left alone, since they may compute something else.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_layernorm: model must be an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = FusedLayerNorm
    return model
