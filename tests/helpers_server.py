"""Shared helpers for the server tests (`test_server_*.py`).

- `byte_tokenizer()`: a byte-level BPE tokenizer with exactly the tiny models' 512 ids and a ChatML chat template,
  trained once per session on a fixed corpus (no files, no hub): ids 0-2 are <|endoftext|>, <|im_start|> and
  <|im_end|> (the tiny models' pad/bos/eos), so every id a tiny model samples decodes to text.
- `served_engine(...)`: a tiny:llama engine with that tokenizer, served on a free loopback port.
- `wait_until(cond)`: poll a condition, bounded by `TIMEOUT`.
- `slow_steps(engine, s)`: every engine step sleeps `s` seconds first (keeps a request running while a test acts).
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from typing import Any, Callable, Iterator

import pytest

import cbnb

from helpers_engine import TIMEOUT, StepRecorder, config, tiny_model, torch_threads

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = "tiny:llama"


@functools.lru_cache(maxsize=None)
def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    corpus = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 6))) for _ in range(40))
              for _ in range(400)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    assert tk.get_vocab_size() == 512
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def text_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "hello", "world", "cache", "page"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(n)]


def make_engine(**cfg: Any) -> cbnb.Engine:
    cfg.setdefault("page_size", 16)
    cfg.setdefault("num_blocks", 1024)  # 16k tokens: ample, and far smaller than the memory-sized default
    return cbnb.Engine(tiny_model(LLAMA), tokenizer=byte_tokenizer(), config=config(**cfg))


@contextlib.contextmanager
def served_engine(engine: cbnb.Engine | None = None, **serve_kw: Any) -> Iterator[tuple[cbnb.Engine, Any]]:
    """(engine, server) on a free loopback port; both stopped at the end."""
    engine = engine or make_engine()
    serve_kw.setdefault("port", 0)
    serve_kw.setdefault("model_name", "tiny")
    server = engine.serve(**serve_kw)
    try:
        yield engine, server
    finally:
        server.stop()
        engine.stop()


def wait_until(cond: Callable[[], Any], timeout: float = TIMEOUT, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


def slow_steps(engine: cbnb.Engine, seconds: float) -> StepRecorder:
    return StepRecorder(engine, before=lambda work: time.sleep(seconds))


def ended(engine: cbnb.Engine, rid: str) -> Any:
    """The request's final output once it is terminal (from the engine's recent outputs), else None."""
    for out in engine.requests_snapshot():
        if out.request_id == rid and out.finished:
            return out
    return None


# ---------------------------------------------------------------------------------------------- shared fixtures
# `served` and `client` are in tests/server/conftest.py. This one is autouse for the modules that import it
# (`from helpers_server import one_thread`), so it stays here, opted into per module.
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The module runs with one torch intra-op thread (server threads and the engine share 2 cores)."""
    with torch_threads(1):
        yield
