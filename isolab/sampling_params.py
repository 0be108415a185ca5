"""Owns SamplingParams: what a request asks of the sampler, validated once and frozen."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from isolab.errors import InvalidRequestError, is_whole

log = logging.getLogger("isolab")

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]


def _choice_list(options: Any) -> bool:
    """What a choice grammar takes: a non-empty list of non-empty strings."""
    return isinstance(options, list) and bool(options) and all(isinstance(o, str) and o for o in options)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: frozen and hashable, so SamplingParams stays frozen."""

    kind: GrammarKind
    source: str  # json_schema: the schema as canonical JSON; regex; choice: a JSON list; lark; json_object: ""
    field: str = "response_format"  # the request field it came from, named in a 400

    def __post_init__(self) -> None:
        # (built directly, an unknown kind ran as a Lark grammar and an empty choice list gave "")
        if self.kind not in get_args(GrammarKind):
            raise InvalidRequestError(f"{self.field}: a grammar's kind is one of {', '.join(get_args(GrammarKind))}, "
                                      f"not {self.kind!r}", field=self.field)
        if not isinstance(self.source, str):
            raise InvalidRequestError(f"{self.field}: a grammar's source is a str, not {type(self.source).__name__}",
                                      field=self.field)
        if self.kind == "json_object" and self.source:
            raise InvalidRequestError(f"{self.field}: a json_object grammar takes no source (json_schema does)",
                                      field=self.field)
        if self.kind == "choice":
            try:
                options = json.loads(self.source)
            except (ValueError, RecursionError):
                options = None
            if not _choice_list(options):
                raise InvalidRequestError(f"{self.field}: a choice grammar's source is a JSON list of non-empty "
                                          "strings (GrammarSpec.choice builds it)", field=self.field)

    @classmethod
    def json_schema(cls, schema: Any, field: str = "response_format") -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise InvalidRequestError(f"{field}: the JSON schema is not valid JSON", field=field) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{field}: a JSON schema must be an object", field=field)
        # the keys' order as sent: llguidance writes an object's properties in the schema's order, as
        # OpenAI's structured outputs do ("reasoning" before "answer"), so the order shapes the output
        # and is part of the grammar's cache key (sorted keys once put "answer" first)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def choice(cls, options: Any, field: str = "guided_choice") -> GrammarSpec:
        if not _choice_list(options):
            raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings", field=field)
        return cls("choice", json.dumps(options), field)

    @property
    def ends_itself(self) -> bool:
        """JSON: the grammar ends the output (EOS once the value is complete), and a stop string or token
        that cut it short would leave text that parses as nothing, so stops do not apply to it. (A regex
        or a choice list is the client's own language, which a stop may be part of.)"""
        return self.kind in ("json_schema", "json_object")

    def key(self, tokenizer_fingerprint: str) -> str:
        h = hashlib.sha256()
        for part in (self.kind, self.source, tokenizer_fingerprint):
            b = part.encode()
            h.update(len(b).to_bytes(8, "big") + b)  # length-prefixed: no two field lists collide
        return h.hexdigest()



@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: the prompt is computed (e.g. for prompt_logprobs) and nothing is generated
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set whose mass reaches top_p
    top_k: int = 0  # 0 = off (-1, vLLM's off, is read as 0)
    seed: int | None = None  # one generator per request, seeded with this (random when None); [0, 2**64), a negative one read as 64 bits
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; N: and the top N
    # Logits processing, applied in this order to the rows that ask (engine/sampler.py):
    repetition_penalty: float = 1.0  # [0.01, 100]; tokens of prompt + output: positive logits / p, negative * p
    frequency_penalty: float = 0.0  # [-2, 2]; minus p x (times the token appeared in the output)
    presence_penalty: float = 0.0  # [-2, 2]; minus p once the token appeared in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    min_p: float = 0.0  # [0, 1]; after temperature, drop tokens below min_p x the top probability
    structured: GrammarSpec | None = None  # the output must match this grammar (engine/grammar.py)
    # None: no prompt logprobs; N >= 0: each prompt token's logprob given the tokens before it (the
    # first has none), with the top N. Such a request computes its whole prompt: no prefix-cache hit.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{field} {why}", field=field)

        def is_number(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        # the forms vLLM and OpenAI take too: None for nothing, one stop string, logit_bias as a dict
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        given: Any = () if self.logit_bias is None else self.logit_bias
        bias = given.items() if isinstance(given, Mapping) else given
        for name, value in (("stop", stop), ("stop_token_ids", () if self.stop_token_ids is None else self.stop_token_ids)):
            try:
                object.__setattr__(self, name, tuple(value))
            except TypeError:
                raise bad(name, f"must be a list, not {value!r}") from None
        try:
            object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise bad("logit_bias", "must map token ids to biases: {id: bias} or ((id, bias), ...)") from None
        if not is_whole(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", f"must be an integer >= 0, not {self.max_tokens!r}")
        if not is_number(self.temperature) or not (0.0 <= float(self.temperature) <= 100.0):
            raise bad("temperature", f"must be a number in [0, 100], not {self.temperature!r}")
        if not is_number(self.top_p) or not (0.0 <= float(self.top_p) <= 1.0):
            raise bad("top_p", f"must be in [0, 1], not {self.top_p!r}")
        if not is_whole(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (0 or -1 = off), not {self.top_k!r}")
        if self.top_k == -1:  # vLLM's "off" (its older releases take no other)
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and (not is_whole(self.seed) or not (-(2**63) <= self.seed < 2**64)):
            raise bad("seed", f"must be an integer in [-2**63, 2**64), not {self.seed!r}")
        if self.seed is not None and self.seed < 0:  # OpenAI's seeds are int64: read as 64 bits (torch's rule)
            object.__setattr__(self, "seed", self.seed % 2**64)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not is_whole(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOP_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], not {v!r}")

        for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not (lo <= float(v) <= hi):
                raise bad(name, f"must be a number in [{lo:g}, {hi:g}], not {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, int | float) or isinstance(rp, bool) or not (0.01 <= float(rp) <= 100.0):
            raise bad("repetition_penalty", f"must be a number in [0.01, 100] (1 = off), not {rp!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, not {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), not {t!r}")
            if not isinstance(b, int | float) or isinstance(b, bool) or not (-100.0 <= float(b) <= 100.0):
                raise bad("logit_bias", f"values must be numbers in [-100, 100], not {b!r}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias", "names a token twice")
        for name in ("ignore_eos",):  # ("yes" was taken as true)
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be True or False, not {getattr(self, name)!r}")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            raise bad("structured", f"must be a GrammarSpec (e.g. GrammarSpec.json_schema(schema)), not "
                                    f"{type(self.structured).__name__}")
        if self.structured is not None and self.structured.ends_itself:
            # JSON ends itself (EOS once the value is complete), and cut short it parses as nothing, so a
            # stop string or token does not apply to it (the server names them in x-isolab-ignored-params)
            moot = [name for name in ("stop", "stop_token_ids") if getattr(self, name)]
            if moot:
                log.warning("%s ignored: a JSON structured output (%s) ends itself once complete",
                            " and ".join(moot), self.structured.field)
                object.__setattr__(self, "stop", ())
                object.__setattr__(self, "stop_token_ids", ())

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, bias, min_tokens)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias or self.min_tokens or self.structured)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as vLLM): logits / 1e-300 overflow to inf, and NaN."""
        return self.temperature < GREEDY_BELOW
