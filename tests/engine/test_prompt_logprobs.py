"""Prompt logprobs (what echo and lm-evaluation-harness's loglikelihood need): each prompt token's
logprob given the tokens before it, equal to a dense reference, whether the prompt is computed in
one chunk or many, alone or batched, and never served from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from isolab import LLM, SamplingParams

PROMPT = [5, 17, 9, 33, 2, 71, 40, 8, 99, 12, 3, 54, 61, 7, 28, 19, 44, 6, 80, 11]


def reference(bundle, ids: list[int]) -> torch.Tensor:
    """log_softmax of the dense reference forward's logits at every position: (T, V)."""
    return torch.log_softmax(bundle.model.reference_logits(ids), -1)


@pytest.mark.parametrize("budget", [512, 7])  # one chunk, or chunks of 7 tokens
def test_prompt_logprobs_equal_a_dense_reference(tiny_bundle, budget):
    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, max_num_batched_tokens=budget)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    ref = reference(tiny_bundle, PROMPT)
    for i in range(1, len(PROMPT)):
        lp = plp[i]
        assert lp is not None and lp.token_id == PROMPT[i]
        assert lp.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-3)
        # the 3 largest values, each token carrying its own (tied values may name either token: the
        # engine breaks ties by token id, torch.topk by its own order)
        assert [v for _, v in lp.top] == pytest.approx(torch.topk(ref[i - 1], 3).values.tolist(), abs=1e-3)
        assert all(float(ref[i - 1, t]) == pytest.approx(v, abs=1e-3) for t, v in lp.top)
        assert [t for t, v in lp.top] == [t for t, v in sorted(lp.top, key=lambda tv: (-tv[1], tv[0]))]


def test_chunking_and_batching_do_not_change_the_bits(tiny_bundle):
    one = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20).generate(
        PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, max_num_batched_tokens=9)
    outs = llm.generate([PROMPT, PROMPT[:11], PROMPT[3:]], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0))
    assert outs[0].prompt_logprobs == one.prompt_logprobs
    assert outs[1].prompt_logprobs == one.prompt_logprobs[:11]


def test_a_prompt_logprobs_request_is_never_a_prefix_hit(tiny_bundle):
    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    warm = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0]
    assert warm.num_cached_tokens > 0  # the positive control: the prefix is in the cache
    asked = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert asked.num_cached_tokens == 0 and len(asked.prompt_logprobs) == len(PROMPT)


def test_without_the_field_nothing_is_computed(tiny_bundle):
    out = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20).generate(PROMPT, SamplingParams(max_tokens=1))[0]
    assert out.prompt_logprobs is None


def test_max_tokens_0_computes_the_prompt_and_generates_nothing(tiny_bundle):
    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, max_num_batched_tokens=7)
    one = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    outs = llm.generate([PROMPT, PROMPT[:9]], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert tuple(outs[0].token_ids) == () and outs[0].finish_reason == "length"
    assert outs[0].prompt_logprobs == one.prompt_logprobs and outs[1].prompt_logprobs == one.prompt_logprobs[:9]
    assert llm.engine.kv.num_held_blocks() == 0  # nothing held after
