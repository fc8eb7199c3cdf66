"""fusednorm: fused LayerNorm and GELU feed-forward kernels for PyTorch (CPU and CUDA)."""
from . import reference
from .functional import gelu_ffn, layer_norm
from .info import __version__, build_info
from .modules import FusedGeluFFN, FusedLayerNorm, FusedLayerNormGeluFFN
from .ops import FusedLayerNormFunction, GeluFFNFunction, LayerNormGeluFFNFunction
from .patch import replace_layernorm

__all__ = [
    "FusedGeluFFN",
    "FusedLayerNorm",
    "FusedLayerNormFunction",
    "FusedLayerNormGeluFFN",
    "GeluFFNFunction",
    "LayerNormGeluFFNFunction",
    "build_info",
    "gelu_ffn",
    "layer_norm",
    "reference",
    "replace_layernorm",
    "__version__",
]
