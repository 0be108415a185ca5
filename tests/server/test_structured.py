"""Structured outputs through the official `openai` client (issue 15): response_format json_object
and json_schema, vLLM's guided_* and structured_outputs, llama.cpp's json_schema, streamed and not.
On the tiny random model every constrained output must still parse and validate: the grammar, not
the model, makes it so."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from isolab import SamplingParams
from isolab.sampling_params import GrammarSpec
from isolab.server import ServerConfig
from isolab.testing.schemas import schema_corpus
from isolab.testing.workload import Arrival, solo_mismatches

H = {"Authorization": "Bearer sk-alice"}
MSG = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle, server_config=ServerConfig(max_tokens_limit=512, max_queue=64))


def _chat(srv, stream: bool, **kw) -> tuple[str, str]:
    c = srv.client()
    if not stream:
        r = c.chat.completions.create(model=srv.model, messages=MSG, max_tokens=400, temperature=1.0, **kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", ""
    for ch in c.chat.completions.create(model=srv.model, messages=MSG, max_tokens=400, temperature=1.0,
                                        stream=True, **kw):
        for choice in ch.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_fifty_schemas_at_once_all_parse_and_validate(srv, stream):
    schemas = schema_corpus(50, seed=1)

    def one(i: int) -> tuple[dict, str, str]:
        s = schemas[i]
        text, reason = _chat(srv, stream, seed=i, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}})
        return s, text, reason

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(len(schemas))))
    for s, text, reason in results:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), s)


def test_json_object_composes_with_logit_bias(srv):
    """json_object has no size bound, so the random model is nudged to close: the bias pushes '}',
    the grammar still decides when it may come (only after '{')."""
    close = srv.engine.tokenizer.encode("}", add_special_tokens=False)
    assert len(close) == 1
    text, reason = _chat(srv, False, seed=3, response_format={"type": "json_object"}, logit_bias={str(close[0]): 100})
    assert reason == "stop" and json.loads(text) == {}


@pytest.mark.parametrize("body,check", [
    ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    ({"guided_json": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 5}},
                      "required": ["x"], "additionalProperties": False}}, lambda t: 0 <= json.loads(t)["x"] <= 5),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"json_schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     lambda t: isinstance(json.loads(t), list)),
])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_peer_extensions_are_honoured(srv, body, check, path):
    base = {"prompt": "x"} if path == "/completions" else {"messages": MSG}
    r = httpx.post(srv.base_url + path, headers=H, json={**base, "max_tokens": 300, "seed": 1, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice.get("text") if "text" in choice else choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and check(text), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),  # (taken as true before)
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {}}, "response_format"),  # no type (it was read as text: a 200)
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
])
def test_bad_structured_requests_are_400_naming_the_field(srv, body, param):
    r = httpx.post(srv.base_url + "/chat/completions", headers=H, json={"messages": MSG, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_compiled_grammar_is_shared_and_the_matchers_are_not(srv):
    g = srv.engine.grammars
    before = g.num_compiled
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
        "k": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["k"], "additionalProperties": False}}}
    for i in range(3):
        _chat(srv, False, seed=i, response_format=fmt, n=2)
    assert g.num_compiled - before == 1  # one compile for six requests; each request had its own matcher


def test_constrained_requests_batched_with_others_equal_alone(tiny_bundle):
    """A grammar mask changes only its own row: every request, constrained or not, gets its solo bits."""
    spec = GrammarSpec.json_schema(schema_corpus(3, seed=9)[0])
    arrivals = []
    for i in range(12):
        structured = spec if i % 3 == 0 else (GrammarSpec.choice(["a", "bb"]) if i % 3 == 1 else None)
        arrivals.append(Arrival(i // 4, f"r{i}", tuple(range(3 + i, 20 + 2 * i)),
                                SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=2,
                                               structured=structured)))
    assert solo_mismatches(tiny_bundle, arrivals, kv_blocks=128) == []


@pytest.mark.parametrize("padded", [False, True])
def test_the_grammar_tokenizer_is_llguidances_own_conversion(tiny_bundle, padded):
    """GrammarCompiler builds llguidance's tokenizer from the backend's JSON without copying it first;
    it must be what llguidance.hf.from_tokenizer builds (a tokenizer set to pad takes that path)."""
    import copy

    import llguidance.hf

    from isolab.engine.grammar import GrammarCompiler

    tok = tiny_bundle.tokenizer
    if padded:
        tok = copy.copy(tok)
        tok._tok = copy.deepcopy(tok.hf)
        tok.hf.backend_tokenizer.enable_padding(length=64)
    ours = GrammarCompiler(tok, tiny_bundle.hparams.vocab_size, tiny_bundle.fingerprint).lltok
    ref = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tiny_bundle.hparams.vocab_size)
    assert (ours.vocab_size, ours.eos_token) == (ref.vocab_size, ref.eos_token)
    assert all(ours.decode_bytes([i]) == ref.decode_bytes([i]) for i in range(ref.vocab_size))
    for text in ("Answer in JSON.", '{"k": [1, 2.5e3, "ünï\\u00e9"]}', "  spaces\n\tand tabs"):
        assert ours.tokenize_str(text) == ref.tokenize_str(text)


def test_an_llguidance_error_without_a_message_is_still_a_400(tiny_bundle, monkeypatch):
    """llguidance may raise a ValueError with no text: the 400 names the error's type, not nothing
    (an empty message read as "no error" would go on to use a grammar that was never made)."""
    from types import SimpleNamespace

    from isolab.engine.grammar import GrammarCompiler
    from isolab.errors import InvalidRequestError

    compiler = GrammarCompiler(tiny_bundle.tokenizer, tiny_bundle.hparams.vocab_size, tiny_bundle.fingerprint)

    def fail(*_a, **_k):
        raise ValueError("")

    monkeypatch.setattr(compiler, "_ll", SimpleNamespace(LLMatcher=SimpleNamespace(grammar_from_json_schema=fail)))
    with pytest.raises(InvalidRequestError, match="the grammar is not valid: ValueError") as exc:
        compiler.compile(GrammarSpec.json_schema({"type": "string"}))
    assert exc.value.field == "response_format" and compiler.num_compiled == 0


@pytest.mark.parametrize("order", [("zeta", "beta", "alpha"), ("answer", "reasoning"), ("reasoning", "answer")])
def test_properties_come_out_in_the_schemas_order(srv, order):
    """As OpenAI's structured outputs: the object's keys in the order the schema lists them (a schema
    that asks for "reasoning" before "answer" gets the reasoning first), never sorted."""
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 8} for k in order},
              "required": list(order), "additionalProperties": False}
    for seed in range(2):
        text, reason = _chat(srv, False, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}})
        assert reason == "stop" and tuple(json.loads(text)) == order, text


def test_the_compiler_builds_its_tokenizer_on_first_use_and_keeps_a_bounded_cache(tiny_bundle, monkeypatch):
    """A server that never sees a structured request never holds llguidance's tokenizer (tens of MiB
    for a real vocabulary); and a client sending a new schema each time cannot grow the cache
    without bound: the least recently used grammar goes."""
    from isolab.engine import grammar
    from isolab.engine.grammar import GrammarCompiler

    monkeypatch.setattr(grammar, "MAX_CACHED", 2)
    compiler = GrammarCompiler(tiny_bundle.tokenizer, tiny_bundle.hparams.vocab_size, tiny_bundle.fingerprint)
    assert compiler._lltok is None
    specs = [GrammarSpec.choice([w, w + "!"]) for w in ("a", "b", "c")]
    first = compiler.compile(specs[0])
    assert compiler._lltok is not None
    compiler.compile(specs[1])
    assert compiler.compile(specs[0]) is first  # a hit: now the most recent
    compiler.compile(specs[2])  # evicts b, the least recently used
    assert list(compiler._cache) == [first.key, specs[2].key(compiler.fingerprint)]
    assert compiler.num_compiled == 3
    assert not compiler.matcher(first).is_error()


SHORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
         "additionalProperties": False}  # (one the tiny model finishes within max_tokens)


@pytest.mark.parametrize("body,moot", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SHORT}}, "stop": ["{", "\""]},
     "stop"),
    ({"guided_json": SHORT, "stop": "city", "stop_token_ids": [1, 2, 3, 4, 5]}, "stop,stop_token_ids"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SHORT}}],
      "tool_choice": "required", "stop": ["city", "\""]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop": ["{"]}, "stop"),
])
def test_stops_beside_a_json_output_do_not_cut_it_and_are_reported(srv, body, moot):
    """A JSON output ends itself once complete; a stop string or token would only cut it (a QA pass got
    '{"' with finish_reason stop, and a forced tool call's wrapper cut open as content). They do not
    apply to it, and the reply names them in x-isolab-ignored-params. (OpenAI and vLLM take them, so
    refusing them broke clients that set a model-wide stop.)"""
    r = httpx.post(srv.base_url + "/chat/completions", headers=H,
                   json={"messages": MSG, "max_tokens": 48, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    assert r.headers["x-isolab-ignored-params"] == moot
    choice = r.json()["choices"][0]
    if "tools" in body:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice
    else:
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice.get("stop_reason") is None


def test_objects_that_list_their_properties_are_closed_and_nothing_else_is():
    """close_objects: a plain object schema (its "properties", "required" among them, nothing composed)
    gets additionalProperties false wherever it nests; data (enum, const, default), a property named like
    a keyword, explicit openings and objects without "properties" stay as sent."""
    from isolab.engine.grammar import close_objects

    leaf = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"properties": leaf, "additionalProperties": {"type": "integer"}, "list": {"items": leaf},
                       "any": {"type": "object"}, "none": {"type": "object", "properties": {}},
                       "open": {**leaf, "additionalProperties": True}, "pat": {**leaf, "patternProperties": {"^x": {}}},
                       "either": {"anyOf": [leaf, {"const": 1}]}, "ref": {"$ref": "#/$defs/d"},
                       "unknown": {**leaf, "required": ["a", "b"]}},
        "$defs": {"d": leaf}, "enum": [leaf], "default": leaf,
    }
    closed = close_objects(schema)
    closed_leaf = {**leaf, "additionalProperties": False}
    assert closed["additionalProperties"] is False
    p = closed["properties"]
    assert p["properties"] == closed_leaf and p["additionalProperties"] == {"type": "integer"}
    assert p["list"]["items"] == closed_leaf and p["either"]["anyOf"][0] == closed_leaf
    assert closed["$defs"]["d"] == closed_leaf and p["none"]["additionalProperties"] is False
    assert p["any"] == {"type": "object"} and p["open"]["additionalProperties"] is True and "additionalProperties" not in p["pat"]
    assert "additionalProperties" not in p["unknown"]  # (required names a key it does not list)
    assert closed["enum"] == [leaf] and closed["default"] == leaf
    assert schema["properties"]["properties"] == leaf  # the caller's schema is not changed


BASE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("schema", "doc"), [
    ({"$defs": {"base": BASE}, "$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]},
     {"a": 1, "b": 2}),  # a $ref beside properties: their keys merge
    ({"$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}}]},
     {"a": 1, "b": 2}),  # OpenAPI's inheritance
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "oneOf": [{"properties": {"kind": {"const": "x"}, "x": {"type": "integer"}}, "required": ["x"]}]},
     {"kind": "x", "x": 1}),  # a discriminated union
    ({"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "anyOf": [{"properties": {"p": {"properties": {"b": {"type": "integer"}}}}}]}, {"p": {"a": 1, "b": 2}}),
    ({"allOf": [{"properties": {"p": {"properties": {"a": {"type": "integer"}}}}},
                {"properties": {"p": {"properties": {"b": {"type": "integer"}}}}}]}, {"p": {"a": 1, "b": 2}}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}, {"a": 1, "z": 2}),
    ({"anyOf": [BASE, {"type": "object", "properties": {"b": {"type": "integer"}}}]}, {"b": 2}),
])
def test_closing_never_refuses_a_document_the_schema_accepts(tiny_bundle, schema, doc):
    """A review found the first form of close_objects made composed schemas unsatisfiable (a $ref or
    allOf whose parts each got closed; a union's branches closed against the keys the object beside
    them lists). Each document here, valid under its schema, must still be accepted by the grammar."""
    from isolab.engine.grammar import GrammarCompiler

    jsonschema.validate(doc, schema)
    compiler = GrammarCompiler(tiny_bundle.tokenizer, tiny_bundle.hparams.vocab_size, tiny_bundle.fingerprint)
    matcher = compiler.matcher(compiler.compile(GrammarSpec.json_schema(schema)))
    matcher.consume_tokens(tiny_bundle.tokenizer.hf.encode(json.dumps(doc, separators=(",", ":")),
                                                          add_special_tokens=False))
    assert not matcher.is_error() and matcher.is_accepting(), matcher.get_error()


@pytest.mark.parametrize("via", ["response_format", "named tool"])
def test_an_object_schema_silent_on_other_keys_gives_only_its_own(srv, via):
    """A QA pass: a tool's parameters without additionalProperties (the usual shape of a tool schema)
    let SmolLM2 invent keys until max_tokens, with no tool call at all. The objects are closed as
    xgrammar and vLLM close them: on the tiny random model, every sampled output holds the schema's
    keys only, and ends."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "when": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}}},
              "required": ["city"]}
    for seed in range(6):
        if via == "response_format":
            text, reason = _chat(srv, False, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            out = json.loads(text)
        else:
            r = srv.client().chat.completions.create(
                model=srv.model, messages=MSG, max_tokens=80, temperature=1.0, seed=seed,
                tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                tool_choice={"type": "function", "function": {"name": "f"}})
            reason = r.choices[0].finish_reason
            out = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert reason in ("stop", "tool_calls"), (seed, reason)
        assert set(out) <= {"city", "when"} and set(out.get("when", {})) <= {"h"}, (seed, out)
