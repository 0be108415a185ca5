"""The RoPE tables grow with the positions asked for (models/rope.py): a position's row has the
same bits whatever the table's size when it was built, so no request sees numbers shaped by the
requests before it; and an idle model holds none of them."""

from __future__ import annotations

import torch

from isolab.models.rope import RopeTables


def _full(base: float, dh: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables built whole, in one fp32 pass (what the model did at load before)."""
    inv = 1.0 / (base ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    emb = torch.outer(torch.arange(p, dtype=torch.float32), inv)
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos(), emb.sin()


def test_rows_do_not_depend_on_the_growth_history():
    for dh, base in ((64, 10000.0), (256, 1e6), (80, 500000.0)):
        whole = RopeTables(base, dh, 5000, torch.float32, torch.device("cpu"))
        cos, sin = whole.upto(5000)
        grown = RopeTables(base, dh, 5000, torch.float32, torch.device("cpu"))
        for n in (1, 7, 300, 301, 1000, 4097, 5000):  # a history of small requests, then long ones
            c, s = grown.upto(n)
            assert c.shape[0] >= n and torch.equal(c[:n], cos[:n]) and torch.equal(s[:n], sin[:n])
        # and every row is its own position's (a chunk computed at the wrong offset is far off); within an ulp
        # only: how torch splits one large cos/sin between threads and vector tails is its own business
        ref_cos, ref_sin = _full(base, dh, 5000)
        assert torch.allclose(cos[:5000], ref_cos, rtol=0, atol=1e-6) and torch.allclose(sin[:5000], ref_sin, rtol=0,
                                                                                         atol=1e-6)


def test_tables_start_empty_and_grow_in_whole_chunks_to_the_limit():
    t = RopeTables(10000.0, 64, 8192, torch.bfloat16, torch.device("cpu"))
    assert t.rows == 0 and t.nbytes == 0
    t.for_positions(torch.tensor([3, 0, 9]))
    assert t.rows == t.chunk
    t.upto(t.chunk + 1)
    assert t.rows == 2 * t.chunk
    t.upto(10**9)  # never past the context
    assert t.rows == 8192
    assert t.for_positions(torch.tensor([8191]))[0].shape == (8192, 64)
