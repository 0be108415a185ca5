"""Penalties, logit_bias, min_tokens and min_p: each changes what it should, only in its own row,
and a processed request batched with others gets the bits it gets alone."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from isolab import LLM, SamplingParams
from isolab.engine.request import Request
from isolab.engine.sampler import process_logits
from isolab.errors import InvalidRequestError
from isolab.testing.workload import Arrival, solo_mismatches

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_bundle):
    return LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)


def greedy(llm, **kw):
    return list(llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw))[0].token_ids)


def test_logit_bias_forces_and_forbids_tokens(llm):
    base = greedy(llm)
    forced = greedy(llm, logit_bias=((42, 100.0),))
    assert forced == [42] * 24
    banned = greedy(llm, logit_bias=((base[0], -100.0),))
    assert base[0] not in banned[:1] and banned != base


def test_penalties_reduce_repetition(llm):
    base = greedy(llm)
    top = Counter(base).most_common(1)[0][1]
    assert top > 4, "the tiny model repeats itself: the penalties have something to change"
    for kw in ({"frequency_penalty": 2.0}, {"repetition_penalty": 100.0}):
        out = greedy(llm, **kw)
        assert Counter(out).most_common(1)[0][1] < top, kw
    assert greedy(llm, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0) == base


def test_process_logits_does_each_rule_exactly():
    """Against a hand computation on made-up logits (vLLM's order and formulas)."""
    V = 8
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0, -2.0, 3.0, 1.5]] * 3)

    def req(rid, prompt, output, **kw):
        r = Request(rid, list(prompt), SamplingParams(max_tokens=8, **kw), None)
        for t in output:
            r.append_output(t, None)
        return r

    reqs = [req("plain", [0], [2]),
            req("pen", [0, 1], [2, 2, 6], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                logit_bias=((3, 1.0),)),
            req("min", [0], [4], min_tokens=3, stop_token_ids=(5,))]
    out = process_logits(logits, reqs, eos_token_id=7)
    assert torch.equal(out[0], logits[0])  # asks for nothing: untouched
    exp = logits[1].clone()
    for t in (0, 1, 2, 6):  # seen in prompt + output: positive / 2, negative * 2
        exp[t] = exp[t] / 2 if exp[t] > 0 else exp[t] * 2
    exp[2] -= 0.5 * 2 + 0.25  # twice in the output
    exp[6] -= 0.5 * 1 + 0.25
    exp[3] += 1.0
    assert torch.equal(out[1], exp)
    exp2 = logits[2].clone()
    exp2[7] = exp2[5] = float("-inf")  # one output token < min_tokens: EOS and the stop token masked
    assert torch.equal(out[2], exp2)
    assert out.shape == (3, V)


def test_a_vanishing_temperature_is_greedy_not_nan(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=5e-324, seed=1, ignore_eos=True,
                                              logit_bias=((3, 100.0),)))[0]
    assert list(out.token_ids) == greedy(llm, logit_bias=((3, 100.0),))


def test_a_vanishing_top_p_keeps_the_top_token(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, top_p=2.2250738585072014e-308, seed=1,
                                              ignore_eos=True))[0]
    assert list(out.token_ids) == greedy(llm)


def test_a_request_that_masks_every_token_still_samples(llm):
    V = llm.engine.bundle.hparams.vocab_size
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, min_tokens=3, temperature=0.7, seed=1,
                                              stop_token_ids=tuple(range(V))))[0]
    assert len(out.token_ids) == 3


def test_a_negative_presence_penalty_encourages_repeats(llm):
    out = greedy(llm, presence_penalty=-2.0, frequency_penalty=-2.0)
    assert Counter(out).most_common(1)[0][1] >= Counter(greedy(llm)).most_common(1)[0][1]


def test_min_tokens_holds_off_stop_tokens_and_eos(llm):
    base = greedy(llm)
    stop = base[1]
    early = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,)))[0]
    assert len(early.token_ids) <= 2 and early.finish_reason == "stop"
    held = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,), min_tokens=10))[0]
    assert len(held.token_ids) >= 10
    assert stop not in held.token_ids[:9], "a stop token is masked before min_tokens"


def test_min_p_one_is_greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True))[0]
    assert list(out.token_ids) == greedy(llm)


def test_logprobs_stay_the_models_raw_distribution(llm):
    raw = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))[0]
    biased = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=3,
                                                 logit_bias=((raw.token_ids[0], 5.0),)))[0]
    assert biased.logprobs[0].logprob == raw.logprobs[0].logprob


@pytest.mark.parametrize("kw,field", [
    ({"frequency_penalty": 3.0}, "frequency_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": 5e-47}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_processed_requests_batched_equal_alone(tiny_bundle):
    """Rows with every processor, and plain rows, in one batch: each gets its solo bits."""
    rng = random.Random(7)
    kinds = [{}, {"frequency_penalty": 1.5}, {"presence_penalty": 0.7, "repetition_penalty": 1.3},
             {"logit_bias": ((3, 4.0), (9, -3.0))}, {"min_tokens": 6, "stop_token_ids": (11,)},
             {"temperature": 0.9, "min_p": 0.1, "seed": 5, "frequency_penalty": 0.5}]
    arrivals = []
    for i in range(18):
        kw = {"temperature": 0.0, **kinds[i % len(kinds)]}
        prompt = tuple(rng.randrange(1, 200) for _ in range(rng.randint(3, 40)))
        arrivals.append(Arrival(i // 3, f"r{i}", prompt, SamplingParams(max_tokens=12, logprobs=2, **kw)))
    assert solo_mismatches(tiny_bundle, arrivals, kv_blocks=64) == []


def test_min_tokens_holds_off_the_end_of_turn_tokens_too(tiny_bundle):
    """Gemma stops on <end_of_turn> as on EOS (engine/stop.py): before min_tokens it is masked as
    EOS is, not a stop the request takes at once."""
    import copy
    import dataclasses

    tok = copy.copy(tiny_bundle.tokenizer)
    tok.end_of_turn_ids = frozenset({42})
    llm = LLM(bundle=dataclasses.replace(tiny_bundle, tokenizer=tok), kv_cache_memory=1 << 20)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, min_tokens=3, logit_bias=((42, 100.0),)))[0]
    assert 42 not in out.token_ids[:3] and out.token_ids[3:] == (42,) and out.finish_reason == "stop"
