"""What counts as a symptom: exact and near-tie comparison, checks, cross-scope hits."""

from __future__ import annotations

import string

import pytest

from isolab.doctor.symptoms import Result, compare, find_symptoms, foreign_hits, parse_check
from isolab.doctor.workload import Item, builtin_workload, token_variant, word_variant
from isolab.errors import InvalidRequestError


def res(tokens, lps=(), top=(), text="", cached=0, rid="r"):
    return Result(rid, tuple(tokens), tuple(lps), tuple(top), text, cached)


def test_exact_counts_a_logprob_only_difference():
    assert compare(res([1, 2], [-0.5, -1.0]), res([1, 2], [-0.5, -1.0]), exact=True, tie_margin=0) is None
    assert "logprobs differ from position 1" in compare(res([1, 2], [-0.5, -1.0]), res([1, 2], [-0.5, -1.1]), exact=True, tie_margin=0)
    assert "position 1" in compare(res([1, 2, 3]), res([1, 5, 3]), exact=True, tie_margin=0)


def test_near_tie_is_not_a_symptom_for_a_server():
    ref = res(["a", "b"], top=[{"a": -0.1}, {"b": -0.70, "c": -0.72}])
    assert compare(ref, res(["a", "c"]), exact=False, tie_margin=0.1) is None
    confident = res(["a", "b"], top=[{"a": -0.1}, {"b": -0.1, "c": -3.0}])
    assert compare(confident, res(["a", "c"]), exact=False, tie_margin=0.1) is not None


