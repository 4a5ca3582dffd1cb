"""Shared helpers for the engine tests (`test_engine_oracle.py`, `test_engine_api.py`, `test_engine_faults.py`).

- `tiny_model(name)`: one tiny random model per name for the whole session (float32, CPU, seed 0); the fixtures
  `llama` (tiny:llama and its `Oracle`) and `one_torch_thread` (a module runs with one intra-op thread; use it as
  ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``) import from here.
- `Oracle`: greedy references from ``model.generate`` for one request alone, computed once and sliced for shorter
  lengths (greedy decoding of n tokens is a prefix of decoding m > n tokens: the forwards are the same).
- `StepRecorder`: wraps ``engine.runner.execute`` to record what every step ran (request, chunk start, chunk size,
  whether it sampled), and can run a callback inside the engine thread before a step (to cancel or fail a request
  at an exact stage, with no sleeps).
- `paused(engine)`: holds the engine loop before its next drain of the inbox, so a group of submissions lands in
  the same loop turn (deterministic first batches, hence deterministic offloads).
- `assert_no_blocks(engine, rid)`: the request holds no device or host block and is unknown to the core.
- `smollm2_tokenizer`: a fixture, SmolLM2's real tokenizer (for tiny models whose text must be real).
- `async_engine(model, cfg)`: an engine whose runner is the CUDA runner on CPU (fake graphs, torch attention) with
  async batching on, so the double-buffered loop runs without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import torch

import cbnb
from cbnb.engine.models import load_model

TINY_MODELS = ("tiny:llama", "tiny:qwen3", "tiny:gemma3", "tiny:mistral")
SHARING_MODELS = ("tiny:llama", "tiny:qwen3")  # pure full attention: prefix sharing is on
WINDOW = 16  # sliding window of tiny:gemma3 / tiny:mistral
VOCAB = 512
TIMEOUT = 120.0  # seconds; a generous bound on any wait, so a hung engine fails instead of blocking the suite


@functools.lru_cache(maxsize=None)
def tiny_model(name: str) -> torch.nn.Module:
    model, tok = load_model(name, dtype=torch.float32, device="cpu")
    assert tok is None
    return model


def random_prompts(lengths: list[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """Random prompts of the given lengths; ids in [3, vocab) (no pad/bos/eos, which are < 3 in the tiny models)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Standard prompts: lengths below, across and well past the 16-token window; generations of 24 cross it too.
STD_LENGTHS = [5, 13, 17, 30, 47, 60]
STD_NEW = 24
STD_PROMPTS = random_prompts(STD_LENGTHS, seed=7)


def reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of ``model.generate`` for this prompt alone (EOS ignored).

    The explicit attention_mask matters: without it, generate masks every prompt position whose id equals
    pad_token_id.
    """
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Oracle:
    """Cached greedy references for one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._refs: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        have = self._refs.get(key)
        if have is None or len(have) < n:
            have = self._refs[key] = reference(self.model, list(prompt), n)
        return have[:n]


@functools.lru_cache(maxsize=None)
def oracle_for(name: str) -> Oracle:
    """One `Oracle` per tiny model for the session (references are computed once and reused across modules)."""
    return Oracle(tiny_model(name))


def config(**kw: Any) -> cbnb.ContinuousBatchingConfig:
    return cbnb.ContinuousBatchingConfig(**kw)


# ------------------------------------------------------------------------------------------------ instrumentation
@dataclass
class StepEntry:
    step_id: int
    request_id: str
    start: int
    num_tokens: int
    phase: str
    samples: bool


