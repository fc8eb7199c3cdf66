"""fusednorm: fused LayerNorm, RMSNorm, residual add + norm and GELU feed-forward kernels for
PyTorch (CPU and CUDA), forward and backward, with drop-in modules and model swaps."""
from . import reference
from .functional import (add_layer_norm, add_rms_norm, gelu_ffn, layer_norm, layer_norm_gelu_ffn,
                         rms_norm)
from .info import __version__, build_info
from .layer_norm_2d import FusedLayerNorm2d
from .modules import (FusedAddLayerNorm, FusedAddRMSNorm, FusedGeluFFN, FusedHFRMSNorm,
                      FusedLayerNorm, FusedLayerNormGeluFFN, FusedRMSNorm)
from .ops import FusedLayerNormFunction, GeluFFNFunction, LayerNormGeluFFNFunction
from .patch import norm_report, replace_layernorm, replace_norms
from ._dtensor_rules import register_when_dtensor_loads

register_when_dtensor_loads()  # fusednorm.distributed's rules, once DTensor is imported

__all__ = [
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "FusedGeluFFN",
    "FusedHFRMSNorm",
    "FusedLayerNorm",
    "FusedLayerNorm2d",
    "FusedLayerNormFunction",
    "FusedLayerNormGeluFFN",
    "FusedRMSNorm",
    "GeluFFNFunction",
    "add_layer_norm",
    "add_rms_norm",
    "LayerNormGeluFFNFunction",
    "build_info",
    "gelu_ffn",
    "layer_norm",
    "layer_norm_gelu_ffn",
    "norm_report",
    "reference",
    "replace_layernorm",
    "replace_norms",
    "rms_norm",
    "__version__",
]
