"""The KV pool's memory: zeros that cost nothing until written, then only the pages written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolab.engine.kv_storage import KVStorage
from isolab.models.gguf_loader import LlamaHParams

HP = LlamaHParams(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, rope_theta=10000.0, rms_eps=1e-5, context_length=4096)


def _mappings(lo: int, hi: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps, summed over the mappings that overlap [lo, hi) (a madvise
    splits one allocation into several)."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and lo < end
        elif inside and line.endswith(" kB"):
            fields[head.rstrip(":")] = fields.get(head.rstrip(":"), 0) + int(line.split()[1])
    assert fields, f"no mapping overlaps {lo:#x}-{hi:#x}"
    return fields


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_a_written_block_costs_its_pages_not_a_huge_page() -> None:
    # 2 x 2 heads x 4096 blocks x 16 x 64 bf16 = 32 MiB a layer: room for 2 MiB pages, had anyone asked
    storage = KVStorage(HP, num_blocks=4096, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    pool = storage.layers[0]
    span = (pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size())
    before = _mappings(*span)
    assert before["Rss"] < 1024, "the pool costs memory before anything is written"
    pool[:, :, 7] = 1.0  # one block: 2 x 2 runs of 2 KiB, each in its own 4 KiB page
    after = _mappings(*span)
    # Huge pages (numpy's zeros asked for them) zeroed 4 x 2 MiB here, 8 MiB for 8 KiB written;
    # bench/first_touch.py measures what that cost a fresh engine.
    assert after["AnonHugePages"] == 0
    assert after["Rss"] - before["Rss"] <= 64, f"{after['Rss'] - before['Rss']} kB resident for one block"
    assert float(pool[:, :, 7].float().mean()) == 1.0 and float(pool[:, :, 6].float().abs().sum()) == 0.0


def test_a_block_size_off_the_attention_kernels_fast_paths_is_warned_about(real_bundle, caplog):
    """--block-size 24 runs attention's generic loop (3x slower steps at 128 concurrent on the Xeon):
    the engine says so when it starts; the default and other multiples of 16 say nothing."""
    import logging

    from isolab import kernels
    from isolab.config import MiB, build_engine_config
    from isolab.engine.llm_engine import LLMEngine

    if not real_bundle.model.native_kernels:
        pytest.skip("the native kernels do not run here")
    for bs, warned in ((kernels.FAST_BLOCK_SIZE, False), (64, False), (24, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="isolab.engine.llm_engine"):
            LLMEngine(build_engine_config(block_size=bs, kv_cache_memory=64 * MiB), real_bundle).close()
        assert any("fast paths are built for blocks of a multiple of 16" in r.getMessage() for r in caplog.records) == warned


def test_multiples_of_16_give_the_default_block_sizes_bits(real_bundle):
    """The real model, prompts sharing a prefix (cached blocks reread), several in one batch:
    block sizes 32 and 64 give block size 16's tokens and logprobs, bit for bit (their blocks are
    runs of 16-key blocks to the attention kernel: tests/kernels/test_native.py)."""
    from isolab.config import MiB
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    if not real_bundle.model.native_kernels:
        pytest.skip("the native kernels do not run here (the torch path has no block layout to test)")
    prompts = ["The history of the printing press begins", "The history of the printing press begins in Mainz, where",
               "Write a haiku about rain on a tin roof.", "List three prime numbers greater than forty:"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for bs in (16, 32, 64):
        llm = LLM(bundle=real_bundle, block_size=bs, kv_cache_memory=64 * MiB)
        first = llm.generate(prompts, params)
        again = llm.generate(prompts[1:2], params)  # its prefix blocks now cached
        llm.engine.close()
        runs[bs] = [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in (*first, *again)]
    assert runs[32] == runs[16] and runs[64] == runs[16]
