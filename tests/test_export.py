"""torch.export of models built from fusednorm's modules: strict and non-strict (the
default) tracing keep every fused op as one graph node, dynamic shapes included, and the
exported program computes what the module does, also after a save / load round trip and
compiled ahead of time by AOTInductor."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusednorm
from conftest import DEVICES, random_input

D = 16


class Block(torch.nn.Module):
    """A pre-norm transformer block's norms and FFN: every fused op of the library."""

    def __init__(self):
        super().__init__()
        self.ln = fusednorm.FusedLayerNorm(D)
        self.rms = fusednorm.FusedRMSNorm(D)
        self.add_ln = fusednorm.FusedAddLayerNorm(D)
        self.add_rms = fusednorm.FusedAddRMSNorm(D)
        self.ffn = fusednorm.FusedGeluFFN(D, 24)
        self.block = fusednorm.FusedLayerNormGeluFFN(D, d_hidden=24)

    def forward(self, x, residual):
        y, s = self.add_ln(self.ln(x), residual)
        z, s = self.add_rms(self.rms(y), s)
        return self.block(self.ffn(z)) + s


OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "gelu_ffn",
       "layer_norm_gelu_ffn"]


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_every_fused_op(strict):
    torch.manual_seed(0)
    model = Block().eval()
    x = random_input((2, 5, D), torch.float32, "cpu")
    r = random_input((2, 5, D), torch.float32, "cpu", seed=1)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x, r), strict=strict,
                                  dynamic_shapes=({0: batch}, {0: batch}))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    for op in OPS:
        assert f"fusednorm.{op}.default" in targets, (op, targets)
    assert not any("linear" in t or "native_layer_norm" in t for t in targets), targets

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for rows in (2, 7):
        x = random_input((rows, 5, D), torch.float32, "cpu", seed=2)
        r = random_input((rows, 5, D), torch.float32, "cpu", seed=3)
        want = model(x, r)
        assert torch.equal(program.module()(x, r), want)
        assert torch.equal(loaded.module()(x, r), want)


# Seconds a child of the AOTInductor test may take (export, C++ compile, load, compare).
CHILD_TIMEOUT_S = {"cpu": 300, "cuda": 300}


def _run_aoti_child(kind, device, out):
    """Runs aoti_package_child.py in a fresh Python (faulthandler on, in its own process
    group); returns its exit code and output (stdout and stderr). Past CHILD_TIMEOUT_S the
    group is killed (compile workers too: they would keep the pipe open) and the test fails."""
    child = Path(__file__).with_name("aoti_package_child.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(child.parent.parent),
                                                      env.get("PYTHONPATH")]))
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(child), kind, device,
                             str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timeout = CHILD_TIMEOUT_S[device]
    try:
        output, _ = proc.communicate(timeout=timeout)
        late = None
    except subprocess.TimeoutExpired:
        late = ("it had exited, but its subprocesses kept its output open"
                if proc.poll() is not None else "killed")
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        try:  # what is left of the group, e.g. the compile workers of a crashed child
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if late:
        pytest.fail(f"the {kind} AOTInductor child on {device} was not done within {timeout} s "
                    f"({late}); its output ends:\n{output[-8000:]}")
    return proc.returncode, output


def _crash(code, output, kind):
    """'SIGSEGV in aoti_load_package', say: the signal and the step the child had reached."""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    step = ("running the loaded package" if f"{kind}: loaded" in output else
            "aoti_load_package" if f"{kind}: compiled" in output else "export or compile")
    return f"{name} in {step}"


@pytest.mark.slow  # compiles a C++ wrapper in a child (about 20 s)
@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_calls_the_fused_ops(device, tmp_path):
    """AOTInductor keeps each fused op an extern call; its package computes what the module does.
    In a child: torch 2.11's CUDA loader segfaulted pytest. If the child crashes, controls
    without fusednorm (no extern call; a Python custom op of fusednorm's argument kinds) tell
    torch's crash (skip) from fusednorm's (fail)."""
    code, output = _run_aoti_child("fused", device, tmp_path / "fused")
    if code > 0:
        pytest.fail(f"the AOTInductor child on {device} failed (exit {code}); its output "
                    f"ends:\n{output[-8000:]}")
    if code == 0:
        return
    where = f"torch {torch.__version__} on {device}"
    if device == "cuda":
        where += f" ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})"
    crash = f"AOTInductor crashes ({_crash(code, output, 'fused')}) under {where}"
    controls = {"control": "LayerNorm + Linear, no extern call",
                "custom_op": "a Python custom op of fusednorm's argument kinds"}
    for kind, what in controls.items():
        control_code, control_output = _run_aoti_child(kind, device, tmp_path / kind)
        if control_code < 0:
            pytest.skip(f"{crash}, also for {what} without fusednorm (control: "
                        f"{_crash(control_code, control_output, kind)}): a torch defect, the "
                        "check cannot run here")
        if control_code > 0:
            pytest.fail(f"{crash} with fusednorm's ops, and the control without them ({what}) "
                        f"failed without crashing (exit {control_code}): whose crash it is is "
                        f"not known. The control's output ends:\n{control_output[-2000:]}\nThe "
                        f"crashed child's output ends:\n{output[-8000:]}")
    pytest.fail(f"{crash} with fusednorm's ops, and both controls without them ("
                + "; ".join(controls.values()) + ") passed: fusednorm's defect. The crashed "
                f"child's output ends:\n{output[-8000:]}")
