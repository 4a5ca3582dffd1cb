"""Fixtures shared by the test folders (tests/core, tests/engine, tests/runner, ...), and tests/ on sys.path.

pytest's default (prepend) import mode puts this folder on sys.path when it loads this file, so every test module
imports the shared helpers (`helpers_engine`, `helpers_server`, `fake_engine`, ...) by their plain names. Test file
basenames are unique across the folders (the folders have no __init__.py). The fixtures import their helpers when
first used, so collecting a torch-free test module (or tests/ui) does not load torch.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """The module runs with one torch intra-op thread (see `helpers_engine.torch_threads`)."""
    from helpers_engine import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer, read from the converted-model cache. With a tiny model, ids < 512 are byte-level
    pieces and specials: real incremental decoding on a tiny model."""
    from transformers import AutoTokenizer

    from helpers_engine import converted_smollm2

    return AutoTokenizer.from_pretrained(str(converted_smollm2()))


@pytest.fixture(scope="module")
def llama():
    """The tiny llama and its greedy oracle."""
    from helpers_engine import oracle_for, tiny_model

    return tiny_model("tiny:llama"), oracle_for("tiny:llama")
