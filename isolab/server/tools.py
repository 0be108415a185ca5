"""Owns tool calling for chat: the request's tools, the prompt that shows them, the grammar that
makes `required` and named calls parse, and reading calls back out of the model's text.

    tool_choice  none      tools are not shown; plain content
                 auto      tools shown; the model may answer with a call (a JSON object, or an
                           array of them, or <tool_call>...</tool_call>); read back at the end
                 required  the output is grammar-constrained to one call of any tool (an array of
                           calls when parallel_tool_calls), so its arguments always parse
                 named     constrained to a call of that one tool

SmolLM2's chat template does not know tools, so they are shown in a system message and earlier
calls and results are written into the conversation as text, for every template alike (`tools` is
not passed to the template). Does not know HTTP or the engine; it returns a GrammarSpec for the
sampler.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from isolab.sampling_params import GrammarSpec

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # ("yes" was taken)

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A call's arguments are an object (OpenAI): a schema of another type is refused, one that names
        no type is read as an object's."""
        if v and "type" in v and v["type"] != "object":
            raise ValueError(f"parameters must be the JSON Schema of an object ({{\"type\": \"object\", ...}}), "
                             f"not of type {v['type']!r}: a call's arguments are an object")
        return {"type": "object", **v} if v else v


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call the assistant made earlier in the conversation (sent back by the client)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    names: tuple[str, ...]  # the tools a call may name
    system: str  # what the model is shown about the tools
    structured: GrammarSpec | None  # required / named: the grammar of a call
    # auto: the grammar a call would have, compiled only to check the tools' parameters (a bad schema is
    # a 400 whatever tool_choice says)
    check: GrammarSpec | None = None
    parallel: bool = True  # parallel_tool_calls: false means one call at most, whatever the model wrote


# A function sent without `parameters` takes none (OpenAI: "omitting parameters defines a function
# with an empty parameter list"): its arguments are {}, not any object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS  # (an empty schema too: it would admit any JSON)


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    # "name" before "arguments": the model names the function before it writes its arguments
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool)},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """None when no tool may be called (no tools, or tool_choice none); a ToolError names a bad field.
    parallel None is OpenAI's default, true."""
    parallel = True if parallel is None else parallel
    if choice is not None and not tools and choice != "none":
        raise ToolError("tool_choice needs tools", "tool_choice")
    if not tools or choice == "none":
        return None
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct names", "tools")
    shown = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": _parameters(t)} for t in tools]
    system = ("You can call these functions:\n" + json.dumps(shown) + "\nTo call one, reply with only a JSON object "
              '{"name": <the function name>, "arguments": <an object of its parameters>}.')
    if isinstance(choice, NamedToolChoice):
        picked = [t for t in tools if t.function.name == choice.function.name]
        if not picked:
            raise ToolError(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", names, system, GrammarSpec.json_schema(_call_schema(picked[0]), "tool_choice"),
                        parallel=bool(parallel))
    if choice == "required":
        one: dict[str, Any] = {"anyOf": [_call_schema(t) for t in tools]}
        # parallel: an array of 1 to len(tools) calls, of any tools. Uncapped (as OpenAI's), a small
        # model greedily repeats its call until max_tokens (SmolLM2 with a loose schema: a black-box
        # QA pass), so a reply holds at most as many calls as there are tools
        schema = {"type": "array", "items": one, "minItems": 1, "maxItems": len(tools)} if parallel else one
        return ToolPlan("required", names, system, GrammarSpec.json_schema(schema, "tool_choice"), parallel=bool(parallel))
    return ToolPlan("auto", names, system, None, GrammarSpec.json_schema({"anyOf": [_call_schema(t) for t in tools]}, "tools"),
                    parallel=bool(parallel))


def history_text(calls: list[ToolCallIn]) -> str:
    """An earlier assistant turn's calls, written as the model is asked to write them."""
    objs = [{"name": c.function.name, "arguments": _loads(c.function.arguments)} for c in calls]
    return json.dumps(objs[0] if len(objs) == 1 else objs)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The calls in the model's text, as OpenAI's tool_calls entries; None when it is not a call."""
    blocks = _TAGGED.findall(text) or [text.strip()]
    calls: list[dict[str, Any]] = []
    for block in blocks:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        for obj in value if isinstance(value, list) else [value]:
            if not (isinstance(obj, dict) and obj.get("name") in plan.names and isinstance(obj.get("arguments"), dict)):
                return None
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])}})
    return (calls if plan.parallel else calls[:1]) or None


@dataclass
class ToolOutput:
    """One choice's text while tools may be called: held back, read as calls (or content) at the end."""

    plan: ToolPlan
    parts: list[str] = field(default_factory=list)
    lps: list[Any] = field(default_factory=list)  # the held text's logprobs entries (TokenLogprob), sent with it
