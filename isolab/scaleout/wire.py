"""Owns what crosses between the ingress and a replica: plain, picklable data, errors included.

An IsolabError subclass may carry fields its __init__ insists on (IsolationViolation): pickled
as-is it could fail to unpickle on the other side. So errors travel as (kind, message, field) and
are rebuilt here, into the types the server maps to replies (errors.api_error).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from isolab.engine.llm_engine import RequestOutput
from isolab.errors import (
    InvalidRequestError,
    IsolabError,
    ModelOutputError,
    PromptTooLongError,
    RequestAborted,
)
from isolab.models.invariance import InvarianceReport


@dataclass(frozen=True)
class ReplicaFacts:
    """What the ingress needs of the model without loading its weights (tokenizer, limits, numerics)."""
    path: str  # the GGUF as the replica resolved it (the same path on every node)
    name: str  # general.name
    fingerprint: str  # SHA-256 of the file: the tokenizer cache's key
    arch: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    numerics: InvarianceReport  # measured by the replica at its start


@dataclass(frozen=True)
class Admitted:
    replica: int
    incarnation: str


@dataclass(frozen=True)
class Refused:
    kind: str  # "too-long" | "invalid" | "aborted" (the replica is stopping) | "no-channel" (it restarted)
    message: str
    field: str | None

    @staticmethod
    def of(exc: InvalidRequestError | RequestAborted) -> Refused:
        if isinstance(exc, RequestAborted):
            return Refused("aborted", str(exc), None)
        return Refused("too-long" if isinstance(exc, PromptTooLongError) else "invalid", str(exc), exc.field)

    def error(self) -> InvalidRequestError | RequestAborted:
        if self.kind == "aborted":
            return RequestAborted(self.message)
        cls = PromptTooLongError if self.kind == "too-long" else InvalidRequestError
        return cls(self.message, field=self.field)


def to_wire(out: RequestOutput) -> RequestOutput:
    """The output with its error (if any) reduced to the base class and its message; a request's own
    fault (InvalidRequestError: a grammar no token continues) keeps its class and field, so the
    ingress answers it as one engine does (a 400 naming the field), and a ModelOutputError its class
    (its message is shown to the client)."""
    if out.error is None or type(out.error) is IsolabError:
        return out
    if isinstance(out.error, InvalidRequestError):
        return dataclasses.replace(out, error=Refused.of(out.error).error())
    if isinstance(out.error, ModelOutputError):  # a broken model's NaN row: said to the client as it is
        return dataclasses.replace(out, error=ModelOutputError(str(out.error)))
    return dataclasses.replace(out, error=IsolabError(str(out.error)))
