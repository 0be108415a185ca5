"""Owns structured outputs: grammars compiled once and shared read-only, and one matcher per request.

The seed's rule, applied to grammars: the compiled grammar is immutable and shared (a cache
keyed by a SHA-256 over the spec's kind, its canonical text and the tokenizer's fingerprint, like
every other cache key here); the matcher, which moves with each sampled token, belongs to one
request and is never shared. A mask changes only its own row's logits, so batch invariance and
the isolation guarantee hold with constrained requests in the batch.

Uses llguidance (its Rust matcher; 3 MB, no dependencies) for JSON schemas, regular expressions
and Lark grammars. Does not know HTTP (the server turns OpenAI's response_format and vLLM's
guided_* fields into a GrammarSpec) nor the sampler's other rules.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isolab.errors import InvalidRequestError
from isolab.sampling_params import GrammarSpec

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from isolab.models.tokenizer import Tokenizer

# Compact JSON (no free whitespace): a small model otherwise fills its budget with newlines.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
MAX_CACHED = 1024  # compiled grammars a compiler keeps (each its grammar's text)


# Where a JSON schema holds the schemas of values nested in the one it describes (the rest, "enum",
# "const", "default", "examples", is data; "not", "if", "contains", "propertyNames" are left as sent).
_ONE = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_LIST = ("prefixItems", "items", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Keywords that make an object's schema a composition: its keys come from more than one place
_COMPOSES = ("$ref", "allOf", "anyOf", "oneOf", "if", "then", "else", "not", "dependentSchemas", "dependencies",
             "dependentRequired", "patternProperties", "additionalProperties", "unevaluatedProperties")


def _composes_objects(schema: object) -> bool:
    """Whether objects are put together from parts anywhere in the schema: an allOf, or a $ref beside
    other keywords (their keys merge, so closing each part would leave no object that satisfies all)."""
    if isinstance(schema, dict):
        if "allOf" in schema or ("$ref" in schema and len(schema) > 1 and set(schema) - {"$ref", "description",
                                                                                      "title", "$comment"}):
            return True
        return any(_composes_objects(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_composes_objects(v) for v in schema)
    return False


def close_objects(schema: object) -> object:
    """The schema with each plain object closed: one that lists its "properties", names only those in
    "required", and says nothing of other keys or of parts it is composed with gets additionalProperties
    false, as xgrammar (vLLM's default backend) reads a schema; OpenAI's strict mode requires schemas to
    say so. JSON Schema itself leaves such an object open, and a small model under an open object invents
    keys until max_tokens ({"city": "Paris", "type": "string", "temperature": ...}, a key even twice); a
    closed one admits only outputs the schema accepts.

    Left as sent: an object without "properties" ({"type": "object"}: any object); one beside anyOf,
    oneOf, $ref, if or dependencies (a discriminated union's branches add keys to it, so neither it nor
    its branches are closed); one whose "required" names a key it does not list; and the whole schema
    when it composes objects anywhere (allOf, a $ref beside other keywords: parts whose keys merge)."""
    if _composes_objects(schema):
        return schema
    return _close(schema)


def _close(schema: object) -> object:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    props = out.get("properties")
    own = isinstance(props, dict) or isinstance(out.get("required"), list)  # an object that names keys itself
    if own and ("anyOf" in out or "oneOf" in out):  # a union's branches add keys to it, and may describe
        return schema  # the same nested values its properties do: all of it left as sent
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s) for name, s in out[key].items()}
    required = out.get("required", [])
    if isinstance(props, dict) and not any(k in out for k in _COMPOSES) \
            and isinstance(required, list) and all(k in props for k in required):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class CompiledGrammar:
    key: str
    grammar: str  # llguidance's grammar text, validated against the tokenizer: read-only, shared


class GrammarCompiler:
    """One per engine (one tokenizer). compile() is cached; matcher() makes a request's own state."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, fingerprint: str) -> None:
        import llguidance

        self._ll = llguidance
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None  # built on first use (lltok)
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        # compiled grammars by key, least recently used first: at most MAX_CACHED (a client that sends a
        # new schema with every request must not grow the server without bound)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its handlers' threads
        self.num_compiled = 0

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer over the vocabulary, built on the first structured request (SmolLM2's
        49k tokens: 0.2 s and 37 MiB that a server which never sees one does not hold; hand-timed)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = self._build_lltok()
            return self._lltok

    def _build_lltok(self) -> llguidance.LLTokenizer:
        import llguidance.hf

        tok = self._tokenizer
        backend = getattr(tok.hf, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            # what llguidance.hf.from_tokenizer does, without its copy of the Rust tokenizer (made
            # only to switch padding and truncation off, which ours never has): 1.3 s and a
            # transient second vocabulary for Gemma 3's 262k tokens
            return self._ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=tok.hf.eos_token_id)
        return llguidance.hf.from_tokenizer(tok.hf, n_vocab=self.vocab_size)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = spec.key(self.fingerprint)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is not None:
            return hit
        M = self._ll.LLMatcher
        try:  # llguidance raises ValueError for what it cannot translate (a schema nested too deep, ...)
            if spec.kind == "json_schema":
                schema = json.dumps(close_objects(json.loads(spec.source)), separators=(",", ":"))
                text = M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif spec.kind == "json_object":
                text = M.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                text = M.grammar_from_regex(spec.source)
            elif spec.kind == "choice":
                text = M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(spec.source)))
            else:
                text = M.grammar_from_lark(spec.source)
            error = M.validate_grammar(text, self.lltok)
        except (ValueError, RecursionError) as exc:
            error = str(exc) or type(exc).__name__
        if error:
            raise InvalidRequestError(f"{spec.field}: the grammar is not valid: {error}", field=spec.field)
        compiled = CompiledGrammar(key, text)
        with self._lock:
            self._cache.setdefault(key, compiled)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> llguidance.LLMatcher:
        """A fresh matcher: this request's own parser state, never shared."""
        # log_level 0: its errors come back through get_error() into the request's 400, not to stderr,
        # where a warning line would carry output text past the server's logger
        m = self._ll.LLMatcher(self.lltok, compiled.grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"the grammar could not start: {m.get_error()}", field="response_format")
        return m
