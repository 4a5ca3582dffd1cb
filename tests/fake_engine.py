"""A torch-free engine-like object for the driver / metrics / run-log tests.

`FakeEngine.submit` records when it was called (on the driver's clock) and returns a handle that is already done:
its output's timings say the request was queued at the submit time, scheduled `queue_s` later, produced its first
token `ttft_s` after queueing and one more token every `tpot_s`. `latency(config, n)` may make those depend on the
config (to test sweeps); nothing sleeps, so these tests never depend on the machine's speed.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.requests import RequestOutput, RequestState, RequestTimings


class _Handle:
    def __init__(self, rid: str, out: RequestOutput) -> None:
        self.request_id = rid
        self._out = out
        self.cancelled = False

    def result(self, timeout: float | None = None) -> RequestOutput:
        return self._out

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        self.cancelled = True
        return False


@dataclass
class FakeEngine:
    """Engine-like: submit / reconfigure / reset_stats / stats / user_config."""

    clock: Callable[[], float] = time.perf_counter
    latency: Callable[[Any, int], tuple[float, float, float]] = lambda cfg, i: (0.01, 0.1, 0.02)
    user_config: ContinuousBatchingConfig = field(default_factory=lambda: ContinuousBatchingConfig(page_size=16))
    fail_every: int = 0
    submits: list[tuple[float, Any]] = field(default_factory=list)
    reconfigures: int = 0

    def __post_init__(self) -> None:
        self._ids = itertools.count()
        self.config = self.user_config

    def start(self) -> "FakeEngine":
        return self

    def reset_stats(self) -> None:
        pass

    def stats(self) -> dict:
        return {"run": {"steps": 1, "mean_kv_usage_blocks_frac": 0.5, "mean_kv_usage_tokens_frac": 0.4,
                        "soft_resets": 0, "swaps": 0, "recomputed_tokens": 0}}

    def reconfigure(self, config: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
        self.reconfigures += 1
        self.user_config = self.config = config
        return config

    def submit(self, prompt: Any, max_new_tokens: int = 1, **kw: Any) -> _Handle:
        now = self.clock()
        i = next(self._ids)
        self.submits.append((now, prompt))
        if self.fail_every and (i + 1) % self.fail_every == 0:
            raise ValueError("prompt rejected (fake)")
        q, ttft, tpot = self.latency(self.user_config, i)
        times = [now + ttft + k * tpot for k in range(max_new_tokens)]
        out = RequestOutput(f"fake-{i}", list(prompt), [7] * max_new_tokens, state=RequestState.FINISHED,
                            timings=RequestTimings(queued=now, scheduled=now + q, first_token=times[0],
                                                   finished=times[-1]),
                            token_times=times, max_new_tokens=max_new_tokens)
        return _Handle(out.request_id, out)


class StepClock:
    """A virtual clock for the driver (threaded = False): `sleep_until` jumps, `drain` does nothing."""

    threaded = False

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.sleeps.append(t)
        self.t = max(self.t, t)

    def drain(self) -> None:
        pass
