"""A small open-loop load generator for an OpenAI-compatible server, measuring what the client sees.

Requests are sent to `POST /v1/completions` with `stream=true` at Poisson arrival times (a rate in requests per
second, seeded) or all at once; each one records, on the client's clock:

- TTFT: request sent -> first chunk with text;
- ITL: the gaps between consecutive chunks with text (inter-token latency: the server sends one chunk per token
  delta);
- e2e: request sent -> `[DONE]`; and the completion tokens from the final `usage` chunk.

``python -m cbnb.server.loadgen --url http://127.0.0.1:8000/v1 --workload cpu-32 --rate 2`` prints a JSON summary
(the same as `LoadResult.summary()`). It needs `httpx` (in the `serve` extra). For SLO sweeps and traffic replay,
use a dedicated tool such as GuideLLM against the same URL.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import random
import time
from typing import Any, Sequence

from ..telemetry.stats import percentiles

__all__ = ["RequestRecord", "LoadResult", "run_load", "arrival_times"]


@dataclasses.dataclass
class RequestRecord:
    """What the client measured for one request (seconds on the client's monotonic clock)."""

    index: int
    status: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    e2e_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclasses.dataclass
class LoadResult:
    """All records of one load run, and its wall-clock span (first send -> last response end)."""

    records: list[RequestRecord]
    duration_s: float

    def summary(self) -> dict[str, Any]:
        """requests, ok, errors, requests_per_s, output_tokens_per_s, and ttft_s / itl_s / e2e_s percentiles
        (p50/p90/p99/mean/max/count, seconds)."""
        ok = [r for r in self.records if r.ok]
        d = self.duration_s or float("nan")
        return {
            "requests": len(self.records),
            "ok": len(ok),
            "errors": len(self.records) - len(ok),
            "first_errors": [r.error for r in self.records if not r.ok][:3],
            "duration_s": self.duration_s,
            "requests_per_s": len(ok) / d,
            "output_tokens_per_s": sum(r.completion_tokens for r in ok) / d,
            "ttft_s": percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
            "itl_s": percentiles(x for r in ok for x in r.itl_s),
            "e2e_s": percentiles(r.e2e_s for r in ok if r.e2e_s is not None),
        }


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Send offsets in seconds: Poisson arrivals at `rate` requests/s (exponential gaps), or all 0 when None."""
    if rate is None:
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s or None; got {rate!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client: Any, url: str, body: dict[str, Any], rec: RequestRecord) -> None:
    t0 = time.monotonic()
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    continue
                if chunk.get("usage"):
                    rec.completion_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.monotonic()
                    if last is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.append(now - last)
                    last = now
        rec.e2e_s = time.monotonic() - t0
    except Exception as e:  # a failed request is a record, not the end of the run
        rec.error = f"{type(e).__name__}: {e}"


async def _run(base_url: str, prompts: Sequence[Any], max_tokens: Sequence[int], rate: float | None,
               model: str | None, api_key: str | None, seed: int, temperature: float, ignore_eos: bool,
               timeout: float) -> LoadResult:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    offsets = arrival_times(len(prompts), rate, seed)
    records = [RequestRecord(i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=limits) as client:
        if model is None:
            model = (await client.get("/models")).json()["data"][0]["id"]
        start = time.monotonic()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.monotonic()))
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": temperature,
                    "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True
            await _one(client, "/completions", body, records[i])

        await asyncio.gather(*(send(i) for i in range(len(prompts))))
        return LoadResult(records, time.monotonic() - start)


def run_load(base_url: str, prompts: Sequence[Any], max_tokens: int | Sequence[int], *, rate: float | None = None,
             model: str | None = None, api_key: str | None = None, seed: int = 0, temperature: float = 0.0,
             ignore_eos: bool = True, timeout: float = 600.0) -> LoadResult:
    """Send every prompt as a streamed completion and measure it; blocks until all are done.

    Runs its own event loop (on a thread of its own when the caller's thread already runs one, as a notebook
    cell does); the call waits until every request is done.

    Args:
        base_url: the server's OpenAI base URL (e.g. `server.url`).
        prompts: text or token-id prompts.
        max_tokens: one value, or one per prompt.
        rate: Poisson arrivals in requests/s; None sends all at once.
        model: the model id (None: the first one `/v1/models` lists).
        api_key: sent as a Bearer token.
        seed: seeds the arrival times.
        temperature: 0 is greedy.
        ignore_eos: generate exactly `max_tokens` (vLLM's extension, which cbnb's server takes).
        timeout: per-request HTTP timeout in seconds.

    Raises:
        ImportError: without httpx (``pip install 'cbnb[serve]'``).
    """
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ImportError("the load generator needs httpx: pip install 'cbnb[serve]'") from None
    ns = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(ns) != len(prompts):
        raise ValueError(f"max_tokens has {len(ns)} values for {len(prompts)} prompts")
    coro = _run(base_url, list(prompts), ns, rate, model, api_key, seed, temperature, ignore_eos, timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called where an event loop runs (a notebook cell): run on a thread of its own and wait for it there.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbnb-loadgen") as pool:
        return pool.submit(asyncio.run, coro).result()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from ..lab.workloads import WORKLOADS, get_workload

    p = argparse.ArgumentParser(prog="python -m cbnb.server.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--workload", default="cpu-32", choices=WORKLOADS, help="prompts and lengths (token ids)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workload (request and token counts)")
    p.add_argument("--vocab-size", type=int, default=None, help="draw prompt ids below this (default: the model's)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    w = get_workload(a.workload, scale=a.scale, vocab_size=a.vocab_size, seed=a.seed)
    res = run_load(a.url, w.prompts, w.max_new_tokens, rate=a.rate, api_key=a.api_key, seed=a.seed)
    out = {"workload": w.name, "scale": a.scale, "rate": a.rate, **res.summary()}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
