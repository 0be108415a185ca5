"""The packed weights' on-disk cache (models/weight_cache.py): the records a model maps from it are
the bytes packing gives, a file is used only whole, and a cache that cannot be written costs only
the mapping, never a weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolab import kernels
from isolab.kernels import quant
from isolab.models import weight_cache
from isolab.models.gguf_loader import load_gguf
from isolab.models.linear import QuantWeight
from isolab.models.llama import LlamaModel
from isolab.models.weight_cache import WeightCache, code_key

pytestmark = pytest.mark.skipif(not kernels.native_ready(), reason="native kernels do not build here")


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory):
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("wc") / "tiny-q4_1.gguf", TinySpec(layers=2, seed=3, qtype="Q4_1"))


def build(path: Path) -> LlamaModel:
    return LlamaModel(load_gguf(path), "bf16", "cpu", weights="native")


def weights_of(m: LlamaModel) -> list[QuantWeight]:
    out = m.linears()
    assert all(isinstance(w, QuantWeight) and w.packed is not None for w in out)
    return out  # type: ignore[return-value]


def logits(m: LlamaModel) -> torch.Tensor:
    x = torch.randn(5, m.hp.hidden_size, generator=torch.Generator().manual_seed(0)).to(m.dtype)
    return m.lm_head(x).float()


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def packed_as_before(path: Path) -> list[QuantWeight]:
    """Each weight of weights_of's order through QuantWeight's own constructor, as without the cache."""
    loaded = load_gguf(path)
    L = loaded.hparams.num_layers
    stacks = [["token_embd.weight"]] + [[f"blk.{i}.{n}.weight" for n in names] for i in range(L)
                                        for names in (["attn_q", "attn_k", "attn_v"], ["attn_output"],
                                                      ["ffn_gate", "ffn_up"], ["ffn_down"])]
    return [QuantWeight(quant.concat([quant.unpack_gguf(loaded.raw[n].data, loaded.raw[n].qtype, loaded.raw[n].shape)
                                      for n in names]), torch.device("cpu"), True) for names in stacks]


def test_a_second_build_maps_the_records_the_first_packed(q4_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", "off")
    plain = build(q4_path)
    assert plain.weight_cache is not None and plain.weight_cache.dir is None
    for a, b in zip(packed_as_before(q4_path), weights_of(plain), strict=True):  # the cache's path, off
        assert torch.equal(a.packed, b.packed) and (a.n, a.fmt, a.fp16, a.qtype) == (b.n, b.fmt, b.fp16, b.qtype)
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(tmp_path))
    first = build(q4_path)
    n = len(weights_of(first))
    assert (first.weight_cache.hits, first.weight_cache.writes) == (0, n)
    second = build(q4_path)
    assert (second.weight_cache.hits, second.weight_cache.writes) == (n, 0)
    folder = second.weight_cache.dir
    assert folder is not None and folder.parent == tmp_path and folder.name.endswith(str(code_key()))
    for a, b, c in zip(weights_of(plain), weights_of(first), weights_of(second), strict=True):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.packed, c.packed)
        assert (a.n, a.fmt, a.fp16, a.qtype) == (c.n, c.fmt, c.fp16, c.qtype)
    assert torch.equal(logits(plain).view(torch.int32), logits(second).view(torch.int32))
    # the records are the file's pages, mapped, not a copy in this process's memory
    files = sorted(folder.glob("*.bin"))
    assert len(files) == n and all(str(f) in mapped_files() for f in files)
    assert all(f.stat().st_mode & 0o777 == 0o444 for f in files)  # read-only: replaced whole, never edited


def test_a_short_file_is_packed_again(q4_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(tmp_path))
    ref = build(q4_path)
    victim = sorted(ref.weight_cache.dir.glob("blk.0.attn_q*.bin"))[0]
    short = victim.read_bytes()[:-1]
    victim.unlink()  # (ref keeps its mapping of the file it opened: files are replaced, never edited)
    victim.write_bytes(short)  # a file cut short, put there from outside
    again = build(q4_path)
    assert again.weight_cache.writes == 1 and again.weight_cache.hits == len(weights_of(again)) - 1
    for a, b in zip(weights_of(ref), weights_of(again), strict=True):
        assert torch.equal(a.packed, b.packed)


def test_a_cache_that_cannot_be_written_keeps_the_weights_in_memory(q4_path, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache's folder would go")
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(blocker))
    m = build(q4_path)
    assert m.weight_cache.failed == len(weights_of(m)) and m.weight_cache.writes == 0
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", "off")
    assert torch.equal(logits(m).view(torch.int32), logits(build(q4_path)).view(torch.int32))


def test_the_key_is_the_file_and_the_code_that_shapes_the_bytes(tmp_path, monkeypatch):
    a, b = WeightCache("a" * 64, tmp_path), WeightCache("b" * 64, tmp_path)
    assert a.dir != b.dir and a.dir.name == f"{'a' * 32}-{code_key()}"
    from isolab.models import gguf_loader

    real = weight_cache.inspect.getsource
    monkeypatch.setattr(weight_cache.inspect, "getsource",
                        lambda obj: real(obj) + ("# changed" if obj is gguf_loader else ""))
    assert weight_cache._layout_key() not in (None, code_key())  # the GGUF reader un-permutes q and k

    def no_source(obj):
        raise OSError("no source")

    monkeypatch.setattr(weight_cache.inspect, "getsource", no_source)
    assert weight_cache._layout_key() is None  # a build without its .py files: no key, no cache
    monkeypatch.setattr(weight_cache, "code_key", lambda: None)
    assert WeightCache("a" * 64, tmp_path).dir is None
    stale, other = tmp_path / f"{'a' * 32}-0123456789abcdef", tmp_path / f"{'b' * 32}-0123456789abcdef"
    for d in (stale, other):
        d.mkdir()
        (d / "w.bin").write_bytes(b"old layout")
    rec = a.records("w", (1, 1, 4), lambda: torch.arange(4, dtype=torch.uint8).view(1, 1, 4))
    assert rec.tolist() == [[[0, 1, 2, 3]]] and a.writes == 1
    assert not stale.exists() and other.exists()  # an older layout of this file goes; another file's stays


def test_the_fault_that_needs_dense_weights_packs_in_memory(q4_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(tmp_path))
    m = LlamaModel(load_gguf(q4_path), "bf16", "cpu", weights="native", gemm="split-k")
    assert m.weight_cache is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bf16_dense_panels_and_the_embedding_table_are_cached_too(q4_path, tmp_path, monkeypatch, dtype):
    # (bf16 panels: on a CPU with AMX, dense weights would otherwise stay in their blocks, test_dense_blocks.py)
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", "off")
    plain = LlamaModel(load_gguf(q4_path), dtype, "cpu", weights="dense", dense_blocks=False)
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(tmp_path))
    first = LlamaModel(load_gguf(q4_path), dtype, "cpu", weights="dense", dense_blocks=False)
    second = LlamaModel(load_gguf(q4_path), dtype, "cpu", weights="dense", dense_blocks=False)
    linears = 1 + 4 * len(plain.layers)
    cached = linears + 1 if dtype == "bf16" else 0  # and the table; fp32 (the reference) stays in memory
    assert first.weight_cache.writes == cached and second.weight_cache.hits == cached
    assert torch.equal(plain.embed, second.embed)
    for a, b in zip(plain.linears(), second.linears(), strict=True):
        assert a.path == b.path == "isolab" and a.n == b.n and torch.equal(a.data, b.data)
    assert torch.equal(logits(plain).view(torch.int32), logits(second).view(torch.int32))


def test_a_file_that_cannot_be_mapped_leaves_the_weight_in_memory(q4_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ISOLAB_WEIGHT_CACHE", str(tmp_path))
    ref = build(q4_path)  # fills the cache
    files = {f: f.stat().st_mtime_ns for f in ref.weight_cache.dir.glob("*.bin")}

    def refuse(*_):
        raise RuntimeError("mmap refused")  # as torch.from_file raises

    monkeypatch.setattr(weight_cache, "_map", refuse)
    m = build(q4_path)
    assert m.weight_cache.hits == 0 and m.weight_cache.failed == len(weights_of(m)) and m.weight_cache.writes == 0
    assert {f: f.stat().st_mtime_ns for f in files} == files  # the whole files stay for the processes that can map
    assert torch.equal(logits(ref).view(torch.int32), logits(m).view(torch.int32))


def test_temporaries_a_killed_writer_left_are_swept(tmp_path):
    import os
    import time

    cache = WeightCache("c" * 64, tmp_path)
    cache.dir.mkdir(parents=True)
    old, fresh = cache.dir / ".w.bin.x.tmp", cache.dir / ".w.bin.y.tmp"
    for f in (old, fresh):
        f.write_bytes(b"half a weight")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    cache.records("w", (1, 1, 4), lambda: torch.zeros(1, 1, 4, dtype=torch.uint8))
    assert not old.exists() and fresh.exists()  # a writer of ten minutes ago is gone; one now may be busy
