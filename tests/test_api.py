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