def test_checks_regex_and_python(tmp_path, monkeypatch):
    (tmp_path / "mycheck.py").write_text("def ok(prompt, text):\n    return 'bad' not in text\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    items = [Item("r0", "p")]
    for spec, text, n in (("^ok", "ok fine", 0), ("^ok", "nope", 1), ("python:mycheck:ok", "bad", 1), ("python:mycheck:ok", "good", 0)):
        sym = find_symptoms(items, {"r0": res([1], text=text, rid="r0")}, {}, exact=True, checks=[parse_check(spec)])
        assert len(sym) == n and all(s.kind == "check" for s in sym)
    with pytest.raises(InvalidRequestError):
        parse_check("python:nomodule_here:f")


def test_a_broken_python_check_is_a_sentence(tmp_path, monkeypatch):
    """A check that does not import, is no function, takes other arguments or raises is refused in
    one sentence (InvalidRequestError: exit 2), never a traceback read as a symptom (exit 1)."""
    (tmp_path / "syntaxbad.py").write_text("def f(p, t)\n    return True\n")
    (tmp_path / "checks.py").write_text("X = 5\ndef one(p):\n    return True\n"
                                        "def boom(p, t):\n    raise ValueError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, says in (("python:syntaxbad:f", "SyntaxError"), ("python:checks:X", "not a function"),
                       ("python:checks:one", "two arguments"), ("python:os.path:exists", "two arguments")):
        with pytest.raises(InvalidRequestError, match=says):
            parse_check(spec)
    (tmp_path / "exits.py").write_text("def f(p, t):\n    raise SystemExit(0)\n")
    with pytest.raises(InvalidRequestError, match="raised SystemExit"):  # (the doctor ended with exit 0)
        find_symptoms([Item("r0", "p")], {"r0": res([1], text="x", rid="r0")}, {}, exact=True,
                      checks=[parse_check("python:exits:f")])
    check = parse_check("python:checks:boom")
    with pytest.raises(InvalidRequestError, match="raised ValueError: boom"):
        find_symptoms([Item("r0", "p")], {"r0": res([1], text="x", rid="r0")}, {}, exact=True, checks=[check])


def test_cross_scope_hit_counts_only_foreign_blocks():
    a = Item("a1", (1, 2, 3, 4), scope="a")
    b = Item("b1", (1, 2, 3, 4), scope="b")
    a2 = Item("a2", (1, 2, 3, 9), scope="a")
    ok = foreign_hits([(a, res([7], rid="a1")), (a2, res([7], cached=3, rid="a2"))])
    assert ok == []
    bad = foreign_hits([(a, res([7], rid="a1")), (b, res([7], cached=3, rid="b1"))])
    assert [s.item_id for s in bad] == ["b1"] and bad[0].kind == "foreign-hit"
    assert "another scope" in bad[0].detail


def test_variants_keep_shapes_and_sharing():
    items = builtin_workload()
    var = word_variant(items, 1)
    for x, y in zip(items, var, strict=True):
        assert len(x.prompt) == len(y.prompt) and x.prompt != y.prompt
    same = [(i, j) for i in range(len(items)) for j in range(len(items)) if items[i].prompt == items[j].prompt]
    assert same == [(i, j) for i in range(len(var)) for j in range(len(var)) if var[i].prompt == var[j].prompt]
    ids = [Item("x", (5, 6, 7)), Item("y", (5, 6, 8))]
    tv = token_variant(ids, 0, 100, 200)
    assert tv[0].prompt[:2] == tv[1].prompt[:2] and tv[0].prompt != ids[0].prompt and len(tv[0].prompt) == 3


def test_a_token_outside_the_top_k_is_not_taken_for_a_near_tie():
    """The other run's token is not among the reference's top 3: its logprob is at most the lowest
    of them, so the margin is at least best - lowest, not best - second best."""
    ref = res(["a", "b"], top=[{"a": -0.1}, {"b": -0.70, "c": -0.72, "d": -4.0}])
    assert compare(ref, res(["a", "x"]), exact=False, tie_margin=0.1) is not None


class ScriptedServer:
    """A stand-in for a server whose cache outlives each request: `hits` says what each (item, content)
    is served from the cache, `fails` which prompts the server refuses (alone and together alike)."""

    name, exact, can_disable_cache, alone_label = "scripted", True, False, "alone"

    def __init__(self, hits=None, fails=()):
        self.hits, self.fails, self.history = hits or {}, set(fails), []

    def prepare(self, items):
        return list(items)

    def variant(self, items, seed):
        return word_variant(items, seed)

    def _run(self, it):
        if it.prompt in self.fails:
            return Result(it.item_id, (), (), (), "", 0, "HTTP 400: the request needs 17 KV blocks")
        return Result(it.item_id, (1, 2), (), (), "ok", self.hits.get((it.item_id, it.prompt), 0))

    def alone(self, it):
        r = self._run(it)
        self.history.append((it, r))
        return r

    def together(self, items, concurrency, prefix_cache):
        out = [(it, self._run(it)) for it in items]
        self.history.extend(out)
        return out, {}

    def cross_scope_history(self):
        return list(self.history)


P = "the shared secret prompt of tenant a"


def test_a_foreign_hit_in_the_alone_runs_is_a_symptom():
    """Scope b's first request, alone, is served scope a's blocks: later runs cannot tell (b has sent P by
    then), so the alone runs are where the hit shows."""
    from isolab.doctor.experiments import diagnose

    items = [Item("a0", P, scope="a"), Item("b0", P, scope="b")]
    from isolab.doctor.verdict import SHARED_STATE, judge

    found = diagnose(ScriptedServer(hits={("b0", P): 6}), items, concurrencies=(1,))
    assert any(s.kind == "foreign-hit" and s.item_id == "b0" for s in found.alone.symptoms), found.alone.symptoms
    verdict = judge(found)  # cross-request state, not "something else": and (a) says it needs no concurrency
    assert verdict.verdict == SHARED_STATE and verdict.answers[0].answer == "no", verdict


def test_an_error_the_request_also_gets_alone_is_no_symptom_of_sharing():
    from isolab.doctor.experiments import diagnose
    from isolab.doctor.verdict import judge

    items = [Item(f"r{i}", f"prompt number {i} of the workload", scope="a") for i in range(3)]
    server = ScriptedServer()
    variant = server.variant(items, 1)
    server.fails = {variant[0].prompt}  # the variant's first request is too large for the server
    found = diagnose(server, items, concurrencies=(1, 2))
    assert not found.variant.symptoms and any("variant requests failed even alone" in w for w in found.warnings)
    assert "shared state" not in judge(found).verdict


def test_word_variant_ends_on_any_text_and_keeps_its_whitespace():
    """Double spaces (an empty word) and more one-letter words than letters hung it before."""
    items = [Item("a", " hello  world\n"), Item("b", " ".join(string.ascii_letters)), Item("c", "world hello")]
    var = word_variant(items, 1)
    for x, y in zip(items, var, strict=True):
        assert len(x.prompt) == len(y.prompt) and x.prompt != y.prompt
        assert [i for i, ch in enumerate(x.prompt) if ch.isspace()] == [i for i, ch in enumerate(y.prompt) if ch.isspace()]
    words = [w for it in var for w in it.prompt.split()]
    originals = [w for it in items for w in it.prompt.split()]
    assert all(a != b for a, b in zip(words, originals, strict=True))  # every word is another
    assert len(set(words)) == len(set(originals))  # one bijection


def test_a_workload_request_of_no_tokens_is_refused(tmp_path):
    from isolab.doctor.workload import load_jsonl

    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello", "max_tokens": 0}\n')
    with pytest.raises(InvalidRequestError, match="line 1: max_tokens must be at least 1"):
        load_jsonl(f)


def test_word_variant_keeps_the_token_count_near_on_the_real_tokenizer(real_bundle):
    """docs/doctor.md: the variant over HTTP costs about the original's tokens (1.05x on the built-in
    workload with SmolLM2's tokenizer); made-up words of the same length took about twice as many."""
    items = builtin_workload()
    count = lambda its: sum(len(real_bundle.tokenizer.encode(it.prompt)) for it in its)  # noqa: E731
    assert count(word_variant(items, 1)) / count(items) < 1.1
