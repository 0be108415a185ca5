"""bench/requantize.py: a GGUF's copy in another block format, for the peer benchmarks (a Q8_0 copy is
what llama.cpp's fast batched path takes). The copy must load as the same model: the same metadata
and shapes, every matrix in the new format, each weight within the new format's rounding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from isolab.models.gguf_loader import load_gguf
from isolab.testing.tiny_model import TinySpec, write_tiny_llama

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "requantize.py"


def _fields(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    return {f.name: f.contents() for f in GGUFReader(str(path)).fields.values() if not f.name.startswith("GGUF.")}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_0"])
def test_a_copy_in_another_format_is_the_same_model_within_its_rounding(tmp_path, target):
    src = write_tiny_llama(tmp_path / "src.gguf", TinySpec(layers=2, seed=3, qtype="Q4_1"))
    out = tmp_path / f"copy-{target}.gguf"
    r = _run("--model", str(src), "--type", target, str(out))
    assert r.returncode == 0, r.stderr
    a, b = load_gguf(src), load_gguf(out)
    assert b.hparams == a.hparams
    fa, fb = _fields(src), _fields(out)  # every metadata key (the tokenizer's arrays, the chat template)
    assert fb.pop("general.file_type") == {"Q8_0": 7, "Q4_0": 2}[target]
    fa.pop("general.file_type", None)
    assert fb == fa
    assert set(b.raw) == set(a.raw)
    for name, ra in a.raw.items():
        rb = b.raw[name]
        assert rb.shape == ra.shape, name
        if ra.qtype == "F32":
            assert rb.qtype == "F32" and np.array_equal(rb.data, ra.data), name
            continue
        assert rb.qtype == target, name
        wa, wb = a.tensors[name], b.tensors[name]  # fp32, dequantized
        # per block of 32, the step d is amax / 127 (Q8_0) or amax / 8 (Q4_0, whose largest q clips to
        # 7 on the side opposite its sign: up to a whole step there); d is stored in fp16, which moves
        # q * d by up to |q| * d * 2^-11 more
        qmax, rounding = (127, 0.5) if target == "Q8_0" else (8, 1.0)
        blocks_a = wa.reshape(-1, 32)
        step = np.abs(blocks_a).max(axis=1, keepdims=True) / qmax
        err = np.abs(wb.reshape(-1, 32) - blocks_a)
        assert (err <= step * (rounding + qmax * 2.0**-11) + 1e-7).all(), name


def test_a_file_with_nothing_quantized_is_refused_in_a_sentence(tmp_path):
    src = write_tiny_llama(tmp_path / "src.gguf", TinySpec(layers=2, seed=3, qtype="F16"))
    out = tmp_path / "copy.gguf"
    r = _run("--model", str(src), "--type", "Q8_0", str(out))
    assert r.returncode == 2
    assert "no quantized tensor" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_the_copy_refuses_to_overwrite_its_source(tmp_path):
    src = write_tiny_llama(tmp_path / "src.gguf", TinySpec(layers=2, seed=3, qtype="Q4_1"))
    before = src.read_bytes()
    r = _run("--model", str(src), "--type", "Q8_0", str(src))
    assert r.returncode == 2
    assert "source file" in r.stderr and "Traceback" not in r.stderr
    assert src.read_bytes() == before
