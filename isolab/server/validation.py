"""Owns reading pydantic's validation errors as one sentence and the parameter at fault, so the
server's 400s (errors.validation_error) and `LLM.chat`'s refusals of a message say the same thing.
Loads no web stack."""

from __future__ import annotations

from typing import Any

from isolab.server.refused import RefusedField

# pydantic's errors where a value had the wrong kind altogether; any other (a bound, a literal, a field
# missing from an object of the right form) says more
_TYPE_MISMATCH = ("_type",)
_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union an error is about in its loc ('str', 'list[int]', a model's
    class name: 'NamedToolChoice'; the protocol's own fields are snake_case)."""
    return isinstance(part, str) and ("[" in part or part in _SCALAR_TAGS or part.startswith(("function-", "constrained-"))
                                      or part[:1].isupper())


def describe(errors: list[Any]) -> tuple[str, str | None]:
    """(sentence, param) for pydantic's `errors`: the error that says most about the first value at
    fault (where it fits none of a union's forms, the error of the form it got deepest into, over a
    bare 'not a string'), its path without pydantic's union tags as `param` (None for the whole value).
    Where param is set the sentence starts with it."""
    if not errors:
        return "the body is not valid", None
    first = errors[0]
    refused = (first.get("ctx") or {}).get("error")
    if isinstance(refused, RefusedField):
        return str(refused), refused.name
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return f"the body is not valid JSON ({(first.get('ctx') or {}).get('error', 'a decode error')})", None
    if tuple(first.get("loc", ())) == ("body",):
        return "the body must be a JSON object, sent with Content-Type: application/json", None
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, x in enumerate(loc) if _is_union_tag(x)), len(loc))  # the value at fault ends here
    same = [e for e in errors if tuple(e.get("loc", ()))[:cut] == loc[:cut]]
    best = min(same, key=lambda e: (str(e.get("type", "")).endswith(_TYPE_MISMATCH), -len(e.get("loc", ()))))
    param = ".".join(str(x) for x in best.get("loc", ()) if x != "body" and not _is_union_tag(x)) or None
    if best.get("type") == "none_required":
        return f"{param} is not supported", param
    msg = str(best.get("msg", "invalid")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
