"""fusednorm: fused LayerNorm and GELU feed-forward kernels for PyTorch (CPU and CUDA)."""
from . import reference
from .functional import layer_norm
from .info import __version__, build_info
from .modules import FusedLayerNorm
from .ops import FusedLayerNormFunction
from .patch import replace_layernorm

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormFunction",
    "build_info",
    "layer_norm",
    "reference",
    "replace_layernorm",
    "__version__",
]
