"""The sliding window in the paged attention kernel (Gemma's local layers): a row sees only its last
`window` keys, its bits are its own whatever the batch, and it agrees with the torch path."""

from __future__ import annotations

import pytest
import torch

from isolab import kernels
from isolab.models.attention import attention_core, write_kv

pytestmark = pytest.mark.skipif(not kernels.native_ready(), reason="native kernels do not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dh", [64, 256])
def test_window_rows_are_their_own_and_match_the_torch_path(dtype, dh):
    g = torch.Generator().manual_seed(dh)
    H, Hkv, bs, S, W = 4, 1, 16, 160, 40
    b = 6
    k = torch.randn(Hkv, b, S, dh, generator=g).to(dtype)
    v = torch.randn(Hkv, b, S, dh, generator=g).to(dtype)
    q = torch.randn(b, H, dh, generator=g).to(dtype)
    pos = torch.tensor([5, 39, 40, 41, 100, 159], dtype=torch.int32)  # inside, at and past the window
    nb = S // bs
    pool = torch.zeros(2, Hkv, b * nb + 1, bs, dh, dtype=dtype)
    slots = torch.arange(bs, (b * nb + 1) * bs)
    write_kv(pool, slots, k.permute(1, 2, 0, 3).reshape(-1, Hkv, dh), v.permute(1, 2, 0, 3).reshape(-1, Hkv, dh))
    tables = (torch.arange(b * nb, dtype=torch.int32) + 1).view(b, nb)
    rows = torch.arange(b, dtype=torch.int32)
    full = kernels.paged_attention(q, pool, tables, rows, pos, dh ** -0.5, window=W)
    for i in range(b):  # each row alone: the same bits
        one = kernels.paged_attention(q[i : i + 1], pool, tables[i : i + 1], rows[:1] * 0, pos[i : i + 1], dh ** -0.5,
                                      window=W)
        assert torch.equal(one, full[i : i + 1])
    ref = attention_core(q.view(b, 1, H, dh).float(), k.float(), v.float(), pos.view(b, 1).long(), dh ** -0.5,
                         window=W)[:, 0]
    assert (full.float() - ref).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    no_window = kernels.paged_attention(q, pool, tables, rows, pos, dh ** -0.5)
    if kernels.attention_isa() == "amx" and dtype == torch.bfloat16 and dh == 64:
        # unwindowed bf16 rows take the AMX tiles, windowed calls never do (another fixed order)
        assert (no_window[:2].float() - full[:2].float()).abs().max() < 2e-2
    else:
        assert torch.equal(no_window[:2], full[:2])  # rows that do not reach back W keys are unchanged
    assert not torch.equal(no_window[3:], full[3:])  # the others are not
