"""Owns reading a request's structured-output fields into one GrammarSpec (engine/grammar.py compiles it).

    response_format {"type": "json_object"}                                  OpenAI
    response_format {"type": "json_schema", "json_schema": {"schema": ...}}  OpenAI (strict or not)
    guided_json / guided_regex / guided_choice                               vLLM
    structured_outputs {"json" | "regex" | "choice": ...}                    vLLM's newer name
    json_schema                                                              llama.cpp's server

At most one per request (two are a 400 naming the second). Does not compile or validate the
grammar itself: the engine's compiler does, and its errors become a 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.sampling_params import GrammarSpec
from isolab.server.errors import ApiError, api_error
from isolab.server.protocol import BaseRequest


def _response_format(rf: dict[str, Any]) -> GrammarSpec | None:
    if "type" not in rf:  # (OpenAI and vLLM require it)
        raise ApiError(400, "response_format needs a type: text, json_object or json_schema", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:  # (some hosted APIs take this form; it would be any JSON object here)
            raise ApiError(400, "response_format json_object takes no schema: send {'type': 'json_schema', "
                                "'json_schema': {'name': ..., 'schema': {...}}}", param="response_format.schema")
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ApiError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                           param="response_format")
        name = js.get("name")
        if name is None:  # (OpenAI requires it; it names the format and shapes nothing here)
            raise ApiError(400, "response_format.json_schema needs a name (letters, digits, _ and -, at most 64)",
                           param="response_format.json_schema.name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ApiError(400, "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                           param="response_format.json_schema.name")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):  # ("yes" was taken)
            raise ApiError(400, f"response_format.json_schema.strict must be true or false, not {js['strict']!r}",
                           param="response_format.json_schema.strict")
        return GrammarSpec.json_schema(js["schema"], "response_format")
    raise ApiError(400, f"response_format type must be text, json_object or json_schema, not {kind!r}",
                   param="response_format")


def _structured_outputs(so: dict[str, Any]) -> GrammarSpec:
    given = [k for k in ("json", "regex", "choice") if so.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, "structured_outputs takes exactly one of json, regex, choice", param="structured_outputs")
    k = given[0]
    if k == "json":
        return GrammarSpec.json_schema(so["json"], "structured_outputs")
    if k == "regex":
        return _regex(so["regex"], "structured_outputs")
    return GrammarSpec.choice(so["choice"], "structured_outputs")


def _regex(value: Any, field: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field} must be a non-empty regular expression", param=field)
    return GrammarSpec("regex", value, field)


def structured_spec(body: BaseRequest) -> GrammarSpec | None:
    """The request's grammar, or None; a 400 naming the field for a malformed one or for two at once."""
    found: list[GrammarSpec] = []
    try:
        if body.response_format is not None:
            spec = _response_format(body.response_format)
            if spec is not None:
                found.append(spec)
        if body.guided_json is not None:
            found.append(GrammarSpec.json_schema(body.guided_json, "guided_json"))
        if body.guided_regex is not None:
            found.append(_regex(body.guided_regex, "guided_regex"))
        if body.guided_choice is not None:
            found.append(GrammarSpec.choice(body.guided_choice, "guided_choice"))
        if body.structured_outputs is not None:
            found.append(_structured_outputs(body.structured_outputs))
        if body.json_schema is not None:
            found.append(GrammarSpec.json_schema(body.json_schema, "json_schema"))
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    if len(found) > 1:
        raise ApiError(400, f"ask for one structured output, not {found[0].field} and {found[1].field}",
                       param=found[1].field)
    return found[0] if found else None
