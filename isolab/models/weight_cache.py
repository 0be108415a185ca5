"""Owns the on-disk cache of packed weights (the quantized records of kernels/quant.py; the bf16
panels of kernels.pack_weight and a bf16 embedding table): weights the native kernels multiply on
are file pages mapped read-only, not memory each process fills.

What that buys:
- one copy in the page cache for every process that serves the file (Ray replicas, a second
  server), which the OS can take back under pressure and read again on use;
- an idle server holds only the weight pages its requests have touched (as llama.cpp's mmap of
  the GGUF does);
- a second start neither unpacks nor packs.

Key: a folder per GGUF (its SHA-256, which every prefix-cache key carries too) and per code that
shapes the bytes (a hash of the record and panel layouts, the GGUF reader, the weights' building,
and the versions of gguf, numpy and torch: a change to any of them misses; no cache where the
sources cannot be read); a file per weight, named by the tensors it stacks (".bf16" for dense
panels). A file's folders of other code are removed when its new one is made, and temporaries a
killed process left are removed after 10 minutes.

Invariants:
- a file is written whole (a temporary in the same folder, flushed to disk, then an atomic rename)
  and read-only;
  servers map it, so it is replaced (a new file under its name) or deleted, never edited in place;
- a file is opened only if its size is the one its shape implies;
- a missing, short, unmappable or unwritable entry means the weight is packed in memory as before: the cache
  saves work and memory, never changes a bit (the same bytes either way: tests/models/test_weight_cache.py);
- the mapping is private (MAP_PRIVATE) and nothing writes through it.

ISOLAB_WEIGHT_CACHE: a folder to use instead of ~/.cache/isolab/weights, or "off".
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from isolab import kernels
from isolab.kernels import quant
from isolab.paths import user_cache

log = logging.getLogger(__name__)


def _layout_key() -> str | None:
    """A hash of everything that shapes a cached file's bytes: the record and panel layouts
    (kernels/quant.py, kernels.pack_weight, packed_shape, GEMM_PAD_N), the reading of the GGUF
    (models/gguf_loader.py: q/k rows un-permuted there), the building of the weights
    (models/llama.py: which tensors stack, the dtype conversion) and the libraries that dequantize
    (gguf, numpy, torch). None (the cache off) where the sources cannot be read."""
    from isolab.models import gguf_loader, llama

    h = hashlib.sha256()
    try:
        for part in (quant, kernels.pack_weight, kernels.packed_shape, gguf_loader, llama):
            h.update(inspect.getsource(part).encode())
        import gguf

        versions = (getattr(gguf, "__version__", None) or _dist_version("gguf"), np.__version__, torch.__version__)
    except (OSError, TypeError, ImportError):  # a build without its .py files: no key, no cache
        return None
    h.update(f"{kernels.GEMM_PAD_N} {versions}".encode())
    return h.hexdigest()[:16]


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


@functools.cache
def code_key() -> str | None:
    """_layout_key, computed once, on first use (models/llama.py imports this module)."""
    return _layout_key()


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
        key = code_key()
        self.dir = None if base is None or key is None else base / f"{fingerprint[:32]}-{key}"
        self._swept = False  # this folder's leftover temporaries looked at (once a process)
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
        nbytes = int(np.prod(shape)) * dtype.itemsize
        try:
            whole = path.stat().st_size == nbytes
        except OSError:
            whole = False  # not there yet
        if whole:
            try:
                mapped = _map(path, shape, dtype)
                self.hits += 1
                return mapped
            except (OSError, RuntimeError) as exc:  # a whole file this process cannot map (ENOMEM, the map
                return self._in_memory(pack, exc)  # count): its weight in memory; the file stays for others
        packed = pack()
        assert tuple(packed.shape) == shape and packed.dtype == dtype, (name, tuple(packed.shape), shape)
        try:
            if not self.dir.is_dir():
                self._prune_stale()
            self.dir.mkdir(parents=True, exist_ok=True)
            self._sweep()
            fd, name_tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
            tmp = Path(name_tmp)
            try:
                with os.fdopen(fd, "wb") as fh:
                    packed.contiguous().view(torch.uint8).numpy().tofile(fh)  # (bf16 has no numpy type)
                    fh.flush()
                    os.fsync(fh.fileno())  # on disk before it has its name: a crash leaves no file of
                tmp.chmod(0o444)  # the right size and wrong bytes. Read-only: servers map it
                os.replace(tmp, path)  # atomic: a reader sees the whole file or none
                _fsync_dir(self.dir)
            finally:
                tmp.unlink(missing_ok=True)
            self.writes += 1
            return _map(path, shape, dtype)  # the file's pages, not this process's copy
        except (OSError, RuntimeError) as exc:  # (torch.from_file raises RuntimeError)
            return self._in_memory(lambda: packed, exc)

    def _in_memory(self, pack: Callable[[], torch.Tensor], exc: BaseException) -> torch.Tensor:
        self.failed += 1
        if self.failed == 1:
            log.warning("packed weights not cached or mapped in %s (%s): kept in memory", self.dir, exc)
        return pack()

    def _sweep(self, age_s: float = 600.0) -> None:
        """Remove temporaries older than age_s that a killed process left in this folder (once)."""
        if self._swept or self.dir is None:
            return
        self._swept = True
        now = time.time()
        for tmp in self.dir.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime > age_s:
                    tmp.unlink()
            except OSError:
                pass

    def _prune_stale(self) -> None:
        """Remove this file's folders of other packing code (an older isolab's): a process that still
        maps one keeps its pages (an unlinked file lives while mapped)."""
        assert self.dir is not None
        prefix = self.dir.name.rsplit("-", 1)[0] + "-"
        for old in self.dir.parent.glob(prefix + "*"):
            if old != self.dir and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _map(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # shared=False: MAP_PRIVATE, file-backed pages until written (the kernels only read)
    return torch.from_file(str(path), shared=False, size=int(np.prod(shape)), dtype=dtype).view(shape)
