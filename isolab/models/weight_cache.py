"""Owns the on-disk cache of packed weights (the quantized records of kernels/quant.py; the bf16
panels of kernels.pack_weight and a bf16 embedding table): weights the native kernels multiply on
are file pages mapped read-only, not memory each process fills.

What that buys:
- one copy in the page cache for every process that serves the file (Ray replicas, a second
  server), which the OS can take back under pressure and read again on use;
- an idle server holds only the weight pages its requests have touched (as llama.cpp's mmap of
  the GGUF does);
- a second start neither unpacks nor packs.

Key: a folder per GGUF (its SHA-256, which every prefix-cache key carries too) and per packing code
(a hash of kernels/quant.py and kernels.pack_weight, so a change to a layout misses); a file per
weight, named by the tensors it stacks (and ".bf16" for dense panels). A file's folders of older
packing code are removed when its new one is made.

Invariants:
- a file is written whole (a temporary in the same folder, then an atomic rename) and read-only;
  servers map it, so it is replaced (a new file under its name) or deleted, never edited in place;
- a file is opened only if its size is the one its shape implies;
- a missing, short or unwritable entry means the weight is packed in memory as before: the cache
  saves work and memory, never changes a bit (the same bytes either way: tests/models/test_weight_cache.py);
- the mapping is private (MAP_PRIVATE) and nothing writes through it.

ISOLAB_WEIGHT_CACHE: a folder to use instead of ~/.cache/isolab/weights, or "off".
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from isolab import kernels
from isolab.kernels import quant
from isolab.paths import user_cache

log = logging.getLogger(__name__)


def _layout_key() -> str:
    """A hash of the code that lays the weights out: the quantized records (kernels/quant.py) and
    the dense panels (kernels.pack_weight, packed_shape, GEMM_PAD_N)."""
    h = hashlib.sha256()
    for part in (quant, kernels.pack_weight, kernels.packed_shape):
        try:
            h.update(inspect.getsource(part).encode())
        except (OSError, TypeError):  # no source (a build without .py files): the whole module file
            h.update(Path(inspect.getfile(part)).read_bytes())
    h.update(str(kernels.GEMM_PAD_N).encode())
    return h.hexdigest()[:16]


CODE_KEY = _layout_key()


def cache_root() -> Path | None:
    """The cache's folder, or None where ISOLAB_WEIGHT_CACHE=off."""
    env = os.environ.get("ISOLAB_WEIGHT_CACHE", "")
    if env.lower() in ("off", "0", "no", "false"):
        return None
    return Path(env) if env else user_cache("weights")


class WeightCache:
    """The packed records of one GGUF file, a file per weight (see the module's docstring)."""

    def __init__(self, fingerprint: str, root: Path | None = None) -> None:
        base = root if root is not None else cache_root()
        self.dir = None if base is None else base / f"{fingerprint[:32]}-{CODE_KEY}"
        self.hits = 0  # weights mapped from the cache
        self.writes = 0  # weights packed and written to it
        self.failed = 0  # weights packed in memory because the cache could not be written

    def records(self, name: str, shape: tuple[int, ...], pack: Callable[[], torch.Tensor],
                dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The packed weight `name`, a contiguous tensor of this shape and dtype (quantized records:
        uint8 (panels, K/32, record bytes); dense panels: kernels.pack_weight's): the cached file,
        mapped, when it is there whole; else pack()'s, written to the cache and mapped (pack()'s own
        tensor where that fails)."""
        if self.dir is None:
            return pack()
        path = self.dir / (re.sub(r"[^A-Za-z0-9_.+-]", "_", name) + ".bin")
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        try:
            if path.stat().st_size == nbytes:
                mapped = _map(path, shape, dtype)
                self.hits += 1
                return mapped
        except (OSError, RuntimeError):  # not there yet (or not mappable: packed again below)
            pass
        packed = pack()
        assert tuple(packed.shape) == shape and packed.dtype == dtype, (name, tuple(packed.shape), shape)
        try:
            if not self.dir.is_dir():
                self._prune_stale()
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, name_tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            tmp = Path(name_tmp)
            try:
                packed.contiguous().view(torch.uint8).numpy().tofile(tmp)  # (bf16 has no numpy type)
                tmp.chmod(0o444)  # mapped by running servers: replaced whole, never edited in place
                os.replace(tmp, path)  # atomic: a reader sees the whole file or none
            finally:
                tmp.unlink(missing_ok=True)
            self.writes += 1
            return _map(path, shape, dtype)  # the file's pages, not this process's copy
        except (OSError, RuntimeError) as exc:  # (torch.from_file raises RuntimeError)
            self.failed += 1
            if self.failed == 1:
                log.warning("packed weights not cached in %s (%s): kept in memory", self.dir, exc)
            return packed

    def _prune_stale(self) -> None:
        """Remove this file's folders of other packing code (an older isolab's): a process that still
        maps one keeps its pages (an unlinked file lives while mapped)."""
        assert self.dir is not None
        prefix = self.dir.name.rsplit("-", 1)[0] + "-"
        for old in self.dir.parent.glob(prefix + "*"):
            if old != self.dir and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def _map(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # shared=False: MAP_PRIVATE, file-backed pages until written (the kernels only read)
    return torch.from_file(str(path), shared=False, size=int(np.prod(shape)), dtype=dtype).view(shape)
