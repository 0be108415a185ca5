"""Owns reading a Llama-family GGUF: validation, hyper-parameters, the raw (mmapped) tensors and
their dequantized values, fingerprint.

Does not know about tokenizers (models/tokenizer.py) or the forward pass (models/llama.py).
Every failure a user can cause becomes ModelLoadError / UnsupportedModelError with one sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from isolab.errors import ModelLoadError, UnsupportedModelError

# Architectures whose tensors and hyper-parameters follow llama.cpp's "llama" layout, with what each
# adds: qwen2 biases on q, k and v; qwen3 an RMSNorm on each head of q and k (models/llama.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
MAX_CONTEXT = 1 << 24  # tokens: the RoPE tables grow with the positions asked for (models/rope.py), up to the
#   context (16M: 4 GiB of them in bf16 at a head size of 64); no supported GGUF claims more
PERMUTED_QK = ("llama",)  # llama.cpp's converter interleaves q/k rows for these only (reverse_permute)

# Tensor types we read: dense weights are dequantized to fp32 with the gguf package, then cast to the
# compute dtype; native weights (kernels/quant.py: NATIVE_TYPES) are packed from the raw blocks.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class LlamaHParams:
    """Hyper-parameters read from the GGUF metadata (`llama.*` keys)."""

    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention: num_heads % num_kv_heads == 0)
    head_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    arch: str = "llama"  # general.architecture
    qkv_bias: bool = False  # q, k and v projections have biases (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    # gemma3: embeddings scaled by sqrt(D); RMSNorm x * w in fp32 (the file's w is HF's 1 + w); norms
    # after attention and the MLP too; GELU-tanh; every `global_every`-th layer global, the others
    # local: a sliding window of `sliding_window` keys and RoPE base `rope_theta_local`
    gemma: bool = False
    sliding_window: int = 0
    global_every: int = 0
    rope_theta_local: float = 10000.0

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends over a sliding window (gemma3's 5 of every 6)."""
        return self.sliding_window > 0 and (layer + 1) % self.global_every != 0

    def __post_init__(self) -> None:
        # metadata a broken or hand-made file can hold: each a sentence here, not a ZeroDivisionError at
        # load, a 64 GiB RoPE table, or NaN logits at the first sample (a QA pass)
        for name, value in (("vocab_size", self.vocab_size), ("embedding_length", self.hidden_size),
                            ("feed_forward_length", self.intermediate_size), ("block_count", self.num_layers),
                            ("attention.head_count", self.num_heads), ("attention.head_count_kv", self.num_kv_heads),
                            ("attention.key_length", self.head_dim), ("context_length", self.context_length)):
            if value < 1:
                raise ModelLoadError(f"the GGUF's {self.arch}.{name} is {value}: it must be at least 1")
        if self.context_length > MAX_CONTEXT:
            raise UnsupportedModelError(f"the GGUF's {self.arch}.context_length is {self.context_length:,} tokens, "
                                        f"more than isolab takes ({MAX_CONTEXT:,})")
        for name, x in (("rope.freq_base", self.rope_theta), ("attention.layer_norm_rms_epsilon", self.rms_eps)):
            if not (math.isfinite(x) and x > 0):
                raise ModelLoadError(f"the GGUF's {self.arch}.{name} is {x}: it must be a positive number")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"the GGUF's head size is {self.head_dim}: RoPE needs an even one")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}"
            )


