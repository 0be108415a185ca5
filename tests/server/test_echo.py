"""echo on completions (issue 15), with prompt logprobs: what lm-evaluation-harness's loglikelihood
tasks send. Through the official `openai` client, streamed and not."""

from __future__ import annotations

import pytest

from isolab import LLM, SamplingParams


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle)


PROMPT = "the cat sat on the mat and"


def test_echo_prepends_the_prompt(srv):
    c = srv.client()
    plain = c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    prompt_text = srv.engine.tokenizer.decode(srv.engine.tokenizer.encode(PROMPT))
    assert echoed.choices[0].text == prompt_text + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # usage counts generated tokens only


def test_echo_with_logprobs_scores_every_prompt_token(srv, tiny_bundle):
    c = srv.client()
    r = c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    ids = srv.engine.tokenizer.encode(PROMPT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20).generate(
        ids, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    assert lp.token_logprobs[1:len(ids)] == [x.logprob for x in ref.prompt_logprobs[1:]]  # the same bits
    assert lp.token_logprobs[len(ids):] == [x.logprob for x in ref.logprobs]
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_echo_adds_up_to_the_same_reply(srv):
    c = srv.client()
    whole = c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1)
    text, tokens, values = "", [], []
    for ch in c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                   logprobs=1, stream=True):
        for choice in ch.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert text == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens and values == whole.choices[0].logprobs.token_logprobs


def test_max_tokens_0_with_echo_scores_the_prompt_alone(srv, tiny_bundle):
    """OpenAI's legacy scoring call: echo, logprobs, max_tokens 0: the prompt and its logprobs, no token."""
    c = srv.client()
    ids = srv.engine.tokenizer.encode(PROMPT)
    r = c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=0, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == srv.engine.tokenizer.decode(ids) and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(ch.logprobs.tokens) == len(ids) and ch.logprobs.token_logprobs[0] is None
    ref = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20).generate(
        ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert ch.logprobs.token_logprobs[1:] == [x.logprob for x in ref.prompt_logprobs[1:]]
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=0, echo=True, stream=True) if x.choices)
    assert streamed == ch.text


def test_max_tokens_0_with_n_streams_logprobs_and_reports_cached_tokens(srv):
    c = srv.client()
    ids = srv.engine.tokenizer.encode(PROMPT * 8)  # over a block: a repeat is served from the prefix cache
    c.completions.create(model=srv.model, prompt=ids, max_tokens=2, temperature=0)
    r = c.completions.create(model=srv.model, prompt=ids, max_tokens=0, echo=True, n=2)  # no logprobs: cache used
    assert [ch.text for ch in r.choices] == [srv.engine.tokenizer.decode(ids)] * 2
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(c.completions.create(model=srv.model, prompt=ids, max_tokens=0, echo=True, n=2, logprobs=1,
                                       stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert [x.finish_reason for x in mine][-1] == "length"
        assert sum(len(x.logprobs.tokens) for x in mine if x.logprobs) == len(ids)
    assert chunks[-1].usage.completion_tokens == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_max_tokens_0_without_echo_is_a_400(srv, kind):
    import openai
    c = srv.client()
    with pytest.raises(openai.BadRequestError, match="needs echo=true" if kind == "completion" else "max_tokens"):
        if kind == "completion":
            c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=0)
        else:
            c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_writes_special_tokens_out(srv, stream):
    """A prompt with special tokens in it comes back as sent (they were dropped), and every
    text_offset indexes into the text returned."""
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    r = srv.client().completions.create(model=srv.model, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                        stream=stream)
    text, offsets = "", []
    for ch in (r if stream else [r]):
        for choice in ch.choices:
            text += choice.text
            offsets += choice.logprobs.text_offset if choice.logprobs else []
    assert text == prompt and offsets and all(0 <= o < len(text) for o in offsets)
