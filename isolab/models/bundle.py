"""Owns loading a model once: GGUF weights, the forward's parameters and the tokenizer, together.

Bundles are cached per (path, dtype, device, GEMM path): engines with different cache settings (tests,
fault injection, tenants) share one read-only copy of the weights.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from isolab import kernels
from isolab.errors import InvalidRequestError
from isolab.models import invariance
from isolab.models.gguf_loader import LlamaHParams, LoadedGGUF, load_gguf
from isolab.models.invariance import InvarianceReport
from isolab.models.linear import GemmPath
from isolab.models.llama import LlamaModel
from isolab.models.locate import resolve_model_path
from isolab.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelBundle:
    path: Path
    name: str
    hparams: LlamaHParams
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # SHA-256 of the file: part of every prefix-cache key
    dtype: str
    weights: str  # "native" or "dense", resolved (models/llama.py)

    @property
    def numerics_key(self) -> str:
        """What besides the file shapes the K/V bits: the dtype and the weight format (prefix-cache keys)."""
        return f"{self.dtype}/{self.weights}"

    def cache_numerics_key(self, kv_cache_dtype: str = "auto") -> str:
        """What besides the file shapes a cached block's K/V (prefix-cache keys): numerics_key, and how
        the pool stores K/V (an int8 pool's block holds other values than a bf16 pool's)."""
        return self.numerics_key + ("/kv-int8" if kv_cache_dtype == "int8" else "")

    def engine_numerics(self, kv_cache_dtype: str = "auto") -> InvarianceReport:
        """The start-up check's verdict for an engine on this model: the model's, with attention over
        the int8 pool checked too when that is the pool (invariance.with_kv_pool)."""
        hp = self.hparams
        return invariance.with_kv_pool(self.model.numerics, kv_cache_dtype, self.model.device,
                                       (hp.num_heads, hp.num_kv_heads, hp.head_dim), self.model.native_kernels)


def pick_device(device: str | None) -> torch.device:
    """cpu, cuda or cuda:N (None: cuda when present); anything else, or a GPU this process does not
    have, is an InvalidRequestError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {device!r} is not one this engine runs on: cpu, cuda or cuda:N",
                                  field="device")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index or 0) >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (or a torch built without CUDA)"
            raise InvalidRequestError(f"device {device!r}: this machine has {have}", field="device")
    return dev


def family_template(arch: str) -> str | None:
    """A family's chat template (models/templates/ARCH.jinja), for GGUFs that carry none."""
    path = Path(__file__).with_name("templates") / f"{arch}.jinja"
    return path.read_text() if path.exists() else None


def trim_heap() -> None:
    """Hand freed temporaries (the packing's, the tokenizer conversion's, the start-up check's) back
    to the OS: glibc keeps them on its heap otherwise (40 MB of idle RSS on the default model after
    the packing, 24 MB more once a server has started)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_weights(weights: str, device: torch.device) -> str:
    """auto -> native where isolab's kernels run on this device (the fastest invariant choice there:
    bench/single_stream.py), else dense (a GPU multiplies dense weights faster than the reference)."""
    if weights != "auto":
        return weights
    return "native" if device.type == "cpu" and kernels.native_ready() else "dense"


def dense_blocks() -> bool:
    """Whether dense bf16 weights may stay in their GGUF blocks where the tile unit runs
    (LlamaModel's dense_blocks; the same bits either way): ISOLAB_DENSE_BLOCKS=0 (or off, false, no)
    keeps bf16 panels; a value it cannot read keeps the default, with a warning."""
    value = os.environ.get("ISOLAB_DENSE_BLOCKS", "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value not in ("", "1", "on", "true", "yes"):
        log.warning("ISOLAB_DENSE_BLOCKS=%r is not 0/1/off/on/false/true/no/yes: dense weights stay in their "
                    "blocks (the default)", value)
    return True


@functools.lru_cache(maxsize=4)
def _load(path: str, dtype: str, device: str, gemm: GemmPath | None, weights: str, blocks: bool = True) -> ModelBundle:
    loaded = load_gguf(path)
    model = LlamaModel(loaded, dtype=dtype, device=device, gemm=gemm, weights=weights, dense_blocks=blocks)
    loaded.release_pages()  # the weights now live in the model's own memory
    tokenizer = Tokenizer(Path(path), loaded.fingerprint, family_template(loaded.hparams.arch))
    trim_heap()
    return assemble(loaded, model, tokenizer, dtype, weights)


def assemble(loaded: LoadedGGUF, model: LlamaModel, tokenizer: Tokenizer, dtype: str, weights: str) -> ModelBundle:
    """The bundle of a read file, its model and tokenizer (bench/memory.py builds the parts one by one)."""
    name = str(loaded.metadata.get("general.name") or loaded.path.stem)
    return ModelBundle(loaded.path, name, loaded.hparams, model, tokenizer, loaded.fingerprint, dtype, weights)


def load_bundle(model: str | Path | None, dtype: str = "bf16", device: str | None = None,
                gemm: GemmPath | None = None, weights: str = "auto") -> ModelBundle:
    """gemm: None picks the first dense GEMM path that passes the invariance check
    (models/invariance.py). weights: native, dense or auto (resolve_weights)."""
    path = resolve_model_path(model).resolve() if model is not None else resolve_model_path(None)
    dev = pick_device(device)
    if gemm == "isolab" and not kernels.native_ready():
        raise InvalidRequestError("gemm isolab needs isolab's native kernels, which are not built here "
                                  "(ISOLAB_NATIVE=0, or no C++ compiler: the warning above says which)", field="gemm")
    return _load(str(path), dtype, str(dev), gemm, resolve_weights(weights, dev), dense_blocks())
