"""benchmarks/ncu_case.py (the profiler's case driver of scripts/gpu_check.sh's profile phase)
on the CPU: every op and pass runs, and the backward's call gives the gradients of its op's
inputs (x and the parameters it has)."""
from __future__ import annotations

import pytest
import torch

from benchmarks import ncu_case


@pytest.mark.parametrize("op", ncu_case.OPS)
@pytest.mark.parametrize("pass_", ncu_case.PASSES)
def test_ncu_case_runs_each_op_and_pass(op, pass_):
    call = ncu_case.build_call(op, pass_, torch.bfloat16, 6, 40, "cpu")
    out = call()
    if pass_ == "fwd":
        assert out.shape == (6, 40) and torch.isfinite(out).all()
    else:
        shapes = [g.shape for g in out]
        assert shapes == [(6, 40), (40,), (40,)] if "layer" in op else shapes == [(6, 40), (40,)]
        assert all(torch.isfinite(g).all() for g in out)


def test_ncu_case_command_line():
    ncu_case.main(["rms_norm", "bwd", "fp32", "3", "24", "--device", "cpu", "--runs", "2"])
    with pytest.raises(SystemExit):
        ncu_case.main(["rms_norm", "bwd", "fp32,bf16", "3", "24", "--device", "cpu"])
