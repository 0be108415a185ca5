"""Where isolab keeps what it builds once per machine (kernels, the invariance verdicts, joined
model files, packed weights): one folder per kind under $XDG_CACHE_HOME/isolab (~/.cache/isolab)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isolab" / kind
