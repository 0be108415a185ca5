"""Owns what a step touches and when two steps commute: the tokens the tracer records for each
visible operation, and the independence test the sleep-set reduction (strategies.py) uses; does
not know threads, bytecode tracing or search.

A token is (mode, kind, key): mode "r" or "w"; kind "attr" / "global" / "deref" keyed by name
(any object: two threads touching `x` of different objects still count as conflicting), "subscr"
for the contents of any container (one key for all), "prim" keyed by a modelled primitive's
stable name, and the wildcard ("w", "*", "*") for what the tracer cannot see into (a C call
that is not known to be pure, untraced Python code, imports). Two steps are independent when
neither has the wildcard and no key is touched by both with at least one write; independent
steps commute and neither enables nor disables the other, so reordering them changes nothing.
"""

from __future__ import annotations

Token = tuple[str, str, str]
WILDCARD: Token = ("w", "*", "*")

_ATTR = {"LOAD_ATTR": "r", "LOAD_METHOD": "r", "STORE_ATTR": "w", "DELETE_ATTR": "w"}
_GLOBAL = {"LOAD_GLOBAL": "r", "STORE_GLOBAL": "w", "DELETE_GLOBAL": "w"}
_DEREF = {"LOAD_DEREF": "r", "LOAD_CLASSDEREF": "r", "STORE_DEREF": "w", "DELETE_DEREF": "w"}
_CONTENT_WRITES = frozenset({"STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE"})
# reads of container contents (or calls, which may read their arguments' contents); a C call that
# may write anything adds the wildcard through the profiler (tracer.py)
_CONTENT_READS = frozenset({"BINARY_SUBSCR", "BINARY_SLICE", "CONTAINS_OP", "COMPARE_OP", "UNPACK_SEQUENCE",
                            "UNPACK_EX", "FORMAT_VALUE", "CALL", "CALL_FUNCTION_EX", "BEFORE_WITH",
                            "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE", "GET_LEN", "MATCH_MAPPING",
                            "MATCH_SEQUENCE", "MATCH_KEYS", "MATCH_CLASS", "IS_OP", "BUILD_STRING", "PRINT_EXPR"})

# C functions whose only effect is computing a result from immutable inputs (len reads a
# container's size: the CALL token already records that read)
PURE_BUILTINS = frozenset({range, abs, isinstance, issubclass, type, id, callable, chr, ord, divmod, round, bool,
                           float, int, len})
# Builtins (by the global name a call loads, when no traced code rebinds it) whose call reads no
# shared state at all, so it needs no choice point either.
PURE_CALLS = frozenset({"range", "abs", "isinstance", "issubclass", "type", "id", "callable", "chr", "ord",
                        "divmod", "round", "bool", "float", "int"})


_CONTAINERS = (list, dict, set, bytearray, __import__("collections").deque)
_CONTAINER_READS = frozenset({"get", "copy", "count", "index", "keys", "values", "items", "__contains__",
                              "__getitem__", "__len__"})


def c_call_token(callee: object) -> Token | None:
    """The token of a C function called from traced code: None for pure builtins, a contents
    read or write for a builtin container's methods, else the wildcard."""
    if callee in PURE_BUILTINS:
        return None
    if isinstance(getattr(callee, "__self__", None), _CONTAINERS):
        return ("r" if getattr(callee, "__name__", "") in _CONTAINER_READS else "w", "subscr", "*")
    return WILDCARD


def token(opname: str, argval: str, argrepr: str = "") -> Token | None:
    """The token of one visible opcode (None: it touches nothing shared)."""
    if opname in _ATTR:
        return (_ATTR[opname], "attr", argval)
    if opname in _GLOBAL:
        return (_GLOBAL[opname], "global", argval)
    if opname in _DEREF:
        return (_DEREF[opname], "deref", argval)
    if opname in _CONTENT_WRITES:
        return ("w", "subscr", "*")
    if opname == "BINARY_OP":  # `a += b` on a list or set changes it in place
        return ("w", "subscr", "*") if argrepr.endswith("=") else ("r", "subscr", "*")
    if opname in _CONTENT_READS:
        return ("r", "subscr", "*")
    return WILDCARD


def independent(a: frozenset[Token], b: frozenset[Token]) -> bool:
    if WILDCARD in a or WILDCARD in b:
        return False
    if len(a) > len(b):
        a, b = b, a
    for mode, kind, key in a:
        if ("w", kind, key) in b or (mode == "w" and ("r", kind, key) in b):
            return False
    return True
