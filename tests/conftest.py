"""Shared fixtures: a tiny random Llama written to GGUF (the real loader runs), and the real model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    """The packed weights the suite's models write go to a folder of this session's, not the user's
    cache (models/weight_cache.py): each run packs from the GGUFs it tests; the subprocesses share it."""
    import tempfile

    if "ISOLAB_WEIGHT_CACHE" not in os.environ:
        config._isolab_weight_cache = tempfile.mkdtemp(prefix="isolab-weights-")
        os.environ["ISOLAB_WEIGHT_CACHE"] = config._isolab_weight_cache


def pytest_unconfigure(config):
    import shutil

    folder = getattr(config, "_isolab_weight_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("ISOLAB_WEIGHT_CACHE", None)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    # Larger weights than the default make greedy output depend strongly on the context, so
    # contamination changes tokens, not only logprobs.
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinySpec(layers=2, seed=1))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_path):
    from isolab.models.bundle import load_bundle

    return load_bundle(str(tiny_path), "bf16", "cpu")


@pytest.fixture(scope="session")
def real_bundle():
    from isolab.models.bundle import load_bundle

    return load_bundle(None, "bf16")


@pytest.fixture(scope="session")
def real_bundle_fp32():
    from isolab.models.bundle import load_bundle

    return load_bundle(None, "fp32", weights="dense")  # the bit-exact reference the golden tests compare


REAL_MODEL_FIXTURES = {"real_bundle", "real_bundle_fp32"}


def pytest_collection_modifyitems(config, items):
    """A test that loads the real model is `real` (left out of `make test-fast`), marked or not."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def long_tiny_bundle(tmp_path_factory):
    """The tiny model with a 4096-token context: its byte tokenizer makes the probe's prompts long."""
    from isolab.models.bundle import load_bundle
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny4k.gguf", TinySpec(layers=2, seed=1, context=4096))
    return load_bundle(str(path), "bf16", "cpu")
