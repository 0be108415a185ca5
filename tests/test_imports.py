"""The package's import graph has no cycle, and the layers point one way.

Module-level imports only (function-level imports are deliberate lazy loads); `if TYPE_CHECKING`
blocks are skipped. A cycle would make a module's behaviour depend on which one is imported first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import isolab
from isolab.testing.imports import find_cycle, import_graph

ROOT = Path(isolab.__file__).parent


def _graph() -> dict[str, set[str]]:
    return import_graph(ROOT, everywhere=False)


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_the_engine():
    g = _graph()
    assert "isolab.engine.step" in g["isolab.engine.scheduler"] and len(g) > 100


def test_layers_point_down():
    """The fault catalogue and config import no engine; the probe (of any server) imports no engine."""
    g = _graph()
    for low in ("isolab.faults", "isolab.config", "isolab.errors", "isolab.sampling_params"):
        assert not {d for d in g[low] if d.startswith("isolab.engine")}, f"{low} imports the engine"
    for m, deps in g.items():
        if m.startswith("isolab.probe"):
            assert not {d for d in deps if d.startswith(("isolab.engine", "isolab.models"))}, f"{m} imports the engine"


@pytest.mark.slow
def test_engine_modules_import_alone():
    """Each engine module first in a fresh interpreter (one interpreter per module would cost a
    torch import each; the AST check above covers the order, this covers real import errors)."""
    names = sorted(m for m in _graph() if m.startswith(("isolab.engine", "isolab.faults", "isolab.config")))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    for n in names:
        r = subprocess.run([sys.executable, "-c", code, n], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{n} does not import alone:\n{r.stderr[-2000:]}"


def test_the_request_schema_imports_without_the_web_stack():
    """LLM.chat reads messages with isolab.server.protocol: importing it loads no FastAPI or uvicorn
    (isolab.server's names load on first use); `from isolab.server import create_app` still works."""
    code = ("import sys, isolab.server.protocol\n"
            "assert not {'fastapi', 'uvicorn', 'isolab.server.app'} & set(sys.modules), sorted(sys.modules)\n"
            "from isolab.server import ServerConfig, create_app\n"
            "assert 'fastapi' in sys.modules and callable(create_app) and ServerConfig\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
