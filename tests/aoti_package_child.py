"""The child process of test_export's AOTInductor test: `python aoti_package_child.py
{fused,control,custom_op} DEVICE DIR` exports a model with a dynamic batch, compiles it with
aoti_compile_and_package into DIR, loads it with aoti_load_package and compares it with the
eager module; exit 0 on success, the failed assertion on stderr otherwise.

It runs apart from pytest so that a crash of AOTInductor's loader kills this process, not
the test run. "fused" is test_export.Block (every fused op of the library); the controls,
with fusednorm never imported, tell torch's crashes from fusednorm's: "control" is
LayerNorm + Linear (no extern call), "custom_op" LayerNorm through a Python custom op of
fusednorm's argument kinds (an extern call of the proxy executor).
"""
from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import torch

D = 16


def random_input_no_fusednorm(shape, dtype, device, seed=0):
    """conftest.random_input's data, without importing conftest (which imports fusednorm)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3.0 + 1.0).to(
        device=device, dtype=dtype)


class Control(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.linear = torch.nn.Linear(D, D)

    def forward(self, x, residual):
        return self.linear(self.ln(x + residual))


class CustomOpControl(torch.nn.Module):
    """LayerNorm through a Python custom op whose schema has the argument kinds of
    fusednorm's (SymInt[], optional tensors, a float, several outputs): an extern call of
    the proxy executor, as fusednorm's ops are, without fusednorm."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(D) + 0.5)
        self.bias = torch.nn.Parameter(torch.rand(D) - 0.5)

    def forward(self, x, residual):
        return torch.ops.aoti_control.norm(x + residual, [D], self.weight, self.bias, 1e-5)[0]


def register_custom_op() -> None:
    @torch.library.custom_op("aoti_control::norm", mutates_args=())
    def norm(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
             bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
        out, mean, rstd = torch.native_layer_norm(input, normalized_shape, weight, bias, eps)
        return out, mean.clone(), rstd.clone()

    @norm.register_fake
    def _(input, normalized_shape, weight, bias, eps):
        stats = input.shape[:input.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
        return (torch.empty_like(input), input.new_empty(stats), input.new_empty(stats))


def main(kind: str, device: str, out: str) -> None:
    torch.manual_seed(0)
    if kind == "fused":
        from test_export import OPS, Block, random_input  # imports fusednorm
        model = Block().to(device).eval()
    elif kind == "custom_op":
        register_custom_op()
        random_input, model = random_input_no_fusednorm, CustomOpControl().to(device).eval()
    else:
        random_input, model = random_input_no_fusednorm, Control().to(device).eval()
    x = random_input((2, 5, D), torch.float32, device)
    r = random_input((2, 5, D), torch.float32, device, seed=1)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(Path(out) / f"{kind}.pt2"))
    if kind == "fused":
        # Each fused op stays an extern call of the op, run by the proxy executor.
        with zipfile.ZipFile(path) as package:
            (wrapper,) = [n for n in package.namelist() if n.endswith(".wrapper.json")]
            nodes = json.loads(package.read(wrapper))["nodes"]
        extern = {node["node"]["target"] for node in nodes}
        assert {f"fusednorm::{op}" for op in OPS} <= extern, extern
    print(f"{kind}: compiled {path}; loading", file=sys.stderr, flush=True)
    loaded = torch._inductor.aoti_load_package(path)
    print(f"{kind}: loaded", file=sys.stderr, flush=True)
    for rows in (2, 7):
        x = random_input((rows, 5, D), torch.float32, device, seed=2)
        r = random_input((rows, 5, D), torch.float32, device, seed=3)
        torch.testing.assert_close(loaded(x, r), model(x, r))
    if kind != "fused":
        assert "fusednorm" not in sys.modules, "the controls must run without fusednorm"


if __name__ == "__main__":
    kind, device, out = sys.argv[1:]
    assert kind in ("fused", "control", "custom_op"), kind
    main(kind, device, out)
