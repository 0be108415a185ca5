"""Tool calling through the official `openai` client (issue 15): with tool_choice required or a
named tool the arguments are grammar-constrained, so even the tiny random model's calls parse and
match the function's schema; tool_calls come back in the message and in streamed deltas; earlier
calls and `tool` results go back into the conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from isolab.server.tools import ToolPlan, parse_calls

H = {"Authorization": "Bearer sk-alice"}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def srv(server_factory, long_tiny_bundle):
    return server_factory(long_tiny_bundle)  # 4k context: the byte tokenizer makes the tools' prompt long


def _check_calls(calls, allowed=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_calls_always_parse(srv, seed):
    r = srv.client().chat.completions.create(
        model=srv.model, messages=MSG, tools=TOOLS, max_tokens=200, seed=seed, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content is None
    _check_calls(m.message.tool_calls, allowed=("get_weather",))


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_of_the_tools(srv, parallel):
    r = srv.client().chat.completions.create(model=srv.model, messages=MSG, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=300, seed=3)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls"
    _check_calls(m.message.tool_calls)
    if not parallel:
        assert len(m.message.tool_calls) == 1


def test_a_parameters_schema_without_a_type_is_read_as_an_objects(srv):
    """A schema naming no type would let the grammar write arguments of any JSON type, which no call
    can carry (they came back as text): it is read as an object's, so the named call parses."""
    untyped = {k: v for k, v in TIME.items() if k != "type"}
    r = srv.client().chat.completions.create(
        model=srv.model, messages=MSG, max_tokens=300, seed=3, parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": untyped}}],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.tool_calls[0].function.name == "get_time"
    assert isinstance(json.loads(m.message.tool_calls[0].function.arguments), dict)


def test_streamed_tool_calls_equal_the_reply(srv):
    kw = dict(model=srv.model, messages=MSG, tools=TOOLS, max_tokens=200, seed=5, temperature=0.8,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = srv.client().chat.completions.create(**kw).choices[0].message.tool_calls
    streamed, reason, last = [], None, None
    for ch in srv.client().chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed += c.delta.tool_calls or []
            reason = c.finish_reason or reason
            last = c
    assert reason == "tool_calls"
    # as OpenAI's streams: the finish_reason comes in a chunk of its own, with an empty delta
    assert last.finish_reason == "tool_calls" and not last.delta.tool_calls and not last.delta.content
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
           [(c.function.name, c.function.arguments) for c in whole]


def test_none_and_auto_answer_in_text_when_the_model_does_not_call(srv):
    for choice in ("none", "auto"):
        r = srv.client().chat.completions.create(model=srv.model, messages=MSG, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=8, seed=1)
        assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_a_conversation_with_earlier_calls_and_results(srv):
    first = srv.client().chat.completions.create(
        model=srv.model, messages=MSG, tools=TOOLS, max_tokens=200, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    r = srv.client().chat.completions.create(model=srv.model, messages=history, tools=TOOLS, max_tokens=8, seed=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    n = httpx.post(srv.url + "/tokenize", headers=H, json={"messages": history}).json()["count"]
    assert n > 0


def test_auto_reads_a_call_the_model_writes():
    plan = ToolPlan("auto", ("get_time",), "", None)
    calls = parse_calls('{"name": "get_time", "arguments": {"zone": "UTC"}}', plan)
    assert calls and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    tagged = parse_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', plan)
    assert tagged and tagged[0]["function"]["name"] == "get_time"
    assert parse_calls("It is noon.", plan) is None
    assert parse_calls('{"name": "rm_rf", "arguments": {}}', plan) is None  # not a tool it was given


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    # a call's arguments are an object: under required they came back as text, no tool call
    ({"tools": [{"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "echo", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    # an object missing its function: named as such, not as a wrong literal of the string form
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
])
def test_bad_tool_requests_are_400(srv, body, param):
    r = httpx.post(srv.base_url + "/chat/completions", headers=H, json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_by_max_tokens_is_length_and_never_a_tool_call(srv, choice):
    """A constrained call that max_tokens cuts off mid-arguments ends with finish_reason `length`
    and no tool_calls, streamed or not: a client must not run a call whose arguments are not
    whole (vLLM once reported such a turn as `tool_calls`). The text generated so far is content."""
    c = srv.client()
    r = c.chat.completions.create(model=srv.model, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=6, seed=1)
    m = r.choices[0]
    assert m.finish_reason == "length" and not m.message.tool_calls, m
    assert m.message.content
    reasons, calls, text = [], [], ""
    for ch in c.chat.completions.create(model=srv.model, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=6,
                                        seed=1, stream=True):
        for d in ch.choices:
            reasons.append(d.finish_reason)
            calls += d.delta.tool_calls or []
            text += d.delta.content or ""
    assert reasons[-1] == "length" and not calls and text == m.message.content


def test_parallel_tool_calls_false_keeps_one_call_of_an_auto_reply():
    """OpenAI: parallel_tool_calls false means at most one call; a model that writes two under auto
    gets its first back, and with parallel calls allowed, both."""
    two = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    one = parse_calls(two, ToolPlan("auto", ("get_time",), "", None, parallel=False))
    assert one is not None and [json.loads(c["function"]["arguments"]) for c in one] == [{"zone": "UTC"}]
    both = parse_calls(two, ToolPlan("auto", ("get_time",), "", None, parallel=True))
    assert both is not None and len(both) == 2


def test_parallel_required_calls_are_capped_at_the_number_of_tools():
    """The grammar of required parallel calls is an array of 1 to len(tools) calls: uncapped, a small
    model greedily repeats its call until max_tokens and the reply has no call at all."""
    from isolab.server.tools import ToolSpec, plan_tools

    for tools in (TOOLS[:1], TOOLS):
        plan = plan_tools([ToolSpec.model_validate(t) for t in tools], "required", True)
        schema = json.loads(plan.structured.source)
        assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, len(tools))


def test_a_function_without_parameters_is_called_with_empty_arguments(srv):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list, so a required
    call's arguments are exactly {} (not any object, which a model may fill until max_tokens)."""
    tools = [{"type": "function", "function": {"name": "get_random"}}]
    for seed in range(3):
        r = srv.client().chat.completions.create(model=srv.model, messages=MSG, tools=tools, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=60, seed=seed, temperature=1.0)
        m = r.choices[0]
        assert m.finish_reason == "tool_calls", m.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls][0] == ("get_random", {})


def test_a_call_names_its_function_before_its_arguments(srv):
    """The call's grammar keeps "name" before "arguments" (the model picks the function first): the
    first tokens of a required call cut short are its name."""
    r = srv.client().chat.completions.create(model=srv.model, messages=MSG, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=8, seed=0)
    text = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "length" and text.startswith('{"name"'), text


def test_an_empty_parameters_schema_takes_no_arguments():
    """parameters {} admits any JSON: read as no parameters (arguments {}), as a missing one is, so a
    required call's arguments always parse as an object."""
    from isolab.server.tools import ToolSpec, plan_tools

    plan = plan_tools([ToolSpec.model_validate({"type": "function", "function": {"name": "now", "parameters": {}}})],
                      "required", False)
    assert json.loads(plan.structured.source)["anyOf"][0]["properties"]["arguments"] == {
        "type": "object", "properties": {}, "additionalProperties": False}


def test_logprobs_of_a_held_tool_reply_go_with_it(srv):
    """With tools the text is held to the end; its logprobs are held with it: a stream sends no entry
    before the call (or content) goes out, and stream and reply carry the same entries."""
    kw = dict(model=srv.model, messages=MSG, tools=TOOLS, max_tokens=60, seed=2, temperature=0.8, logprobs=True,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = srv.client().chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.logprobs.content
    seen_call, entries = False, []
    for ch in srv.client().chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            if c.logprobs and c.logprobs.content:
                assert c.delta.tool_calls, "logprobs went out before the call they belong to"
                entries += c.logprobs.content
            seen_call |= bool(c.delta.tool_calls)
    assert seen_call and [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.logprobs.content]
