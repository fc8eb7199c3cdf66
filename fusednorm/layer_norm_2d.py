"""FusedLayerNorm2d: LayerNorm over the channels of an NCHW tensor, as timm's LayerNorm2d."""
from __future__ import annotations

import torch

from .modules import FusedLayerNorm


class FusedLayerNorm2d(FusedLayerNorm):
    """LayerNorm over dim 1 (channels) of an (N, C, H, W) tensor, computed by fusednorm.

    The same computation as timm.layers.LayerNorm2d: permute to channels-last, layer-norm
    over the last dim (normalized_shape = (C,)), permute back; the output has the same
    shape and strides. Constructor, parameters and state dict are nn.LayerNorm's, so
    replace_layernorm can turn a timm LayerNorm2d into one in place.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._forward_channels_first(input)
