"""`isolab selftest` on bad input: the engine flags it cannot honour are refused with a sentence (each
fault scenario builds its own engines), its output is checked before the work, --gemm is honoured,
and the --tiny model's temporary folder goes when the command ends."""

from __future__ import annotations

import json
import os

import pytest

from isolab.testing.cli import isolab, one_sentence


@pytest.mark.parametrize("flags", [
    ["--block-size", "0"], ["--block-size", "32"], ["--kv-cache-memory", "1MiB"], ["--audit"],
    ["--inject-fault", "coarse-key"], ["--trace", "t.jsonl"], ["--max-num-seqs", "4"], ["--no-prefix-cache"],
], ids=lambda f: f[0])
def test_engine_flags_selftest_cannot_honour_are_refused(tmp_path, flags):
    out = isolab("selftest", "--tiny", *flags, env=dict(os.environ, TMPDIR=str(tmp_path)), timeout=30)
    one_sentence(out, f"selftest does not take {flags[0]}")
    assert not list(tmp_path.glob("isolab-*")) and not (tmp_path / "t.jsonl").exists()


def test_help_lists_only_the_flags_selftest_takes():
    """--help listed --audit, --inject-fault, --trace & co., which selftest then refuses."""
    out = isolab("selftest", "--help", timeout=30)
    assert out.returncode == 0
    for taken in ("--model", "--dtype", "--weights", "--kv-cache-dtype", "--fault"):
        assert taken in out.stdout
    for refused in ("--audit", "--inject-fault", "--trace", "--block-size", "--max-num-seqs", "--no-prefix-cache"):
        assert refused not in out.stdout, refused


def test_tiny_and_model_together_are_refused(tmp_path):
    one_sentence(isolab("selftest", "--tiny", "--model", str(tmp_path / "m.gguf"), timeout=30), "--tiny or --model")


@pytest.mark.parametrize("path,needle", [("/nonexistent/x.json", "does not exist"), ("DIR", "is a folder")])
def test_unwritable_json_is_refused_before_the_work(tmp_path, path, needle):
    out = isolab("selftest", "--tiny", "--json", str(tmp_path) if path == "DIR" else path, timeout=30)
    one_sentence(out, needle)
    assert "numerics" not in out.stdout  # refused before the model was even loaded


def test_tiny_run_honours_gemm_writes_json_and_leaves_no_temporary_folder(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    report = tmp_path / "st.json"
    out = isolab("selftest", "--tiny", "--fault", "coarse-key", "--gemm", "torch", "--json", str(report),
                 env=dict(os.environ, TMPDIR=str(scratch)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch-gemm" in json.loads(report.read_text())["numerics"]["numerics"]
    assert list(scratch.glob("isolab-*")) == []
