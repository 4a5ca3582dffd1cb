"""cbnb: a Jupyter-native continuous-batching LLM inference engine that shows its own insides.

Public names are loaded lazily, so `import cbnb.core.scheduler` (or `cbnb.core.config`, `cbnb.core.cache`, ...)
stays torch-free and `import cbnb` needs neither ipywidgets, plotly nor gguf. The layout, one subpackage per layer
(`core`, `engine`, `telemetry`, `runner`, `sim`, `lab`, `export`, `server`, `ui`, `bench`), is mapped in
docs/architecture.md; `cbnb.tuning` is `cbnb.lab.tuning`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ContinuousBatchingConfig": "cbnb.core.config",
    "Request": "cbnb.core.requests",
    "RequestState": "cbnb.core.requests",
    "RequestOutput": "cbnb.core.requests",
    "SamplingParams": "cbnb.core.requests",
    "TokenDelta": "cbnb.core.requests",
    "TokenLogprob": "cbnb.core.requests",
    "Engine": "cbnb.engine.engine",
    "RequestHandle": "cbnb.engine.engine",
    "EngineStoppedError": "cbnb.engine.engine",
    "load_model": "cbnb.engine.models",
    "DEFAULT_MODEL": "cbnb.engine.models",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'cbnb' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
