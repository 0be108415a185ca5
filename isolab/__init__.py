"""isolab: an LLM inference engine whose paged, shared KV cache is isolated by construction."""

from typing import TYPE_CHECKING, Any

from isolab.errors import (
    InvalidRequestError,
    IsolabError,
    IsolationViolation,
    ModelLoadError,
    PromptTooLongError,
    UnsupportedModelError,
)

if TYPE_CHECKING:  # for type checkers; at run time these load on first use (see __getattr__)
    from isolab.llm import LLM, CompletionOutput
    from isolab.sampling_params import GrammarSpec, SamplingParams

# The engine (and torch) load only when asked for: `isolab race` and `isolab probe` never pay
# for them.
_LAZY = {"LLM": "isolab.llm", "CompletionOutput": "isolab.llm", "SamplingParams": "isolab.sampling_params",
         "GrammarSpec": "isolab.sampling_params"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'isolab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "CompletionOutput",
    "SamplingParams",
    "GrammarSpec",
    "IsolabError",
    "InvalidRequestError",
    "IsolationViolation",
    "ModelLoadError",
    "PromptTooLongError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
