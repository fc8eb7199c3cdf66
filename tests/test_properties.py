"""Property test: random shapes, dtypes, layouts and parameter sets all match the float64
reference (output and gradients)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DTYPES, random_input
from test_layer_norm import check_forward_backward, make_params


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.integers(0, 9), min_size=0, max_size=2),
    norm=st.lists(st.integers(1, 70), min_size=1, max_size=2),
    dtype=st.sampled_from(DTYPES),
    affine=st.sampled_from(["affine", "weight_only", "none"]),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
    seed=st.integers(0, 2**16),
)
def test_random_cases_match_reference(batch, norm, dtype, affine, layout, seed):
    shape = tuple(batch) + tuple(norm)
    if layout == "transposed":  # the same values, laid out column-major
        x = random_input(shape[::-1], dtype, "cpu", seed=seed).permute(*reversed(range(len(shape))))
    elif layout == "strided":  # every other element of a wider last dim
        wide = shape[:-1] + (2 * shape[-1],)
        x = random_input(wide, dtype, "cpu", seed=seed)[..., ::2]
    else:
        x = random_input(shape, dtype, "cpu", seed=seed)
    weight, bias = make_params(tuple(norm), affine, dtype, "cpu", seed=seed + 1)
    check_forward_backward(x, tuple(norm), weight, bias, grad_seed=seed + 3)