@dataclass(frozen=True)
class RawTensor:
    """One tensor's bytes as the file stores them (a view of the mmapped file; q/k rows already in
    HF's order): what the native quantized kernels pack from (kernels/quant.py)."""

    qtype: str  # GGML type name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # PyTorch layout: (out_features, in_features) for matrices
    data: np.ndarray  # uint8 (rows, bytes a row) for quantized types; the values otherwise

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """fp32 values, the whole tensor in its shape or the given rows (len(rows), K), by the gguf
        package's own dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        data = self.data if rows is None else self.data[rows]
        try:
            arr = dequantize(data, GGMLQuantizationType[self.qtype]).astype(np.float32, copy=False)
        except Exception as exc:
            raise ModelLoadError(f"a {self.qtype} tensor could not be read ({exc})") from exc
        return arr.reshape(self.shape if rows is None else (len(rows), -1))


class DequantizedTensors(Mapping[str, np.ndarray]):
    """name -> fp32 array in PyTorch layout, dequantized when read (not kept): a dense model reads
    each tensor once, a native one only the few it does not quantize."""

    def __init__(self, raw: dict[str, RawTensor]) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> np.ndarray:
        return self._raw[name].dequantize()

    def __iter__(self):
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass(frozen=True)
class LoadedGGUF:
    path: Path
    hparams: LlamaHParams
    raw: dict[str, RawTensor]
    # name -> fp32 array in PyTorch layout (out_features, in_features) for matrices, dequantized on read.
    tensors: DequantizedTensors
    tensor_types: dict[str, str]
    # SHA-256 over the file's bytes: part of every prefix-cache key (weights shape the KV values).
    fingerprint: str
    metadata: dict[str, object]
    mapping: mmap.mmap | None = None  # the file's mmap (raw tensors are views of it)

    def release_pages(self) -> None:
        """Drop the file's pages that reading touched (clean, file-backed: read again on use), so a
        model whose weights were packed into their own memory holds one copy, not two."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as exc:  # corrupt metadata
        raise ModelLoadError(f"metadata key {key!r} in the GGUF file is unreadable ({exc})") from exc


