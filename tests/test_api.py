"""The public API is pinned: adding or removing a name is a deliberate change."""

import isolab


def test_public_names_are_pinned():
    assert sorted(isolab.__all__) == sorted([
        "LLM", "CompletionOutput", "SamplingParams", "IsolabError", "InvalidRequestError",
        "IsolationViolation", "ModelLoadError", "PromptTooLongError", "UnsupportedModelError",
    ])
    from isolab import LLM, SamplingParams  # noqa: F401  the import the README shows


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
