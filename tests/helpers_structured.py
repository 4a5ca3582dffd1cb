"""Shared helpers for the structured-output and real-client tests (`test_structured.py`, `test_server_tools.py`,
`test_server_clients.py`).

- `smollm2()`: the bundled SmolLM2-135M-Instruct (float32, CPU) and its tokenizer, loaded once per session.
- `smollm2_engine(**cfg)`: a fresh engine on it (small pages, a modest cache).
- `served_smollm2()`: (engine, server) on such an engine, served on a free port as `smollm2-135m`.
- `SCHEMAS`: JSON schemas whose every valid output is short (bounded strings, numbers, arrays), so a request with
  enough `max_new_tokens` always completes its JSON and the test can ask for valid output every time.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import cbnb

from helpers_engine import config, torch_threads

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
LIST = {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99},
                                                    "minItems": 1, "maxItems": 3}},
        "required": ["scores"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "choice": CHOICE, "list": LIST}
MAX_JSON_TOKENS = 64  # more than any output of SCHEMAS needs (at most ~40 characters)


@functools.lru_cache(maxsize=None)
def smollm2() -> tuple[Any, Any]:
    return cbnb.load_model("smollm2-135m", dtype=None, device=None)


def smollm2_engine(**cfg: Any) -> cbnb.Engine:
    model, tok = smollm2()
    cfg.setdefault("page_size", 16)
    cfg.setdefault("num_blocks", 256)
    return cbnb.Engine(model, tokenizer=tok, config=config(**cfg))


@contextlib.contextmanager
def served_smollm2() -> Iterator[tuple[cbnb.Engine, Any]]:
    with torch_threads(1):
        engine = smollm2_engine()
        server = engine.serve(port=0, model_name="smollm2-135m")
        try:
            yield engine, server
        finally:
            server.stop()
            engine.stop()
