"""A GEMM row gets the same bits whatever else is in the batch (models/llama.py:Weight): prepacked
oneDNN weights are invariant for every M >= 2, and a single row is padded to two because M = 1
takes another kernel. The shape is SmolLM2-135M's down projection, where M = 1 differs."""

from __future__ import annotations

import pytest
import torch

from isolab.models.llama import Weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_at_every_batch_size(dtype):
    g = torch.Generator().manual_seed(0)
    w = Weight(torch.randn(576, 1536, generator=g).to(dtype))
    x = torch.randn(256, 1536, generator=g).to(dtype)
    full = w(x)
    for m in (1, 2, 3, 5, 17, 64):
        for s in range(0, 256 - m + 1, m):
            assert torch.equal(w(x[s : s + m]), full[s : s + m]), (m, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_single_row_padding_is_what_keeps_m1_invariant(dtype):
    """Switch the protection off (call the GEMM on one row directly): rows change bits."""
    g = torch.Generator().manual_seed(0)
    w = Weight(torch.randn(576, 1536, generator=g).to(dtype))
    if w.packed is None:
        pytest.skip("no oneDNN here: F.linear path")
    x = torch.randn(256, 1536, generator=g).to(dtype)
    full = w(x)
    unpadded = sum(int((w._apply(x[i : i + 1]) != full[i : i + 1]).sum()) for i in range(256))
    assert unpadded > 0, "M = 1 no longer differs: the padding may be dropped"
