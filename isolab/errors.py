"""Owns the exception hierarchy; every error a user can cause is one of these.

    IsolabError                      base: catch this to catch everything we raise on purpose
     +-- ModelLoadError              the file is missing, corrupt or not a GGUF
     |    +-- UnsupportedModelError  an architecture or tensor type we do not implement
     +-- InvalidRequestError         bad input to the API (also a ValueError)
     |    +-- PromptTooLongError     the prompt cannot fit the context or the cache
     +-- IsolationViolation          audit mode saw a read of a block the reader may not see
     +-- RequestAborted              the request was cancelled before it finished
     +-- EngineUnavailable           the engine (a replica) serving it stopped; retrying may work

The CLI turns any IsolabError into one sentence on stderr and a non-zero exit; the server turns
InvalidRequestError into a 4xx with an OpenAI-style error body.
"""

from __future__ import annotations


def is_whole(value: object) -> bool:
    """An int and not a bool: what an option counted in whole numbers takes (True is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


class IsolabError(Exception):
    """Base of every error isolab raises on purpose."""


class ModelLoadError(IsolabError):
    """The model file is missing, unreadable, corrupt, or not a GGUF."""


class UnsupportedModelError(ModelLoadError):
    """The GGUF holds an architecture or a tensor type that isolab does not implement."""


class InvalidRequestError(IsolabError, ValueError):
    """A request or a parameter is invalid; the message names the field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:  # pickled with its field (a replica's output crosses to the ingress)
        return _invalid_request, (type(self), str(self), self.field)


def _invalid_request(cls: type[InvalidRequestError], message: str, field: str | None) -> InvalidRequestError:
    return cls(message, field=field)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) cannot fit in the model's context or in the KV cache."""


class IsolationViolation(IsolabError):
    """Audit mode caught a read of a KV block that the reader does not own and may not share."""

    def __init__(self, message: str, *, reader: str, block_id: int, writer: str | None, kind: str = "read") -> None:
        super().__init__(message)
        self.kind = kind  # "read" or "write"
        self.reader = reader
        self.block_id = block_id
        self.writer = writer


class RequestAborted(IsolabError):
    """The request was cancelled (by the caller, a disconnect, or shutdown) before it finished."""


class ModelOutputError(IsolabError):
    """The model computed no usable output for a request (its logits are NaN: broken weights); the
    message is safe to show a client and names no prompt text."""


class EngineUnavailable(IsolabError):
    """The engine serving the request stopped (a replica died); the message is safe to show a client."""
