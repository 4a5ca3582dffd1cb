"""`EngineLike`: the API every cbnb engine offers, written down (torch-free).

`cbnb.Engine` (a model on a wall clock) and `cbnb.sim.SimEngine` (a cost model on a virtual clock) are one shell
(`cbnb.engine.shell.EngineShell`) and follow this protocol; the HTTP server (`cbnb.server`), the tuning lab
(`cbnb.lab.tuning`, `cbnb.lab.driver`) and the dashboard (`cbnb.ui`) are written against it. Other engine-likes (the
transformers peer of `cbnb.bench.engine_peer`, test fakes) offer a part of it: the helpers below say which part, from declared
attributes, never from a signature.

Attributes an engine declares:

- ``submit_keywords``: the `submit` keywords it honours (a frozenset of names; both cbnb engines derive theirs from
  the one declaration of the keywords, `cbnb.engine.submit_schema`). `SimEngine` accepts every keyword of
  `Engine.submit` but honours fewer (sampling is costed as greedy, a simulation has no logits nor text): the
  server refuses a request field whose keyword is missing here.
- ``marks_runs``: `reset_stats(label, cause=..., marker=...)` records a `RunStarted` marker (run segments).
- ``records_reconfigures``: `reconfigure` writes its own run-log entry.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

__all__ = ["EngineLike", "submit_keywords", "marks_runs", "MINIMAL_SUBMIT_KEYWORDS"]

#: What every engine-like's `submit` takes at least.
MINIMAL_SUBMIT_KEYWORDS = frozenset({"prompt", "max_new_tokens"})


@runtime_checkable
class EngineLike(Protocol):
    """The shared engine API (see the module docstring); every method as documented on `cbnb.Engine`.

    Times are the engine's clock: perf_counter seconds for `cbnb.Engine`, simulated seconds for `SimEngine`
    (``stats()["clock_s"]`` says which instant a read is).
    """

    engine_name: str
    submit_keywords: frozenset[str]
    marks_runs: bool
    records_reconfigures: bool
    tokenizer: Any
    vocab_size: int
    max_positions: int | None

    @property
    def config(self) -> Any: ...
    @property
    def user_config(self) -> Any: ...
    @property
    def events(self) -> Any: ...
    @property
    def state(self) -> str: ...
    @property
    def paused(self) -> bool: ...
    @property
    def step_rate(self) -> float | None: ...

    def submit(self, prompt: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any: ...
    def generate(self, prompts: Iterable[Any], max_new_tokens: Any = None, **kwargs: Any) -> list[Any]: ...
    def cancel(self, request_id: str) -> bool: ...
    def cancel_all(self) -> int: ...
    def reconfigure(self, config: Any, timeout: float | None = 60.0) -> Any: ...
    def start(self, *args: Any, **kwargs: Any) -> Any: ...
    def stop(self, *args: Any, **kwargs: Any) -> None: ...
    def pause(self, wait: bool = True, timeout: float | None = 30.0) -> bool: ...
    def step(self, timeout: float | None = 60.0) -> int | None: ...
    def resume(self) -> None: ...
    def set_step_rate(self, steps_per_s: float | None) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def reset_stats(self, label: str = "", *, cause: str = "reset_stats", marker: bool = True) -> None: ...
    def snapshot(self) -> Any: ...
    def memory_split(self) -> dict[str, int]: ...
    def requests_snapshot(self) -> list[Any]: ...
    def explain(self, request_id: Any) -> Any: ...
    def serve(self, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, **limits: Any) -> Any: ...


def submit_keywords(engine: Any) -> frozenset[str]:
    """The `submit` keywords `engine` honours: its declared ``submit_keywords``, else the minimal set."""
    declared = getattr(engine, "submit_keywords", None)
    return frozenset(declared) if declared is not None else MINIMAL_SUBMIT_KEYWORDS


def marks_runs(engine: Any) -> bool:
    """Whether `engine.reset_stats(label, cause=...)` records a run marker (else it takes no arguments)."""
    return bool(getattr(engine, "marks_runs", False))
