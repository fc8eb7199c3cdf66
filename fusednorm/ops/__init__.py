"""fusednorm's compiled ops as Python sees them: one module per op.

Everything a call needs (argument checks, the view as [M, N] rows, the autograd formula
with gradients of any order, the autocast rule) lives in C++, in csrc/ops/<op>.cpp, so a
call is one torch.ops call with no Python on its way. Each module here adds what tracing
needs, a fake kernel that says the output shapes without reading data (so that
torch.compile(fullgraph=True) and torch.export see every op as one opaque node), and the
op's OpOverload (None when the library did not load); batching.py adds vmap rules,
decompositions.py the ops' ATen forms, which fusednorm.functional traces instead of the
ops under torch.onnx.export.
A public op's fake kernel runs fusednorm.functional's checks of its arguments (imported
when called: functional imports ops), so that under torch.compile a rejected argument fails
while tracing with fusednorm's message, as a RuntimeError, as PyTorch's own ops do.
"""
from . import backend  # noqa: F401  (registers the backend ops' fake kernels)
from . import batching  # noqa: F401  (registers the forward ops' vmap rules)
from . import decompositions  # noqa: F401  (the public ops' ATen forms, for ONNX export)
from ._library import FAST
from .add_layer_norm import ADD_LAYER_NORM
from .add_rms_norm import ADD_RMS_NORM
from .gelu_ffn import GELU_FFN, GeluFFNFunction
from .layer_norm import LAYER_NORM, FusedLayerNormFunction
from .layer_norm_gelu_ffn import LAYER_NORM_GELU_FFN, LayerNormGeluFFNFunction
from .rms_norm import RMS_NORM

__all__ = [
    "FAST", "ADD_LAYER_NORM", "ADD_RMS_NORM", "GELU_FFN", "LAYER_NORM", "LAYER_NORM_GELU_FFN", "RMS_NORM",
    "FusedLayerNormFunction", "GeluFFNFunction", "LayerNormGeluFFNFunction",
]