class StepRecorder:
    """Record every step the engine runs, and optionally act inside the engine thread before or instead of it.

    Attributes:
        steps: one list of `StepEntry` per executed step (failed steps included).
        swapped_out: request ids in the order their blocks were copied to the host pool.
        before: optional ``callback(work)`` run in the engine thread before the step's copies and forward; it may
            raise to make the step fail (as a forward exception would).
    """

    def __init__(self, engine: cbnb.Engine, before: Callable[[Any], None] | None = None) -> None:
        self.engine = engine
        self.runner = engine.runner
        self._orig = engine.runner.execute
        self.steps: list[list[StepEntry]] = []
        self.swapped_out: list[str] = []
        self.before = before
        self.lock = threading.Lock()
        engine.runner.execute = self._execute  # type: ignore[method-assign]

    def _execute(self, work):
        entries = [StepEntry(work.step_id, s.request_id, s.start, s.num_tokens, s.phase, s.samples)
                   for s in work.plan.scheduled]
        with self.lock:
            self.steps.append(entries)
            self.swapped_out.extend(r.request_id for r, _ in work.swap_outs)
        if self.before is not None:
            self.before(work)
        return self._orig(work)

    def entries(self, rid: str | None = None) -> list[StepEntry]:
        with self.lock:
            return [e for step in self.steps for e in step if rid is None or e.request_id == rid]

    def split_prompts(self) -> set[str]:
        """Requests that had at least one prefill chunk that did not sample (their prompt was split)."""
        return {e.request_id for e in self.entries() if e.phase == "prefill" and not e.samples}

    def max_step_tokens(self) -> int:
        with self.lock:
            return max((sum(e.num_tokens for e in step) for step in self.steps), default=0)


def paused(engine: cbnb.Engine):
    """Hold the engine loop before its next inbox drain while the block runs (the engine is started if needed).

    Submissions made inside the block are therefore all applied in the same loop turn.
    """
    from cbnb.measure._together import submitted_together

    return submitted_together(engine, TIMEOUT)


def submit_together(engine: cbnb.Engine, prompts: list[list[int]], max_new_tokens: int | list[int] = STD_NEW,
                    **kw: Any) -> list[cbnb.RequestHandle]:
    """Submit all prompts so that the engine sees them in one loop turn; EOS is ignored unless given."""
    kw.setdefault("eos_token_id", -1)
    ns = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    with paused(engine):
        return [engine.submit(p, max_new_tokens=n, **kw) for p, n in zip(prompts, ns)]


def results(handles: list[cbnb.RequestHandle], timeout: float = TIMEOUT) -> list[cbnb.RequestOutput]:
    return [h.result(timeout=timeout) for h in handles]


def assert_no_blocks(engine: cbnb.Engine, rid: str) -> None:
    """The request holds no device block in any group, no host swap block, and the core no longer tracks it."""
    cache = engine.cache
    for a in cache.allocators:
        assert rid not in a.tables or not a.tables[rid], f"{rid} still holds blocks in group {a.index}"
    if cache.swap is not None:
        assert not cache.swap.holds(rid), f"{rid} still holds host swap blocks"
    assert rid not in engine.core.requests
    assert rid not in engine.core.scheduler.waiting and rid not in engine.core.scheduler.active


def assert_cache_empty(engine: cbnb.Engine) -> None:
    """With no request left (engine idle or stopped): invariants hold and no table, no swap copy remains."""
    assert not engine.core.requests
    engine.cache.check_invariants([])
    for a in engine.cache.allocators:
        assert not any(a.tables.values()), f"group {a.index} still has block tables: {a.tables}"
    if engine.cache.swap is not None:
        for g in engine.cache.swap.allocators:
            assert not any(g.tables.values())


def async_engine(model: torch.nn.Module, cfg: cbnb.ContinuousBatchingConfig, **runner_kw: Any) -> cbnb.Engine:
    from cbnb.runner.cuda.cuda_runner import CudaModelRunner

    engine = cbnb.Engine(model, config=cfg)
    runner = CudaModelRunner(engine.model, engine.cache.geometry(), engine.store, seed=engine.config.seed,
                             attention="torch", **runner_kw)
    runner.configure(engine.config, use_cuda_graph=True, use_async_batching=True)
    assert runner.async_mode
    engine.runner = runner
    return engine


def cbnb_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("cbnb")}


def converted_smollm2():
    """The converted bundled SmolLM2's cache folder, converting it first if needed (once per machine: later tests and
    the notebooks load it anyway)."""
    from cbnb.engine.models import _cache_ready, load_model, model_cache_dir

    path = model_cache_dir() / "smollm2-135m"
    if not _cache_ready(path):
        load_model("smollm2-135m")
    assert _cache_ready(path), path
    return path


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with `n` intra-op threads. The tiny models do microsecond-sized ops: with 2 threads on 2 busy cores the
    OpenMP hand-offs make a step 10x slower than with one, so the tiny-model tests use 1."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
