"""Owns reading a package's import graph from its source (ast) and finding a cycle in it.

Used by the layout tests (tests/test_imports.py for the whole package, tests/race/test_layout.py
for the race lab). Reads files only; imports nothing it inspects.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """isolab/engine/scheduler.py -> isolab.engine.scheduler; a package's __init__ -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str] | dict[str, Path], *, everywhere: bool) -> set[str]:
    """The modules of `modules` that `path` (module `name`) imports.

    everywhere=True counts imports inside functions and under `if TYPE_CHECKING` too (a cycle
    there is still two modules that each need the other); False, module-level imports only,
    outside `if TYPE_CHECKING` (what runs when the module is imported).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if everywhere:
        nodes = list(ast.walk(tree))
    else:
        nodes = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(package_dir: Path, *, everywhere: bool) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports, for every .py under package_dir."""
    root = package_dir.parent
    while (root / "__init__.py").exists():
        root = root.parent
    paths = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    return {m: imports_of(p, m, paths, everywhere=everywhere) for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a path (first module repeated at the end), by depth-first search; None if none.
    A package's __init__ importing its own submodules is how packages work, not a cycle."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None
