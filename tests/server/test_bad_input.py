"""Inputs a black-box QA pass found answered with a 500 or accepted in silence: each is now a 400
naming its field (or, for a grammar that dead-ends while generating, an error event), and the
server keeps serving with no block held."""

from __future__ import annotations

import json

import httpx
import pytest

from isolab.server import ServerConfig

H = {"Authorization": "Bearer sk-alice", "content-type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LOOPS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite JSON satisfies it


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle, server_config=ServerConfig(max_tokens_limit=64, max_queue=16))


def _post(srv, path: str, body: bytes | dict) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, headers=H, timeout=120)


def _nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "lone UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}',
     "messages.0.content", "lone UTF-16 surrogate"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate"),
    ("/v1/chat/completions", {**CHAT, "guided_json": _nested(200)}, "guided_json", "the grammar is not valid"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"\u00b2": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"\u0663": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [10**9]}, "stop_token_ids", "token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["a"] * 65}, "stop", "at most 64"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": "x" * 1025}, "stop", "at most 1024"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1025]}, "stop.0", "at most 1024"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0", "needs content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0", "needs content"),
    ("/v1/chat/completions", {**CHAT, "messages": [*CHAT["messages"], {"role": "tool", "content": "x"}]},
     "messages.1", "tool_call_id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}},
     "stream_options", "stream: true"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "banana"}}}]}, "tools.0.function.parameters", "must be the JSON Schema of an object"),
    # empty lists and a nameless schema, which OpenAI refuses (a client tested here then works there)
    ("/v1/chat/completions", {**CHAT, "tools": []}, "tools", "at least 1"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": []}]}, "messages.0.content",
     "at least 1"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema.name", "needs a name"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {"type": "object"}}}}, "response_format.json_schema.name", "letters, digits"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt", "is empty"),
    # a number field takes a number (an int is one), not a bool or a string, as the int fields do
    ("/v1/chat/completions", {**CHAT, "temperature": True}, "temperature", "valid number"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": "0.5"}, "top_p", "valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_p": False}, "min_p", "valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "presence_penalty": "1"}, "presence_penalty",
     "valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": "10"}}, "logit_bias.5", "valid number"),
    # an object schema the grammar compiler cannot take still fails there, naming the tools
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "banana"}}}}}]}, "tools", "the grammar is not valid"),
])
def test_bad_input_is_a_400_naming_its_field(srv, path, body, param, needle):
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error"
    assert _post(srv, "/v1/chat/completions", CHAT).status_code == 200  # and the server goes on


def test_a_grammar_no_token_continues_is_an_error_not_a_stop(srv):
    body = {"prompt": "x", "max_tokens": 10, "guided_json": LOOPS}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_json" and "no token continues" in r.json()["error"]["message"]
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, headers=H, timeout=120) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "no token continues" in json.loads(lines[-2][6:])["error"]["message"]
    assert not any('"finish_reason":"stop"' in line.replace(" ", "") for line in lines)
    # n choices of one grammar fail alike: the stream says so once, not once a choice
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True, "n": 3}, headers=H,
                      timeout=120) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert sum('"error"' in line for line in lines) == 1 and lines[-1] == "data: [DONE]"
    srv.wait_idle()
    assert srv.metrics()["isolab_kv_blocks_used"] == 0


def test_a_grammar_that_forces_a_special_tokens_text_says_so_and_writes_nothing_to_stderr(srv, capfd):
    """llguidance offers forced text that spells a special token (<|im_end|>) only as that token, then
    refuses it: the 400 says that (it asked whether the schema was satisfiable), and the library's own
    warning line (which quotes output text) no longer goes to stderr past the server's logger."""
    for extra in ({"guided_choice": ["<|im_end|>"]}, {"guided_regex": "<\\|im_start\\|>x"}):
        r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 12, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == next(iter(extra)) and "spells a special token" in err["message"], err
    assert "Parser Error" not in capfd.readouterr().err
    srv.wait_idle()
    assert srv.metrics()["isolab_kv_blocks_used"] == 0


def test_names_inside_messages_are_reported_as_ignored(srv):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}], "name": "bob"}]
    r = _post(srv, "/v1/chat/completions", {**CHAT, "messages": msgs})
    assert r.status_code == 200
    assert set(r.headers["x-isolab-ignored-params"].split(",")) == {"messages[].name", "messages[].content[].cache_control"}
    assert "x-isolab-ignored-params" not in _post(srv, "/v1/chat/completions", CHAT).headers


