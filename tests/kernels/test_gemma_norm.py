"""Gemma's RMSNorm kernel (pointwise.cpp: rms_norm_gemma): transformers' formula, and a row's bits
its own whatever the batch."""

from __future__ import annotations

import pytest
import torch

from isolab import kernels

pytestmark = pytest.mark.skipif(not kernels.native_ready(), reason="native kernels do not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [256, 640, 37])
def test_gemma_norm(dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(9, d, generator=g) * 3).to(dtype)
    w = 1.0 + 0.1 * torch.randn(d, generator=g)  # fp32, the file's 1 + w
    out = kernels.rms_norm_gemma(x, w, 1e-6)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref.float()).abs().max() < tol
    for i in range(9):
        assert torch.equal(kernels.rms_norm_gemma(x[i : i + 1].contiguous(), w, 1e-6), out[i : i + 1])
