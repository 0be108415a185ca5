"""`--weights dense` in bf16 where the tile unit runs keeps the quantized weights in their GGUF
blocks (kernels/qdense.cpp, models/linear.py: BlockWeight) and multiplies them as the dense GEMM
multiplies its bf16 panels: the same tokens and logprobs, bit for bit, from a third of the bytes.
ISOLAB_DENSE_BLOCKS=0 keeps the panels (what these tests compare against)."""

from __future__ import annotations

import pytest

from isolab import kernels
from isolab.models.linear import BlockWeight, StackedWeight, Weight

# (the switch's own test below runs everywhere)
needs_amx = pytest.mark.skipif(not kernels.native_ready() or kernels.qdense_isa() != "amx",
                               reason="dense weights stay in blocks only where the tile unit runs")

PROMPTS = ["The capital of France is", "def fib(n):", "Write a haiku about the sea, and then explain it."]


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory):
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tinyq") / "tiny-q4_1.gguf", TinySpec(layers=2, seed=3, qtype="Q4_1"))


def _run(model: str | None, monkeypatch, blocks: bool, n: int = 24):
    from isolab import LLM, SamplingParams

    monkeypatch.setenv("ISOLAB_DENSE_BLOCKS", "1" if blocks else "0")
    llm = LLM(model=model, weights="dense", dtype="bf16")
    m = llm.engine.bundle.model
    kinds = {type(p) for w in m.linears() for p in (w.parts if isinstance(w, StackedWeight) else [w])}
    report = m.numerics
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, logprobs=3, ignore_eos=True))
    seeded = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=n, temperature=1.0, seed=11, logprobs=2))
    return kinds, report, [(o.token_ids, o.logprobs) for o in outs + seeded]


def _same(model: str | None, monkeypatch) -> None:
    kinds, report, got = _run(model, monkeypatch, blocks=True)
    assert kinds == {BlockWeight}, kinds
    assert report.invariant and report.block_shapes and "blocks" in report.numerics
    checked = {k: v for k, v in report.gemm_mismatches.items() if k.startswith("blocks ")}
    assert checked and all(v["dense"] == 0 and not any(v.values()) for v in checked.values()), checked
    kinds, report, want = _run(model, monkeypatch, blocks=False)
    assert kinds == {Weight} and not report.block_shapes
    assert got == want  # tokens and logprobs (their floats compared exactly)


@needs_amx
def test_tiny_q4_1_dense_blocks_give_the_panels_bits(q4_path, monkeypatch):
    _same(str(q4_path), monkeypatch)


@pytest.mark.real
@needs_amx
def test_real_model_dense_blocks_give_the_panels_bits(monkeypatch):
    _same(None, monkeypatch)


@pytest.mark.real
@needs_amx
def test_gemma3_dense_blocks_give_the_panels_bits(monkeypatch):
    """Gemma 3 270M's Q4_K_M file: u4 records with fp32 scales, Q6_K's s8 groups of 16 and a Q8_0
    head, some of them stacked side by side; its per-op forward."""
    _same("gemma3-270m", monkeypatch)


@needs_amx
def test_blocks_are_mapped_from_the_weight_cache(q4_path):
    """The records are packed once into the weight cache (a `.rows` file per weight) and mapped by
    every start after that."""
    from pathlib import Path

    from isolab.models.gguf_loader import load_gguf
    from isolab.models.llama import LlamaModel

    LlamaModel(load_gguf(q4_path), "bf16", weights="dense")  # (packs them, if no earlier test did)
    m = LlamaModel(load_gguf(q4_path), "bf16", weights="dense")
    cache = m.weight_cache
    assert cache is not None and cache.dir is not None and cache.hits and not cache.writes
    rows = sorted(cache.dir.glob("*.rows.bin"))
    assert len(rows) == 1 + 4 * m.hp.num_layers, rows  # the head and each layer's four GEMMs
    maps = Path("/proc/self/maps").read_text()
    assert all(str(p) in maps for p in rows)


@pytest.mark.parametrize("value,on", [("", True), ("1", True), ("on", True), ("TRUE", True), ("0", False),
                                      ("off", False), ("False", False), ("no", False), ("garbage", True)])
def test_the_switch_reads_as_a_user_writes_it(monkeypatch, caplog, value, on):
    from isolab.models.bundle import dense_blocks

    monkeypatch.setenv("ISOLAB_DENSE_BLOCKS", value)
    with caplog.at_level("WARNING"):
        assert dense_blocks() is on
    assert ("ISOLAB_DENSE_BLOCKS" in caplog.text) == (value == "garbage")  # a value it cannot read: said so


@needs_amx
def test_blocks_that_fail_the_check_leave_the_panels(q4_path, monkeypatch, tmp_path):
    """Where the GEMM on GGUF blocks fails the start-up check (here: blocks made to differ from the
    dense GEMM by one bit), the model keeps the isolab path with its bf16 panels; the refusal names
    the blocks. (Before: the whole isolab path was refused and the next path taken.)"""
    import torch

    from isolab.models import invariance
    from isolab.models.gguf_loader import load_gguf
    from isolab.models.llama import LlamaModel

    class Off(BlockWeight):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            y = super().__call__(x)
            return y.view(torch.int16).bitwise_xor(1).view(y.dtype)  # one bit, in every output

    monkeypatch.setenv("ISOLAB_INVARIANCE_CACHE", str(tmp_path))
    monkeypatch.setattr(invariance, "BlockWeight", Off)
    m = LlamaModel(load_gguf(q4_path), "bf16", weights="dense")
    report = m.numerics
    assert report.gemm_path == "isolab" and report.invariant and not report.block_shapes
    assert len(report.rejected) == 1 and "blocks" in report.rejected[0] and "kept with bf16 panels" in report.rejected[0]
    kinds = {type(p) for w in m.linears() for p in (w.parts if isinstance(w, StackedWeight) else [w])}
    assert kinds == {Weight}, kinds