def test_a_replicas_grammar_error_crosses_to_the_ingress_as_a_400():
    """With --replicas, outputs cross a process boundary (scaleout/wire.py): the request's own fault
    keeps its class and field, so the ingress answers a 400 as one engine does, not a 500; a broken
    model's NaN row keeps its class (its sentence reaches the client); anything else is a bare
    IsolabError (the ingress says only that the engine failed)."""
    import dataclasses
    import pickle

    from isolab.engine.llm_engine import RequestOutput
    from isolab.errors import InvalidRequestError, IsolabError, ModelOutputError
    from isolab.scaleout.wire import to_wire

    out = RequestOutput("r", new_token_ids=(), new_logprobs=(), output_token_ids=(), finished=True,
                        finish_reason="error", stop_reason=None, num_prompt_tokens=1, num_cached_tokens=0,
                        error=InvalidRequestError("no token continues", field="guided_json"))
    back = pickle.loads(pickle.dumps(to_wire(out)))
    assert type(back.error) is InvalidRequestError and back.error.field == "guided_json"
    nan = dataclasses.replace(out, error=ModelOutputError("the model's logits for this request are not numbers"))
    back = pickle.loads(pickle.dumps(to_wire(nan)))
    assert type(back.error) is ModelOutputError and str(back.error) == str(nan.error)
    back = pickle.loads(pickle.dumps(to_wire(dataclasses.replace(out, error=RuntimeError("internal")))))
    assert type(back.error) is IsolabError


def test_head_health(srv):
    assert httpx.head(srv.url + "/health").status_code == 200


def test_the_offline_api_refuses_a_lone_surrogate_in_one_sentence(tiny_bundle):
    from isolab.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate"):
        tiny_bundle.tokenizer.encode("a\ud800")


def test_the_surrogate_check_walks_a_body_deeper_than_the_recursion_limit():
    """A JSON body may nest as deep as the parser allows; the check walks it with a loop, so a deep
    clean body passes and a deep surrogate is found and named, with no RecursionError."""
    import sys

    from isolab.server.protocol import RefusedField, refuse_lone_surrogates

    depth = sys.getrecursionlimit() * 3
    clean: list = ["leaf"]
    for _ in range(depth):
        clean = [clean]
    refuse_lone_surrogates({"messages": clean})
    bad: dict = {"x": "ok\ud800"}
    for _ in range(depth):
        bad = {"a": bad}
    with pytest.raises(RefusedField, match="lone UTF-16 surrogate") as exc:
        refuse_lone_surrogates(bad)
    assert exc.value.name == ".".join(["a"] * depth + ["x"])


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_an_explicit_null_is_the_default(srv, path, body):
    """Clients that write unset options as null (as OpenAI and vLLM read them): every optional field
    of the request may be null, and the reply is the one without it."""
    from isolab.server.protocol import ChatCompletionRequest, CompletionRequest

    model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
    nulls = {name: None for name, f in model.model_fields.items() if not f.is_required() and name not in body}
    base = {**body, "max_tokens": 3, "temperature": 0}
    r = _post(srv, path, {**nulls, **base})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == _post(srv, path, base).json()["choices"]
    missing = _post(srv, path, {**base, next(iter(body)): None})  # a required field sent as null
    assert missing.status_code == 400 and missing.json()["error"]["param"] == next(iter(body))
    # nested options too
    r = _post(srv, path, {**base, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert _post(srv, "/tokenize", {"prompt": "hi", "add_special_tokens": None}).status_code == 200


def test_a_body_the_parser_cannot_read_says_why(srv):
    """FastAPI answers 'There was an error parsing the body' for a body that is not UTF-8, one sent
    compressed, and JSON nested past the parser's depth: each gets its own sentence now (a black-box
    QA pass), and the server goes on."""
    import gzip

    raw = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    cases = [
        (raw.replace(b"hi", b"h\xffi"), {}, 400, "not UTF-8"),
        (gzip.compress(raw), {"content-encoding": "gzip"}, 415, "Content-Encoding 'gzip' is not supported"),
        (b'{"prompt": "hi", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}", {}, 400, "nested too deeply"),
    ]
    before = srv.metrics().get('isolab_requests_rejected_total{reason="unreadable_body"}', 0.0)
    for body, headers, status, needle in cases:
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={**H, **headers}, timeout=120)
        assert r.status_code == status and needle in r.json()["error"]["message"], (r.status_code, r.text)
    assert srv.metrics()['isolab_requests_rejected_total{reason="unreadable_body"}'] == before + 2  # the gate's two
    # a path nobody serves is a 404 whatever its body
    assert httpx.post(srv.url + "/v1/nothing", content=b"\xff", headers={**H, "content-encoding": "gzip"}).status_code == 404
    assert _post(srv, "/v1/completions", raw).status_code == 200
