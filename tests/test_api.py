"""The public API is pinned: adding or removing a name is a deliberate change."""

import isolab


def test_public_names_are_pinned():
    assert sorted(isolab.__all__) == sorted([
        "LLM", "CompletionOutput", "SamplingParams", "GrammarSpec", "IsolabError", "InvalidRequestError",
        "IsolationViolation", "ModelLoadError", "PromptTooLongError", "UnsupportedModelError",
    ])
    from isolab import LLM, GrammarSpec, SamplingParams  # noqa: F401  the imports the README shows


def test_errors_are_typed():
    assert issubclass(isolab.InvalidRequestError, ValueError)
    assert issubclass(isolab.PromptTooLongError, isolab.InvalidRequestError)
    assert issubclass(isolab.UnsupportedModelError, isolab.ModelLoadError)


def test_llm_refuses_malformed_arguments_in_a_sentence(tiny_path):
    """What `LLM.generate` and `LLM.chat` are handed wrongly is an InvalidRequestError naming the
    mistake (it was a TypeError or AttributeError from deep inside)."""
    import pytest

    from isolab import LLM, SamplingParams

    llm = LLM(model=str(tiny_path))
    sp = SamplingParams(max_tokens=2)
    cases = [
        (lambda: llm.generate(None, sp), "prompts are text, token ids, or a list of either, not NoneType"),
        (lambda: llm.generate(["a", None], sp), "a prompt is text or a list of token ids, not NoneType"),
        (lambda: llm.generate("a", {"max_tokens": 2}), "params are a SamplingParams, or one per prompt, not dict"),
        (lambda: llm.chat("hello", sp), "chat takes a conversation"),
        (lambda: llm.generate([1], SamplingParams(max_tokens=10**6)), "the prompt has 1 token and max_tokens"),
    ]
    for call, message in cases:
        with pytest.raises(isolab.InvalidRequestError, match=message.replace("(", r"\(")):
            call()
    assert len(llm.generate([[1, 2, 3], [4, 5]], [sp, sp])) == 2  # the forms it takes still work


def test_llm_chat_refuses_a_bad_message_as_the_server_does(tiny_path):
    """A message LLM.chat cannot read is refused with the sentence the server's 400 carries for the same
    message (one reader of pydantic's errors), under `messages[i]`. (A union's member tag leaked into it
    before: `messages[1].content.str: ...`.)"""
    import pytest
    from pydantic import ValidationError

    from isolab import LLM, SamplingParams
    from isolab.server.errors import validation_error
    from isolab.server.protocol import ChatCompletionRequest

    llm = LLM(model=str(tiny_path))
    ok = {"role": "user", "content": "hi"}
    for bad in ({"role": "robot", "content": "x"}, {"role": "user"}, {"role": "user", "content": 5}, "hello",
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
                {"role": "tool", "content": "x"}):
        with pytest.raises(ValidationError) as served:
            ChatCompletionRequest.model_validate({"model": "m", "messages": [ok, bad]})
        want = validation_error(list(served.value.errors())).message
        assert want.startswith("messages.1")
        with pytest.raises(isolab.InvalidRequestError) as got:
            llm.chat([ok, bad], SamplingParams(max_tokens=1))
        assert str(got.value) == "messages[1]" + want.removeprefix("messages.1"), (str(got.value), want)
        assert ".str" not in str(got.value)


def test_structured_outputs_from_python_as_the_readme_shows(tiny_path):
    """GrammarSpec is public (it lived in isolab.sampling_params alone, undocumented): a JSON schema
    from LLM.chat gives JSON that validates (the tiny model's, with a schema it finishes quickly)."""
    import json

    from isolab import LLM, GrammarSpec, SamplingParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
              "additionalProperties": False}
    out = LLM(model=str(tiny_path)).chat([{"role": "user", "content": "Where?"}], SamplingParams(
        max_tokens=24, temperature=0.0, structured=GrammarSpec.json_schema(schema)))[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"city"} and len(json.loads(out.text)["city"]) <= 4
