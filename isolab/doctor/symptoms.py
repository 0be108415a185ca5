"""Owns what counts as a symptom: a run's output against the same request run alone, user checks,
and cross-scope cache hits. Pure functions over recorded results; nothing here runs a model.

Kinds:
  differs      the output differs from the same request run alone (an isolab engine is bit-exact,
               so any difference counts; for another server, a first differing token where the
               solo run's top two were within `tie_margin` nats is a near-tie, not a symptom)
  check        the user's check (a regex the text must match, or python:module:function) failed
  error        the request failed (e.g. audit mode caught an isolation violation)
  foreign-hit  the request was served more cached prompt tokens than any earlier request of its
               own scope shares with it: another scope's blocks, or blocks of other content
               (units: tokens, or characters for a server, an upper bound for ASCII text)
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from isolab.doctor.workload import Item
from isolab.errors import InvalidRequestError
from isolab.probe.verdicts import common_prefix_len


@dataclass(frozen=True)
class Result:
    item_id: str
    tokens: tuple[Hashable, ...]  # token ids (engine) or token strings (server)
    logprobs: tuple[float, ...]  # the chosen token's logprob at each position (may be empty)
    top: tuple[dict[Hashable, float], ...]  # the top alternatives at each position (may be empty)
    text: str
    cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Symptom:
    item_id: str
    kind: str  # differs | check | error | foreign-hit
    detail: str


Check = Callable[[str, str], bool]  # (prompt text, output text) -> ok


def parse_check(spec: str) -> Check:
    """'python:module:function' (called with prompt and output text, returns truthy when fine) or a regex."""
    if spec.startswith("python:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(parts[1:]):
            raise InvalidRequestError(f"--check {spec!r}: write python:module:function", field="check")
        if "" not in sys.path:
            sys.path.insert(0, "")
        try:
            fn = getattr(importlib.import_module(parts[1]), parts[2])
        except (Exception, SystemExit) as exc:  # ImportError, AttributeError, a SyntaxError, what it raises
            raise InvalidRequestError(f"--check {spec!r}: cannot load it ({type(exc).__name__}: {exc})",
                                      field="check") from None
        if not callable(fn):
            raise InvalidRequestError(f"--check {spec!r} is a {type(fn).__name__}, not a function", field="check")
        try:
            inspect.signature(fn).bind("prompt", "text")
        except TypeError as exc:
            raise InvalidRequestError(f"--check {spec!r} must take two arguments, the prompt and the output "
                                      f"text ({exc})", field="check") from None
        except ValueError:
            pass  # a builtin without a signature: its first call says

        def check(prompt: str, text: str) -> bool:
            try:
                return bool(fn(prompt, text))
            except (Exception, SystemExit) as exc:  # (SystemExit ended the doctor with exit 0: "no symptom")
                raise InvalidRequestError(f"--check {spec!r} raised {type(exc).__name__}: {exc}", field="check") from None

        return check
    try:
        rx = re.compile(spec)
    except re.error as exc:
        raise InvalidRequestError(f"--check {spec!r} is neither python:module:function nor a regex ({exc})", field="check") from None
    return lambda prompt, text: rx.search(text) is not None


def compare(ref: Result, got: Result, *, exact: bool, tie_margin: float) -> str | None:
    """Why `got` differs from the solo run `ref`, or None when it does not (or only at a near-tie)."""
    if got.tokens == ref.tokens:
        if exact and got.logprobs and ref.logprobs and got.logprobs != ref.logprobs:
            i = next(i for i, (a, b) in enumerate(zip(got.logprobs, ref.logprobs, strict=False)) if a != b)
            return f"same tokens, logprobs differ from position {i} ({got.logprobs[i]!r} vs {ref.logprobs[i]!r} alone)"
        return None
    n = min(len(got.tokens), len(ref.tokens))
    i = next((i for i in range(n) if got.tokens[i] != ref.tokens[i]), n)
    if not exact and i < len(ref.top) and ref.top[i]:
        alts = sorted(ref.top[i].values(), reverse=True)
        best = alts[0]
        other = ref.top[i].get(got.tokens[i]) if i < len(got.tokens) else None
        # a token outside the reported top-k scored at most the lowest of them (as probe/verdicts.py)
        runner_up = other if other is not None else (alts[-1] if len(alts) > 1 else None)
        if runner_up is not None and best - runner_up < tie_margin:
            return None  # a near-tie alone: drift, not contamination
    wrong = sum(1 for a, b in zip(got.tokens[i:], ref.tokens[i:], strict=False) if a != b)
    return f"tokens differ from position {i} on ({wrong} of the next {max(len(ref.tokens) - i, 0)} wrong)"


def foreign_hits(
    admitted: Sequence[tuple[Item, Result]], history: Sequence[tuple[Item, Result]] = ()
) -> list[Symptom]:
    """Hits larger than anything the request's own scope computed before it (admission order)."""
    out: list[Symptom] = []
    seen: list[tuple[Item, Result]] = list(history)
    for item, res in admitted:
        if res.cached_tokens > 0:
            own = other = 0
            for prev, pres in seen:
                before = prev.prompt + (pres.tokens if isinstance(prev.prompt, tuple) else pres.text)  # type: ignore[operator]
                n = common_prefix_len(item.prompt, before)
                if prev.scope == item.scope:
                    own = max(own, n)
                else:
                    other = max(other, n)
            if res.cached_tokens > own:
                whose = "another scope's blocks" if res.cached_tokens <= other else "blocks of other content"
                out.append(Symptom(item.item_id, "foreign-hit", (
                    f"scope {item.scope!r} was served {res.cached_tokens} cached tokens; earlier requests of its "
                    f"scope share at most {own} with it: {whose}")))
        seen.append((item, res))
    return out


def find_symptoms(
    items: Sequence[Item],
    results: dict[str, Result],
    refs: dict[str, Result],
    *,
    exact: bool,
    tie_margin: float = 0.1,
    checks: Sequence[Check] = (),
    errors_alone_too: bool = False,
) -> list[Symptom]:
    """Symptoms of one run: `results` by item id against `refs` (the same items, each run alone).
    An error its request also got alone (a request too large for the server, say) is no symptom of
    running together, unless errors_alone_too (the alone run's own symptoms)."""
    out: list[Symptom] = []
    for it in items:
        res = results.get(it.item_id)
        if res is None:
            continue
        ref = refs.get(it.item_id)
        if res.error is not None:
            if errors_alone_too or ref is None or ref.error != res.error:
                out.append(Symptom(it.item_id, "error", res.error))
            continue
        if ref is not None and ref.error is None and it.comparable:
            why = compare(ref, res, exact=exact, tie_margin=tie_margin)
            if why is not None:
                out.append(Symptom(it.item_id, "differs", why))
        prompt = it.prompt if isinstance(it.prompt, str) else (it.text or "")
        if any(not check(prompt, res.text) for check in checks):
            out.append(Symptom(it.item_id, "check", f"the user's check failed on {res.text[:60]!r}"))
    return out


def symptomatic_ids(symptoms: Sequence[Symptom]) -> set[str]:
    return {s.item_id for s in symptoms}
