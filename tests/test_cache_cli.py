"""`isolab cache`: it lists and removes only what isolab writes, and clearing loses nothing but time."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from isolab.models.weight_cache import code_key
from isolab.testing.cli import isolab as run_isolab


def isolab(*args: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return run_isolab(*args, timeout=timeout, env={**os.environ, **env})


@pytest.fixture
def caches(tmp_path):
    """Every kind's folder moved under tmp_path, except the compiled kernels (a rebuild costs a minute)."""
    env = {"ISOLAB_WEIGHT_CACHE": str(tmp_path / "weights"), "ISOLAB_CACHE": str(tmp_path / "c"),
           "ISOLAB_INVARIANCE_CACHE": str(tmp_path / "inv")}
    return tmp_path, env


def _read_only_folder(path, files=("a.bin",)):
    path.mkdir(parents=True)
    for f in files:
        (path / f).write_bytes(b"x" * 4096)
        (path / f).chmod(0o444)
    return path


def test_clear_removes_only_what_isolab_wrote(caches):
    tmp, env = caches
    weights = tmp / "weights"
    current = _read_only_folder(weights / f"{'a' * 32}-{code_key()}")
    stale = _read_only_folder(weights / f"{'b' * 32}-{'0' * 16}")
    theirs = weights / "notes.txt"  # the user pointed ISOLAB_WEIGHT_CACHE at a folder they share
    theirs.write_text("mine")
    tok = _read_only_folder(tmp / "c" / "tokenizers" / ("c" * 32), ("tokenizer.json",))

    listed = json.loads(isolab("cache", "--json", env=env).stdout)
    w = next(r for r in listed if r["kind"] == "weights")
    assert w["entries"] == 2 and w["bytes"] == 8192
    # a kind named twice is listed (and counted in all) once
    assert [r["kind"] for r in json.loads(isolab("cache", "list", "weights", "weights", "--json", env=env).stdout)] == ["weights"]
    assert [s["name"] for s in w["stale"]] == [stale.name]
    text = isolab("cache", env=env).stdout
    assert "stale" in text and "isolab cache clear --stale" in text

    out = isolab("cache", "clear", "--stale", env=env)
    assert out.returncode == 0, out.stderr
    assert not stale.exists() and current.exists() and theirs.exists() and tok.exists()

    out = isolab("cache", "clear", "weights", "tokenizers", env=env)
    assert out.returncode == 0, out.stderr
    assert "removed 2 entries" in out.stdout
    assert not current.exists() and not tok.exists() and theirs.read_text() == "mine"


@pytest.mark.parametrize("args,needle", [
    (["cache", "clear", "wieghts"], "no cache kind 'wieghts'"),
    (["cache", "list", "--stale"], "--stale goes with"),
])
def test_bad_input_gets_one_sentence(caches, args, needle):
    _, env = caches
    out = isolab(*args, env=env)
    assert out.returncode == 2 and needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_weights_off_lists_off(caches):
    _, env = caches
    listed = json.loads(isolab("cache", "weights", "--json", env={**env, "ISOLAB_WEIGHT_CACHE": "off"}).stdout)
    assert listed == [{"kind": "weights", "what": listed[0]["what"], "folder": None, "entries": 0, "bytes": 0,
                       "stale": []}]


def test_a_cleared_cache_is_rebuilt_with_the_same_output(caches, tiny_path):
    tmp, env = caches
    gen = ("generate", "the cat", "--model", str(tiny_path), "--max-tokens", "8")
    first = isolab(*gen, env=env)
    assert first.returncode == 0, first.stderr
    listed = {r["kind"]: r for r in json.loads(isolab("cache", "--json", env=env).stdout)}
    assert listed["weights"]["entries"] == 1 and listed["weights"]["bytes"] > 0 and not listed["weights"]["stale"]
    assert listed["tokenizers"]["entries"] == 1
    out = isolab("cache", "clear", "weights", "tokenizers", "invariance", env=env)
    assert out.returncode == 0, out.stderr
    assert not any((tmp / "weights").iterdir())
    again = isolab(*gen, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert json.loads(isolab("cache", "weights", "--json", env=env).stdout)[0]["entries"] == 1


def test_a_killed_writers_temporary_is_stale_once_old(caches):
    """A joined model file a Ctrl-C left half-written (models/locate.py now removes its own): listed
    as stale after 10 minutes, removed by clear --stale; a fresh one may still be being written."""
    tmp, env = caches
    env = {**env, "XDG_CACHE_HOME": str(tmp / "xdg")}
    models = tmp / "xdg" / "isolab" / "models"
    models.mkdir(parents=True)
    old, young = models / "gemma-3-270m-q4_k_m.123.tmp", models / "gemma-3-270m-q4_k_m.456.tmp"
    for f in (old, young):
        f.write_bytes(b"x" * 100)
    os.utime(old, (0, 0))
    listed = {r["kind"]: r for r in json.loads(isolab("cache", "models", "--json", env=env).stdout)}
    assert [s["name"] for s in listed["models"]["stale"]] == [old.name]
    assert isolab("cache", "clear", "--stale", env=env).returncode == 0
    assert not old.exists() and young.exists()


def test_kernel_builds_of_other_sources_are_stale(caches):
    """A .so no ISA level of this isolab's sources and compiler would build (an older isolab's) is
    named stale with its reason; the current builds' names are not (computed without compiling)."""
    from isolab import kernels

    tmp, env = caches
    env = {**env, "XDG_CACHE_HOME": str(tmp / "xdg")}
    folder = tmp / "xdg" / "isolab" / "kernels"
    folder.mkdir(parents=True)
    try:
        current = kernels.build_target(isa="native")[0].name
    except kernels.BuildError:
        pytest.skip("no C++ compiler: nothing is called stale")
    for name in (current, "isolab-kernels-0000000000000000.so"):
        (folder / name).write_bytes(b"\x7fELF")
    listed = json.loads(isolab("cache", "kernels", "--json", env=env).stdout)[0]
    assert listed["entries"] == 2
    assert listed["stale"] == [{"name": "isolab-kernels-0000000000000000.so", "bytes": 4, "why": "an older isolab's"}]
