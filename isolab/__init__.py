"""isolab: an LLM inference engine whose paged, shared KV cache is isolated by construction."""

from isolab.errors import (
    InvalidRequestError,
    IsolabError,
    IsolationViolation,
    ModelLoadError,
    PromptTooLongError,
    UnsupportedModelError,
)
from isolab.llm import LLM, CompletionOutput
from isolab.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "SamplingParams",
    "IsolabError",
    "InvalidRequestError",
    "IsolationViolation",
    "ModelLoadError",
    "PromptTooLongError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
