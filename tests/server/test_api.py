"""The OpenAI surface through the official client on a real uvicorn (tiny model): shapes,
streaming equals non-streaming, n and seeds, logprobs, stop strings, and the 4xx edges."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from isolab.server import ServerConfig
from tests.server.logprob_text import token_bytes

CANARY = "zebra-canary-7731"


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle, server_config=ServerConfig(max_tokens_limit=64, max_prompt_tokens=300,
                                                                   max_body_bytes=64 * 1024, max_n=4))


def _collect_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_completion_shape_and_usage(srv):
    r = srv.client().completions.create(model=srv.model, prompt="hello there", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(srv.engine.tokenizer.encode("hello there"))
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_equals_non_stream_completion(srv):
    c = srv.client()
    kw = dict(model=srv.model, prompt="the rain in spain", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    texts, reasons, chunks = _collect_stream(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert texts[0] == whole.choices[0].text
    assert reasons[0] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    # OpenAI: with include_usage every other chunk says "usage": null; without it, none has the field
    assert all("usage" in ch.model_fields_set and ch.usage is None for ch in chunks[:-1])
    assert all("usage" not in ch.model_fields_set for ch in c.completions.create(stream=True, **kw))


def test_stream_equals_non_stream_chat(srv):
    c = srv.client()
    kw = dict(model=srv.model, messages=[{"role": "user", "content": "tell me about the sea"}], max_tokens=24,
              temperature=0, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    texts, reasons, chunks = _collect_stream(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == whole.choices[0].message.content
    assert reasons[0] == "length"


def test_n_choices_with_seed_are_seed_plus_i(srv):
    c = srv.client()
    kw = dict(model=srv.model, prompt="once upon", max_tokens=12, temperature=2.0, extra_body={"ignore_eos": True})
    multi = c.completions.create(n=3, seed=40, **kw)
    assert [ch.index for ch in multi.choices] == [0, 1, 2]
    assert multi.usage.completion_tokens == 36
    for i in range(3):
        solo = c.completions.create(n=1, seed=40 + i, **kw)
        assert solo.choices[0].text == multi.choices[i].text
    assert len({ch.text for ch in multi.choices}) > 1  # different seeds: not one sample copied n times


def test_stream_n_and_prompt_list(srv):
    c = srv.client()
    kw = dict(model=srv.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(prompt=["alpha", "beta"], n=2, **kw)
    texts, reasons, _ = _collect_stream(c.completions.create(prompt=["alpha", "beta"], n=2, stream=True, **kw))
    assert sorted(texts) == [0, 1, 2, 3] and set(reasons.values()) == {"length"}
    for ch in whole.choices:
        assert texts[ch.index] == ch.text
    alpha = c.completions.create(prompt="alpha", **kw).choices[0].text
    beta = c.completions.create(prompt="beta", **kw).choices[0].text
    assert [ch.text for ch in whole.choices] == [alpha, alpha, beta, beta]


def test_completion_logprobs(srv):
    r = srv.client().completions.create(model=srv.model, prompt="abc", max_tokens=5, temperature=0, logprobs=3,
                                        extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(val)  # greedy: the sampled token is the best
        assert tok in top
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprobs_carry_each_tokens_own_bytes(srv):
    """A token that holds part of a UTF-8 character gives that part in `bytes` (OpenAI's field, there
    so that a client can join the bytes into the text), and its `token` writes it as \\xNN escapes,
    never U+FFFD (so the completions format's top_logprobs, keyed by text, keep distinct pieces
    apart): joined, the bytes are the reply's text exactly. text_offset counts whole characters."""
    c = srv.client()
    want = "\U0001f44b hi \u00e9"
    r = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "wave"}], max_tokens=40,
                                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"guided_choice": [want]})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want
    assert b"".join(bytes(e.bytes) for e in content) == want.encode()
    assert all("\ufffd" not in e.token and e.token.encode() == bytes(e.bytes) or "\\x" in e.token for e in content)
    assert any("\\x" in e.token for e in content)  # the emoji is split across tokens here
    for e in content:
        assert all(t.token.encode() == bytes(t.bytes) or "\\x" in t.token for t in e.top_logprobs)
    r = c.completions.create(model=srv.model, prompt="wave", max_tokens=40, temperature=0, logprobs=2,
                             extra_body={"guided_choice": [want]})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want and "\ufffd" not in "".join(lp.tokens)
    raws = [token_bytes(t) for t in lp.tokens]
    assert b"".join(raws) == want.encode()
    assert lp.text_offset == [len(b"".join(raws[:i]).decode("utf-8", errors="ignore")) for i in range(len(raws))]