def file_fingerprint(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def reverse_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so the weights fit HF's rotate-half RoPE.

    llama.cpp stores each head's rows as interleaved pairs (x0, x1), (x2, x3) ...; HF keeps the
    first half of the head dim, then the second half. rows: (n_head, 2, half) <- (n_head, half, 2).
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@functools.lru_cache(maxsize=1)
def _reader_class():
    """gguf's GGUFReader, minus the parse of what isolab never reads (built on first use: gguf is
    imported only when a model is loaded)."""
    import struct

    from gguf import GGUFReader, GGUFValueType

    class MetadataReader(GGUFReader):
        """GGUFReader with arrays read whole. gguf's own parse makes a numpy view of every array
        element: for SmolLM2's vocabulary, merges and token types about a million views, which took
        most of a model's load and ~160 MiB at its peak (`python bench/gguf_read.py`). Here:
        - an array of numbers is one view of the file (its contents() the same list as gguf's);
        - an array of strings (the tokenizer's vocabulary and merges: models/tokenizer.py takes them
          from transformers) is stepped over: its length stays among its parts (`array_len`), its
          contents() is empty;
        - anything else (nested arrays, a byte-swapped file) is gguf's own parse."""

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            itype = GGUFValueType(raw_itype[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, alen[0])
                if len(values) != int(alen[0]):
                    raise ValueError(f"an array of {int(alen[0])} values runs past the end of the file")
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
            if itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            buf = memoryview(self.data)  # type: ignore[arg-type]  # (numpy arrays are buffers)
            for _ in range(int(alen[0])):
                (slen,) = struct.unpack_from("<Q", buf, offs)
                offs += 8 + slen
            if offs > len(buf):
                raise ValueError(f"an array of {int(alen[0])} strings runs past the end of the file")
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

    return MetadataReader


def array_len(reader, key: str) -> int | None:
    """The length of an array field (also of the string arrays MetadataReader steps over)."""
    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0].name != "ARRAY":
        return None
    return int(field.parts[4][0])  # the parts: key length, key, value type, element type, length, ...


def _open_reader(path: Path):
    if not path.exists():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"model path {str(path)!r} is not a file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:  # no read permission, an I/O error
        raise ModelLoadError(f"model file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return _reader_class()(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{str(path)!r} is a corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc


def check_model_file(path: str | Path) -> LlamaHParams:
    """The file is a GGUF of an architecture isolab runs: its hyperparameters, from the metadata alone
    (what a process that starts engines elsewhere checks first), or a ModelLoadError."""
    return read_hparams(_open_reader(Path(path)))


def read_hparams(reader) -> LlamaHParams:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (isolab runs {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"the GGUF file lacks the metadata key {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    vocab = _field(reader, f"{arch}.vocab_size", array_len(reader, "tokenizer.ggml.tokens"))
    if vocab is None:
        raise ModelLoadError("the GGUF file has neither llama.vocab_size nor a token list")
    return LlamaHParams(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads if heads > 0 else 0)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(_field(reader, f"{arch}.context_length", 2048)),
        arch=str(arch),
        gemma=arch == "gemma3",
        sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0) if arch == "gemma3" else 0,
        global_every=6 if arch == "gemma3" else 0,  # llama.cpp's gemma3 pattern: layers 5, 11, 17, ... are global
    )


def load_gguf(path: str | Path) -> LoadedGGUF:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    reader = _open_reader(path)
    hp = read_hparams(reader)
    raw: dict[str, RawTensor] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"tensor {t.name!r} has type {qtype.name}, which isolab does not read "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
        # gguf lists dims innermost first; numpy shape is the reverse: (out_features, in_features).
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = t.data
        if data.dtype == np.uint8:  # quantized: (rows, bytes a row)
            block, nbytes = GGML_QUANT_SIZES[qtype]
            if data.size * block != int(np.prod(shape)) * nbytes:
                raise ModelLoadError(f"tensor {t.name!r} holds {data.size} bytes, not {shape} of {qtype.name}")
            data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
        elif data.size != int(np.prod(shape)):
            raise ModelLoadError(f"tensor {t.name!r} holds {data.size} values, not {shape}")
        else:
            data = data.reshape(shape)
        raw[t.name] = RawTensor(qtype.name, shape, data)
    hp = dataclasses.replace(hp, qkv_bias="blk.0.attn_q.bias" in raw, qk_norm="blk.0.attn_q_norm.weight" in raw)
    _check_shapes({n: r.shape for n, r in raw.items()}, hp)
    for i in range(hp.num_layers if hp.arch in PERMUTED_QK else 0):  # rows are whole blocks: permuting them works on the bytes
        for name, heads in ((f"blk.{i}.attn_q.weight", hp.num_heads), (f"blk.{i}.attn_k.weight", hp.num_kv_heads)):
            r = raw[name]
            raw[name] = RawTensor(r.qtype, r.shape, np.ascontiguousarray(reverse_permute(r.data, heads)))
    metadata = {k: _field(reader, k) for k in ("general.name", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")}
    types = {n: r.qtype for n, r in raw.items()}
    return LoadedGGUF(path, hp, raw, DequantizedTensors(raw), types, file_fingerprint(path), metadata,
                      getattr(reader.data, "_mmap", None))


def _check_shapes(shapes: dict[str, tuple[int, ...]], hp: LlamaHParams) -> None:
    d, kv = hp.hidden_size, hp.num_kv_heads * hp.head_dim
    expected = {"token_embd.weight": (hp.vocab_size, d), "output_norm.weight": (d,)}
    for i in range(hp.num_layers):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "attn_q.weight": (hp.num_heads * hp.head_dim, d),
            p + "attn_k.weight": (kv, d),
            p + "attn_v.weight": (kv, d),
            p + "attn_output.weight": (d, hp.num_heads * hp.head_dim),
            p + "ffn_gate.weight": (hp.intermediate_size, d),
            p + "ffn_up.weight": (hp.intermediate_size, d),
            p + "ffn_down.weight": (d, hp.intermediate_size),
        })
        if hp.qkv_bias:
            expected.update({p + "attn_q.bias": (hp.num_heads * hp.head_dim,), p + "attn_k.bias": (kv,),
                             p + "attn_v.bias": (kv,)})
        if hp.qk_norm:
            expected.update({p + "attn_q_norm.weight": (hp.head_dim,), p + "attn_k_norm.weight": (hp.head_dim,)})
        if hp.gemma:
            expected.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelLoadError(f"the GGUF file lacks tensor {name!r} that a {hp.arch} model needs")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(shapes[name])}, expected {shape}")
    if "output.weight" in shapes and tuple(shapes["output.weight"]) != (hp.vocab_size, d):
        raise ModelLoadError(f"tensor 'output.weight' has shape {shapes['output.weight']}")
