"""Every op is written down once, in csrc/op_table.h (its schema and C++ signature; the
dispatcher checks the kernels and typed handles against it when fusednorm._C loads). These
tests check that the Python side agrees with it: the registered ops, their fake kernels,
the vmap rules, the direct entries of fusednorm._fast and the functions of
fusednorm.functional."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from fusednorm import _loader, functional, ops
from fusednorm.ops import batching

TABLE = Path(__file__).resolve().parent.parent / "csrc" / "op_table.h"

pytestmark = pytest.mark.skipif(not _loader.AVAILABLE, reason="fusednorm._C not loaded")


def _table_ops(macro: str) -> list[str]:
    """The op names of one list of op_table.h (FUSEDNORM_PUBLIC_OPS or FUSEDNORM_BACKEND_OPS)."""
    text = TABLE.read_text()
    body = text.split(f"#define {macro}(X)", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"\bX\((\w+),", body)


PUBLIC = _table_ops("FUSEDNORM_PUBLIC_OPS")
BACKEND = _table_ops("FUSEDNORM_BACKEND_OPS")


def _schema(name: str):
    return getattr(torch.ops.fusednorm, name).default._schema


def _arg_names(name: str) -> list[str]:
    return [a.name for a in _schema(name).arguments]


def test_the_table_lists_the_ops():
    assert PUBLIC == ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "gelu_ffn",
                      "layer_norm_gelu_ffn"]
    assert set(BACKEND) >= {"norm_fwd", "norm_bwd", "gelu_ffn_fwd", "gelu_ffn_bwd"}


def test_the_library_registers_the_table_and_nothing_else():
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("fusednorm::")}
    assert registered == set(PUBLIC) | set(BACKEND) | {"build_info"}


def _registered_function(fn):
    """The function given to register_fake, out of the (*args, **kwargs) wrappers torch
    may put around it (their closures hold it)."""
    while list(inspect.signature(fn).parameters) == ["args", "kwargs"]:
        inner = [c.cell_contents for c in fn.__closure__ or ()
                 if inspect.isfunction(c.cell_contents)]
        assert len(inner) == 1, f"cannot see through the wrapper {fn}"
        fn = inner[0]
    return fn


@pytest.mark.parametrize("name", PUBLIC + BACKEND)
def test_fake_kernel_takes_the_schema_arguments(name):
    entry = torch._library.simple_registry.singleton.find(f"fusednorm::{name}")
    kernel = entry.fake_impl.kernel
    assert kernel is not None, f"fusednorm::{name} has no fake kernel (fusednorm/ops/)"
    params = list(inspect.signature(_registered_function(kernel.func)).parameters)
    assert params == _arg_names(name), kernel.source


@pytest.mark.parametrize("name", PUBLIC)
def test_public_op_has_its_module_function_and_entry(name):
    # fusednorm/ops/<name>.py: the OpOverload
    assert getattr(ops, name.upper()) == getattr(torch.ops.fusednorm, name).default
    # fusednorm.functional.<name>: the schema's arguments, by name and order
    assert list(inspect.signature(getattr(functional, name)).parameters) == _arg_names(name)
    # fusednorm._fast.<name>: the direct entry, documented by the schema
    if ops.FAST is not None:
        entry = getattr(ops.FAST, name)
        assert str(_schema(name)).startswith("fusednorm::")
        assert entry.__doc__.startswith(str(_schema(name)).split("::", 1)[1] + "; returns")


def test_the_library_reports_the_public_ops():
    assert _loader.PUBLIC_OPS == tuple(PUBLIC)


def test_vmap_rules_cover_the_public_ops():
    """batching.py registers a rule for every public op, its row data read off the schema."""
    assert sorted(batching._DATA_ARGS) == sorted(PUBLIC)
    for name, positions in batching._DATA_ARGS.items():
        arguments = _schema(name).arguments
        assert [arguments[i].name for i in positions] in (
            ["input"], ["input", "residual", "rowscale"])
        assert [str(arguments[i].type) for i in positions] in (
            ["Tensor"], ["Tensor", "Tensor", "Optional[Tensor]"])


def test_decompositions_cover_the_public_ops():
    """decompositions.py writes every public op with ATen ops (traced under
    torch.onnx.export), with the op's own argument names; none is in torch._decomp's table,
    where inductor, under CI=1, refuses the ops' fallback kernels."""
    import inspect

    from torch._decomp import decomposition_table

    from fusednorm.ops import decompositions

    assert not [op for op in decomposition_table if getattr(op, "namespace", None) == "fusednorm"]
    for name in PUBLIC:
        fn = getattr(decompositions, name)
        assert list(inspect.signature(fn).parameters) == [a.name for a in _schema(name).arguments]
