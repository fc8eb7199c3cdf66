"""Drop-in nn.Modules."""
from __future__ import annotations

import torch
from torch import nn
from torch.jit import is_scripting as _scripting
from torch.nn.modules import module as _hooks

from . import functional
from .errors import FusedTypeError, FusedValueError


class _ZeroCenteredWeight:
    """The zero_centered_weight option of FusedLayerNorm / FusedRMSNorm: the weight applied
    is 1 + weight (formed in float32), and reset_parameters sets weight to zeros. A class
    attribute gives its default, so that a module swapped in place from torch's class (which
    has no such attribute) computes as before."""

    zero_centered_weight: bool = False

    def _set_zero_centered_weight(self, zero_centered_weight: bool) -> None:
        if not isinstance(zero_centered_weight, bool):
            raise FusedTypeError(f"zero_centered_weight must be a bool, got "
                                 f"{type(zero_centered_weight).__name__}")
        if zero_centered_weight:
            self.zero_centered_weight = True
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.zero_centered_weight and self.weight is not None:
            with torch.no_grad():
                self.weight.zero_()

    def extra_repr(self) -> str:
        extra = ", zero_centered_weight=True" if self.zero_centered_weight else ""
        return super().extra_repr() + extra


class FusedLayerNorm(_ZeroCenteredWeight, nn.LayerNorm):
    """torch.nn.LayerNorm computed by fusednorm's kernels.

    A subclass of nn.LayerNorm with the same constructor, attributes, parameters
    (`weight`, `bias`), state_dict keys and reset_parameters, so isinstance checks, init
    code and checkpoints keep working. It adds no state of its own, which is what lets
    replace_layernorm() swap the class of an existing module in place. The one addition,
    keyword-only `zero_centered_weight=True`, applies 1 + weight (weight initialized to 0),
    as Gemma-style checkpoints store it.
    """

    # Under torch.jit.script, forward calls the op itself (torch.ops.fusednorm), reading
    # these as constants.
    __constants__ = nn.LayerNorm.__constants__ + ["zero_centered_weight"]

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *,
                 zero_centered_weight: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._set_zero_centered_weight(zero_centered_weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._forward(input)

    # The computation of forward, which the subclasses that permute around it or act after it
    # call (torch.jit.script compiles methods of self, not super()).
    def _forward(self, input: torch.Tensor) -> torch.Tensor:
        if _scripting():
            return torch.ops.fusednorm.layer_norm(input, self.normalized_shape, self.weight,
                                                  self.bias, self.eps,
                                                  self.zero_centered_weight)[0]
        return functional.layer_norm(input, self.normalized_shape, self.weight, self.bias,
                                     self.eps, zero_centered_weight=self.zero_centered_weight)

    def _forward_channels_first(self, input: torch.Tensor) -> torch.Tensor:
        """_forward over dim 1 (channels) of an (N, C, H, W) tensor: permuted to
        channels-last, normalized, permuted back (timm's LayerNorm2d)."""
        return self._forward(input.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class FusedRMSNorm(_ZeroCenteredWeight, nn.RMSNorm):
    """torch.nn.RMSNorm computed by fusednorm's kernels: a subclass with the same
    constructor, attributes, parameter (`weight`) and state_dict keys, adding no state of
    its own (so replace_norms() can swap the class of an existing module in place);
    keyword-only `zero_centered_weight` as FusedLayerNorm's."""

    __constants__ = nn.RMSNorm.__constants__ + ["zero_centered_weight"]  # as FusedLayerNorm's

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 zero_centered_weight: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._set_zero_centered_weight(zero_centered_weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _scripting():
            return torch.ops.fusednorm.rms_norm(input, self.normalized_shape, self.weight,
                                                self.eps, self.zero_centered_weight)[0]
        return functional.rms_norm(input, self.normalized_shape, self.weight, self.eps,
                                   zero_centered_weight=self.zero_centered_weight)


class _AddNorm:
    """The residual step of FusedAddLayerNorm / FusedAddRMSNorm: forward(input, residual,
    rowscale=None) -> (norm(s), s), s = dropout(input) * rowscale + residual in one pass.
    Dropout runs in training mode only, as nn.Dropout's; residual_dtype as the functions'."""

    dropout_p: float = 0.0
    residual_dtype: torch.dtype | None = None

    def _set_add_options(self, dropout_p: float, residual_dtype) -> None:
        if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
            raise FusedTypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
        if not 0.0 <= dropout_p <= 1.0:
            raise FusedValueError(f"dropout_p must be in [0, 1], got {dropout_p!r}")
        if residual_dtype not in (None, torch.float32):
            raise FusedTypeError(
                f"residual_dtype must be None or torch.float32, got {residual_dtype!r}")
        self.dropout_p = float(dropout_p)
        self.residual_dtype = residual_dtype

    def extra_repr(self) -> str:
        extra = f", dropout_p={self.dropout_p}" if self.dropout_p else ""
        extra += f", residual_dtype={self.residual_dtype}" if self.residual_dtype else ""
        return super().extra_repr() + extra


class FusedAddLayerNorm(_AddNorm, FusedLayerNorm):
    """The pre-norm residual step norm(s), s = dropout(input) * rowscale + residual, as one
    fused pass (fusednorm.add_layer_norm). Parameters and state_dict keys are
    nn.LayerNorm's; keyword-only dropout_p (applied in training mode only) and
    residual_dtype=torch.float32 (the residual stream kept in float32). forward returns
    (normalized output, s)."""

    __constants__ = FusedLayerNorm.__constants__ + ["dropout_p", "residual_dtype"]

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *, dropout_p: float = 0.0,
                 residual_dtype: torch.dtype | None = None,
                 zero_centered_weight: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         zero_centered_weight=zero_centered_weight)
        self._set_add_options(dropout_p, residual_dtype)

    def forward(self, input: torch.Tensor, residual: torch.Tensor,
                rowscale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if _scripting():
            out = torch.ops.fusednorm.add_layer_norm(
                input, residual, self.normalized_shape, self.weight, self.bias, self.eps,
                self.zero_centered_weight, self.residual_dtype,
                self.dropout_p if self.training else 0.0, rowscale)
            return out[0], out[1]
        return functional.add_layer_norm(
            input, residual, self.normalized_shape, self.weight, self.bias, self.eps,
            zero_centered_weight=self.zero_centered_weight, residual_dtype=self.residual_dtype,
            dropout_p=self.dropout_p if self.training else 0.0, rowscale=rowscale)


class FusedAddRMSNorm(_AddNorm, FusedRMSNorm):
    """FusedAddLayerNorm's counterpart for RMSNorm (fusednorm.add_rms_norm); parameters and
    state_dict keys are nn.RMSNorm's."""

    __constants__ = FusedRMSNorm.__constants__ + ["dropout_p", "residual_dtype"]

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 dropout_p: float = 0.0, residual_dtype: torch.dtype | None = None,
                 zero_centered_weight: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype,
                         zero_centered_weight=zero_centered_weight)
        self._set_add_options(dropout_p, residual_dtype)

    def forward(self, input: torch.Tensor, residual: torch.Tensor,
                rowscale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if _scripting():
            out = torch.ops.fusednorm.add_rms_norm(
                input, residual, self.normalized_shape, self.weight, self.eps,
                self.zero_centered_weight, self.residual_dtype,
                self.dropout_p if self.training else 0.0, rowscale)
            return out[0], out[1]
        return functional.add_rms_norm(
            input, residual, self.normalized_shape, self.weight, self.eps,
            zero_centered_weight=self.zero_centered_weight, residual_dtype=self.residual_dtype,
            dropout_p=self.dropout_p if self.training else 0.0, rowscale=rowscale)


def hf_eps(module: nn.Module) -> float:
    """The epsilon of a Hugging Face norm: `variance_epsilon` in most classes, `eps` in
    others (Llama4TextRMSNorm, CpmAntLayerNorm, Gemma's)."""
    eps = getattr(module, "variance_epsilon", None)
    return module.eps if eps is None else eps


class FusedHFRMSNorm(nn.Module):
    """Hugging Face's RMSNorm (LlamaRMSNorm and its copies in Qwen2, Qwen3, Mistral, ...)
    computed by fusednorm, in their order of operations: normalize in float32, cast back to
    the input's dtype, then multiply by `weight` (so the output has the dtype of
    weight * input, as theirs). Attributes `weight` and `variance_epsilon` (or `eps`), as
    theirs: replace_norms() turns such a module into this class in place."""

    # torch.jit.script: the eps of the class it replaced, read as the module is scripted.
    _script_eps: float = 0.0
    __constants__ = ["_script_eps"]

    def __prepare_scriptable__(self) -> nn.Module:
        self._script_eps = float(hf_eps(self))
        return self

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _scripting():
            normed = torch.ops.fusednorm.rms_norm(hidden_states, hidden_states.shape[-1:], None,
                                                  self._script_eps, False)[0]
            return self.weight * normed
        normed = functional.rms_norm(hidden_states, hidden_states.shape[-1:], None,
                                     hf_eps(self))
        return self.weight * normed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={hf_eps(self)}"


def _check_approximate(approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise FusedValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate


def _fuses(block: nn.Module, *modules: tuple[nn.Module, type]) -> bool:
    """Whether the fused op computes what calling the submodules would: each exactly of its
    class (not replaced by another, such as PEFT's LoRA layers, torchao's Float8Linear or a
    quantized Linear) and no module hook to run (FSDP2's unshard, observers; none counted
    where the block's tensor-parallel plan put them, _tp_hooks_bypassed). Otherwise the
    block calls its submodules, unfused. (nn.Module.__call__'s own test for its fast path.)"""
    check_hooks = not block._tp_hooks_bypassed
    if check_hooks and (_hooks._global_forward_hooks or _hooks._global_forward_pre_hooks
                        or _hooks._global_backward_hooks or _hooks._global_backward_pre_hooks):
        return False
    for module, cls in modules:
        if type(module) is not cls:
            return False
        if check_hooks and (module._forward_hooks or module._forward_pre_hooks
                            or module._backward_hooks or module._backward_pre_hooks):
            return False
    return True


def _op_takes(*params) -> bool:
    """Whether the FFN op takes these weights and biases: PyTorch's own tensor types (plain,
    Parameter, DTensor, and the FakeTensor / FunctionalTensor of export and compile
    tracing), not a tensor subclass of another library (quantized or float8 weights), which
    only its own F.linear handles."""
    for p in params:
        if p is not None and type(p) is not nn.Parameter and type(p) is not torch.Tensor \
                and type(p).__module__.partition(".")[0] != "torch":
            return False
    return True


def _op_weights(fuses: bool, fc1: nn.Module, fc2: nn.Module):
    """(w1, b1, w2, b2) of fc1 and fc2 when an FFN module's own test allows the fused op
    (fuses) and the op takes them (_op_takes), else None. (fc1 and fc2 passed in: each
    module attribute read costs nn.Module.__getattr__, a host-time cost per call.)"""
    if not fuses:
        return None
    w = (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    return w if _op_takes(*w) else None


def _add_ffn(module: nn.Module, d_model: int, d_hidden: int | None, bias: bool,
             approximate: str, device, dtype) -> None:
    """module.approximate, and module.fc1 (d_model -> d_hidden, default 4 * d_model) and
    module.fc2 (back to d_model), plain nn.Linear."""
    d_hidden = 4 * d_model if d_hidden is None else d_hidden
    module.approximate = _check_approximate(approximate)
    module.fc1 = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
    module.fc2 = nn.Linear(d_hidden, d_model, bias=bias, device=device, dtype=dtype)


class _FFNModule(nn.Module):
    """What FusedGeluFFN and FusedLayerNormGeluFFN share: the choice between the fused op
    and the submodules (_fused_weights, each module's own test, through _op_weights) made
    once for torch.jit.script, the tensor-parallel flag, and extra_repr."""

    # Set by fusednorm.distributed.tp_plan's FFNBoundary: the hooks its ColwiseParallel and
    # RowwiseParallel put on fc1 / fc2 serve the unfused form; the fused op reads the
    # weights' shards and FFNBoundary lays out the input and output.
    _tp_hooks_bypassed: bool = False

    # torch.jit.script: whether forward calls the fused op or its submodules, decided as the
    # module is scripted (__prepare_scriptable__), as eager forward decides at each call.
    _script_fuses: bool = False
    __constants__ = ["approximate", "_script_fuses"]

    def __prepare_scriptable__(self) -> nn.Module:
        self._script_fuses = self._fused_weights() is not None
        return self

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class FusedGeluFFN(_FFNModule):
    """The transformer feed-forward block fc2(gelu(fc1(x))), computed by fusednorm's fused
    kernels: the same result as nn.Sequential(fc1, nn.GELU(approximate), fc2), with half of
    its saved activations (gelu's output is recomputed in the backward).

    fc1 (d_model -> d_hidden, default 4 * d_model) and fc2 (d_hidden -> d_model) are plain
    nn.Linear submodules, so initialisation code, parameter names (fc1.weight, fc1.bias,
    fc2.weight, fc2.bias) and state dicts work as usual. bias=False drops both biases.
    Where calling fc1 and fc2 would do more than the fused op (a replaced submodule such as
    a LoRA or float8 layer, a hook on one, a quantized weight), forward calls them, unfused.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int | None = None,
        bias: bool = True,
        approximate: str = "none",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _add_ffn(self, d_model, d_hidden, bias, approximate, device, dtype)

    def _fused_weights(self):
        """(w1, b1, w2, b2) where the fused op computes what calling fc1 and fc2 would (see
        _fuses, _op_takes), else None."""
        fc1, fc2 = self.fc1, self.fc2
        return _op_weights(_fuses(self, (fc1, nn.Linear), (fc2, nn.Linear)), fc1, fc2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _scripting():
            if self._script_fuses:
                return torch.ops.fusednorm.gelu_ffn(input, self.fc1.weight, self.fc1.bias,
                                                    self.fc2.weight, self.fc2.bias,
                                                    self.approximate)[0]
        else:
            w = self._fused_weights()
            if w is not None:
                w1, b1, w2, b2 = w
                return functional.gelu_ffn(input, w1, b1, w2, b2, self.approximate)
        return self.fc2(nn.functional.gelu(self.fc1(input), approximate=self.approximate))


class FusedLayerNormGeluFFN(_FFNModule):
    """The pre-LN transformer feed-forward sub-block x + fc2(gelu(fc1(norm(x)))), with
    norm a LayerNorm over the last dim (d_model). Its backward recomputes norm(x) from x and
    the saved statistics instead of keeping it, and recomputes gelu's output as
    FusedGeluFFN does: the only activations it saves are x's statistics and fc1's output.

    Submodules norm (a FusedLayerNorm, i.e. an nn.LayerNorm, with weight and bias), fc1 and
    fc2 (nn.Linear), so state dicts map from the usual modules by name. bias applies to fc1
    and fc2, as in Transformer Engine's LayerNormMLP; the LayerNorm keeps its bias. As
    FusedGeluFFN, it calls its submodules, unfused, where that would do more than the fused op.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int | None = None,
        eps: float = 1e-5,
        bias: bool = True,
        approximate: str = "none",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_approximate(approximate)
        self.norm = FusedLayerNorm(d_model, eps=eps, device=device, dtype=dtype)
        _add_ffn(self, d_model, d_hidden, bias, approximate, device, dtype)

    def _fused_weights(self):
        """(w1, b1, w2, b2) where the fused op computes what calling norm, fc1 and fc2 would
        (as FusedGeluFFN's; not with a zero-centered norm weight), else None."""
        norm, fc1, fc2 = self.norm, self.fc1, self.fc2
        return _op_weights(
            _fuses(self, (norm, FusedLayerNorm), (fc1, nn.Linear), (fc2, nn.Linear))
            and not norm.zero_centered_weight, fc1, fc2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _scripting():
            if self._script_fuses:
                return torch.ops.fusednorm.layer_norm_gelu_ffn(
                    input, self.norm.weight, self.norm.bias, self.norm.eps, self.fc1.weight,
                    self.fc1.bias, self.fc2.weight, self.fc2.bias, self.approximate)[0]
        else:
            w = self._fused_weights()
            if w is not None:
                norm, (w1, b1, w2, b2) = self.norm, w
                return functional.layer_norm_gelu_ffn(
                    input, norm.weight, norm.bias, norm.eps, w1, b1, w2, b2, self.approximate)
        return input + self.fc2(nn.functional.gelu(self.fc1(self.norm(input)),
                                                   approximate=self.approximate))