def test_chat_logprobs(srv):
    c = srv.client()
    kw = dict(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw) for choice in ch.choices
                if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_stop_string_is_cut_out_streamed_and_not(srv):
    c = srv.client()
    base = dict(model=srv.model, prompt="the quick brown", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**base).choices[0].text
    # a stop string taken from inside the greedy output, so the run must stop there
    stop = full[6:8]
    assert len(stop) == 2
    expected = full[: full.find(stop)]
    r = c.completions.create(stop=[stop], **base)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's field: which stop ended it
    texts, reasons, _ = _collect_stream(c.completions.create(stop=[stop], stream=True, **base))
    assert texts[0] == expected and reasons[0] == "stop"
    last = [ch for ch in c.completions.create(stop=[stop], stream=True, **base) if ch.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert c.completions.create(**base).choices[0].stop_reason is None  # length: no stop
    chat = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                     temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert chat.choices[0].stop_reason in (stop, None) and (chat.choices[0].stop_reason is None) == (
        chat.choices[0].finish_reason == "length")


def test_models_and_health(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [srv.model, srv.engine.bundle.name]  # the slug id, then the GGUF name
    health = httpx.get(srv.url + "/health").json()
    numerics = srv.engine.model.numerics  # the start-up invariance check, as /health and /metrics report it
    assert health == {"status": "ok", "numerics": numerics.numerics, "batch_invariant": numerics.invariant,
                      "weights": numerics.weights, "kv_cache_dtype": "auto", "cpu": numerics.cpu}
    assert health["batch_invariant"] is True  # isolab's own GEMM and kernels: invariant on every CPU
    metrics = httpx.get(srv.url + "/metrics").text
    assert "isolab_batch_invariant 1.0" in metrics
    assert f'isolab_numerics_info{{attention="{numerics.attention}"' in metrics


@pytest.mark.real
def test_the_real_model_served_on_the_int8_pool(server_factory, real_bundle):
    """`--kv-cache-dtype int8` end to end: /health names the pool, the official client gets a chat
    reply and a streamed one with the same text (greedy), and tenants' blocks stay apart on it."""
    srv = server_factory(real_bundle, kv_cache_dtype="int8")
    assert httpx.get(srv.url + "/health").json()["kv_cache_dtype"] == "int8"
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    kw = dict(model=srv.model, messages=msgs, max_tokens=24, temperature=0)
    whole = srv.client().chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in srv.client().chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text
    other = srv.client("sk-bob").chat.completions.create(**kw)  # another tenant: the same text, nothing cached
    assert other.choices[0].message.content == text
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_auth_errors(srv):
    body = {"prompt": "x", "max_tokens": 1}
    url = srv.base_url + "/completions"
    _assert_openai_error(httpx.post(url, json=body), 401)
    _assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer sk-nobody"}), 401)
    _assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "sk-alice"}), 401)
    _assert_openai_error(httpx.get(srv.base_url + "/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        srv.client(key="sk-wrong").completions.create(model=srv.model, prompt="x", max_tokens=1)


def test_unknown_model_and_route_are_404(srv):
    with pytest.raises(openai.NotFoundError) as e:
        srv.client().completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    err = _assert_openai_error(httpx.get(srv.url + "/v1/nothing", headers={"Authorization": "Bearer sk-alice"}), 404)
    assert err["message"].startswith("/v1/nothing is not served here; this server serves ") and "/v1/chat/completions" in err["message"]
    err = _assert_openai_error(httpx.get(srv.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"}), 405)
    assert err["message"] == "GET is not allowed on /v1/chat/completions"


def test_api_edges_a_qa_pass_found(srv):
    """The limit named as sent (max_completion_tokens said max_tokens), an assistant's refusal part read
    back as its text (a 400 before; OpenAI writes it into the history), no /docs or /redoc (pages loading
    scripts from a CDN, outside the key), one metrics label for every model's own path (it was 'other')."""
    h = {"Authorization": "Bearer sk-alice"}
    url = srv.base_url + "/chat/completions"
    err = _assert_openai_error(httpx.post(url, headers=h, json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_completion_tokens": 65}), 400)
    assert err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens is 65"), err
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
               {"role": "user", "content": "why"}]
    r = httpx.post(url, headers=h, json={"messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "refusal" not in r.headers.get("x-isolab-ignored-params", ""), r.headers  # (it is read)
    n = httpx.post(srv.url + "/tokenize", headers=h, json={"messages": history}).json()["count"]
    as_text = [history[0], {"role": "assistant", "content": "no"}, history[2]]
    assert n == httpx.post(srv.url + "/tokenize", headers=h, json={"messages": as_text}).json()["count"]
    err = _assert_openai_error(httpx.post(url, headers=h, json={"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}), 400)
    assert "a refusal part belongs to an assistant message, not a user one" in err["message"], err
    for page in ("/docs", "/redoc"):
        assert httpx.get(srv.url + page).status_code == 404
    httpx.get(srv.base_url + "/models/" + srv.model, headers=h)
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'isolab_http_requests_total{code="200",route="/v1/models/{model}"}' in metrics, metrics


def test_limits(srv):
    h = {"Authorization": "Bearer sk-alice"}
    url = srv.base_url + "/completions"
    # body size: 413 before parsing
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a" * 70_000, "max_tokens": 1}), 413)
    # max_tokens over the server limit
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a", "max_tokens": 65}), 400, "max_tokens")
    # prompt over the server's prompt limit (300 tokens)
    err = _assert_openai_error(httpx.post(url, headers=h, json={"prompt": list(range(40, 40 + 200)) * 2,
                                                                "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    # n over the limit, schema violations (400, as OpenAI), token ids outside the vocabulary (400)
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a", "n": 5}), 400, "n")
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a", "temperature": "hot"}), 400, "temperature")
    _assert_openai_error(httpx.post(url, headers=h, content=b"{not json"), 400)
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": [10**9]}), 400, "prompt")
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": ""}), 400, "prompt")
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a", "logit_bias": {"x": 5}}), 400, "logit_bias")
    _assert_openai_error(httpx.post(url, headers=h, json={"prompt": "a", "logit_bias": {"99999999": 5}}), 400,
                         "logit_bias")


@pytest.mark.parametrize("path,body,content_type,message,param", [
    # a value that fits none of a union's forms: the form it got furthest into speaks, not 'not a string'
    ("/completions", {"prompt": [1, -2]}, None, "prompt.1: Input should be greater than or equal to 0", "prompt.1"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, "messages.0.content.0: Input tag 'image_url' found using 'type' does not match any of the expected tags: "
     "'text', 'refusal'", "messages.0.content.0"),
    ("/completions", {"prompt": "a", "suffix": "end"}, None, "suffix is not supported", "suffix"),
    # the first value at fault speaks, not a deeper error in a later message
    ("/chat/completions", {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": 5},
                                        {"role": "user", "content": [{"type": "image_url"}]}]},
     None, "messages.1.content: Input should be a valid string", "messages.1.content"),
    ("/completions", b"{not json", "application/json", "the body is not valid JSON (", None),
    ("/completions", b'{"prompt": "a"}', "text/plain", "the body must be a JSON object, sent with Content-Type", None),
    ("/chat/completions", b"[1, 2]", "application/json", "the body must be a JSON object", None),
])
def test_a_body_that_does_not_validate_says_what_is_wrong(srv, path, body, content_type, message, param):
    h = {"Authorization": "Bearer sk-alice"}
    if isinstance(body, dict):
        r = httpx.post(srv.base_url + path, headers=h, json={"max_tokens": 2, **body})
    else:
        r = httpx.post(srv.base_url + path, headers={**h, "Content-Type": content_type}, content=body)
    err = _assert_openai_error(r, 400)
    assert err["message"].startswith(message) and err["param"] == param, err


def test_engine_context_limit_is_400(server_factory, tiny_bundle):
    srv = server_factory(tiny_bundle, max_model_len=64)
    r = httpx.post(srv.base_url + "/completions", headers={"Authorization": "Bearer sk-alice"},
                   json={"prompt": [65] * 60, "max_tokens": 10})
    err = _assert_openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    # chat without max_tokens gets the room left in the context instead of a refusal
    r = srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "b" * 30}],
                                             temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 64
    # a chat prompt that fills the context is refused for what it is (not "max_tokens is 1")
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "b" * 80}])
    assert e.value.body["code"] == "context_length_exceeded" and "no room for an answer" in e.value.body["message"]
    # the limit named as the client sent it (the engine's check said max_tokens for max_completion_tokens)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "b" * 30}],
                                                 **{field: 60})
        body = e.value.body
        assert body["code"] == "context_length_exceeded" and f" and {field} is 60: together more than the context " \
            "of 64 tokens" in body["message"], body


def test_the_chat_default_fits_a_kv_pool_smaller_than_the_context(server_factory, tiny_bundle):
    """A pool that holds fewer tokens than the context: a chat without max_tokens gets the room left
    in the pool (it was refused: 'needs 18 KV blocks but the cache holds 10'), and /tokenize reports
    what a request may hold."""
    srv = server_factory(tiny_bundle, kv_cache_memory=40 * 1024)
    held = srv.engine.max_request_tokens
    assert held < srv.engine.max_model_len
    r = srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                             temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens + r.usage.completion_tokens == held
    t = httpx.post(srv.url + "/tokenize", headers={"Authorization": "Bearer sk-alice"}, json={"prompt": "hi"}).json()
    assert t["max_model_len"] == held


def test_no_text_in_logs_or_metrics(srv, caplog):
    caplog.set_level(logging.DEBUG)
    c = srv.client()
    r = c.completions.create(model=srv.model, prompt=f"secret {CANARY}", max_tokens=8, temperature=0)
    c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": CANARY}], max_tokens=4,
                              stream=True).close()
    out_text = r.choices[0].text
    metrics = httpx.get(srv.url + "/metrics").text
    logs = "\n".join(rec.getMessage() for rec in caplog.records)
    assert any("tenant=alice" in rec.getMessage() for rec in caplog.records)  # the log line exists
    for blob in (metrics, logs):
        assert CANARY not in blob and "secret" not in blob and "sk-alice" not in blob
        if len(out_text.strip()) >= 6:
            assert out_text.strip() not in blob
    assert "alice" not in metrics and "bob" not in metrics  # no tenant names either


def test_metrics_count_tokens_and_requests(srv):
    before = srv.metrics()
    srv.client().completions.create(model=srv.model, prompt="count me", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = srv.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("isolab_generation_tokens_total") == 7
    assert delta("isolab_prompt_tokens_total") == len(srv.engine.tokenizer.encode("count me"))
    assert delta('isolab_http_requests_total{code="200",route="/v1/completions"}') == 1
    assert delta('isolab_requests_finished_total{finish_reason="length"}') == 1
    for name in ("isolab_kv_blocks_used", "isolab_kv_blocks_free", "isolab_num_requests_waiting",
                 "isolab_num_requests_running", "isolab_prefix_cache_queries_tokens_total",
                 "isolab_prefix_cache_hits_tokens_total", "isolab_audit_violations_total"):
        assert name in after, name
    assert after["isolab_prefix_cache_queries_tokens_total"] > before.get("isolab_prefix_cache_queries_tokens_total", 0)


def test_error_event_shapes_are_json(srv):
    """Every SSE data line is JSON or [DONE] (clients parse each one)."""
    with httpx.stream("POST", srv.base_url + "/chat/completions", headers={"Authorization": "Bearer sk-alice"},
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for ln in lines[:-1]:
        assert json.loads(ln)["object"] == "chat.completion.chunk"


def test_the_token_that_ends_the_turn_has_no_logprobs_entry(srv, tiny_bundle):
    """EOS (or an end-of-turn token) adds no text, so, as OpenAI's, logprobs.content holds the
    content's tokens only: a reply ended by EOS at once has empty content and no entries; streamed, the
    same."""
    c = srv.client()
    eos = tiny_bundle.tokenizer.eos_token_id
    kw = dict(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=1, logit_bias={str(eos): 100})
    r = c.chat.completions.create(**kw)
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", "")
    assert r.choices[0].logprobs.content == [] and r.usage.completion_tokens == 1
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw) for choice in ch.choices
                if choice.logprobs for e in choice.logprobs.content]
    assert streamed == []
    r = c.completions.create(model=srv.model, prompt="hi", max_tokens=8, temperature=0, logprobs=1,
                             logit_bias={str(eos): 100})
    assert r.choices[0].text == "" and r.choices[0].logprobs.tokens == []
    # under ignore_eos the special token goes on being generated, adding no text: no entries either
    # (they spelled "<|im_end|>" into the entries while the text stayed empty, text_offset past it)
    r = c.completions.create(model=srv.model, prompt="hi", max_tokens=3, temperature=0, logprobs=1,
                             logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "" and r.choices[0].logprobs.tokens == [] and r.usage.completion_tokens == 3


def test_a_chunks_logprobs_never_run_ahead_of_its_text(srv):
    """While text waits for a stop string that may still complete (or for the rest of a character),
    so do its tokens' logprobs entries: at every chunk, the entries' bytes so far are a prefix of the
    text so far (they ran ahead before); at the end they are the whole text."""
    c = srv.client()
    text = "hello there, general kenobi \u00e9\U0001f44b!"
    kw = dict(model=srv.model, prompt="hi", max_tokens=60, temperature=0, logprobs=1,
              extra_body={"guided_choice": [text]})
    sent, entries = "", []
    for ch in c.completions.create(stream=True, stop=["there\x01", "kenobi \u00e9\U0001f44b?"], **kw):
        for choice in ch.choices:
            sent += choice.text
            if choice.logprobs:
                entries += choice.logprobs.tokens
            joined = b"".join(token_bytes(t) for t in entries)
            assert sent.encode().startswith(joined), (sent, entries)
    assert sent == text and b"".join(token_bytes(t) for t in entries) == text.encode()


@pytest.mark.parametrize("chat", [False, True])
def test_tokens_wholly_inside_a_cut_stop_string_have_no_logprobs_entries(srv, chat):
    """A stop string is cut from the text, so the tokens that only spelled it (generated before the
    match completed) lose their logprobs entries too: every entry's token starts inside the text
    returned, and the entries' bytes cover that text (a token that straddles the cut keeps its own)."""
    c = srv.client()
    text, stop = "hello there, general kenobi!", " general kenobi"
    cut = text[: text.find(stop)]
    for stream in (False, True):
        if chat:
            kw = dict(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0,
                      logprobs=True, top_logprobs=1, stop=[stop], extra_body={"guided_choice": [text]})
            pieces = c.chat.completions.create(stream=stream, **kw)
            got, tokens = "", []
            for ch in (pieces if stream else [pieces]):
                for choice in ch.choices:
                    got += (choice.delta.content if stream else choice.message.content) or ""
                    tokens += [e.token for e in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else []
        else:
            kw = dict(model=srv.model, prompt="hi", max_tokens=40, temperature=0, logprobs=1, stop=[stop],
                      extra_body={"guided_choice": [text]})
            pieces = c.completions.create(stream=stream, **kw)
            got, tokens = "", []
            for ch in (pieces if stream else [pieces]):
                for choice in ch.choices:
                    got += choice.text
                    tokens += choice.logprobs.tokens if choice.logprobs else []
        assert got == cut
        starts = [len(b"".join(token_bytes(t) for t in tokens[:i])) for i in range(len(tokens))]
        assert b"".join(token_bytes(t) for t in tokens).startswith(cut.encode()), tokens
        assert all(s < len(cut.encode()) for s in starts), (tokens, cut)


def test_the_waiting_gauge_counts_submitted_requests_not_aborts():
    """isolab_num_requests_waiting adds what the engine thread has not taken yet: the requests a
    submission carries, not the aborts (a black-box QA pass saw waiting=3 with one request left, the
    others' aborts in flight). A stub engine: the thread never runs, so the commands stay queued."""
    import asyncio

    from isolab.sampling_params import SamplingParams
    from isolab.server.app import waiting_requests
    from isolab.server.engine_loop import EngineLoop, EngineRequest, _Add

    class Stub:
        def stats(self) -> dict[str, float]:
            return {}

    loop = EngineLoop(Stub())  # type: ignore[arg-type]
    loop.abort(["a", "b", "c"])
    assert loop.num_pending_commands == 1 and waiting_requests(loop) == 0
    ev = asyncio.new_event_loop()
    try:
        reqs = tuple(EngineRequest(f"r{i}", (1, 2), SamplingParams(max_tokens=1)) for i in range(2))
        loop._push(_Add(reqs, "scope", ev, asyncio.Queue(), ev.create_future()))
    finally:
        ev.close()
    assert loop.num_pending_commands == 2 and waiting_requests(loop) == 2


def test_completions_top_logprobs_always_hold_the_sampled_token(srv):
    """The legacy format's top_logprobs hold the sampled token too ("up to logprobs + 1 elements", as
    OpenAI's and vLLM's): logprobs 0 gives {token: its logprob} per token, where it gave null."""
    c = srv.client()
    for n in (0, 1, 3):
        lp = c.completions.create(model=srv.model, prompt="hello", max_tokens=8, temperature=1.0, seed=3,
                                  logprobs=n, extra_body={"ignore_eos": True}).choices[0].logprobs
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert isinstance(top, dict) and top[tok] == value and len(top) <= n + 1, (n, tok, top)
            if n == 0:
                assert top == {tok: value}
