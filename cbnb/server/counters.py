"""Live counters of one server: requests, responses by status, requests in flight, clients, requests per second.

Written on the server's event-loop thread, read from any thread (the dashboard's poller, the kernel): every access
takes a small lock. Dependency-free.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

__all__ = ["ServerCounters"]

RATE_WINDOW_S = 10.0


class ServerCounters:
    """Counts of one server since it started.

    `snapshot()` returns: requests_total (generation requests admitted), responses_by_status ({status: count}, all
    routes), in_flight (generation requests running now), peak_in_flight, clients (distinct client addresses with
    a request in flight), requests_per_s (generation requests completed per second over the last 10 s, or since
    the start when sooner), completion_tokens_total.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests_total = 0
        self.completion_tokens_total = 0
        self.by_status: collections.Counter[int] = collections.Counter()
        self.by_route: collections.Counter[tuple[str, int]] = collections.Counter()
        self.in_flight = 0
        self.peak_in_flight = 0
        self._clients: collections.Counter[str] = collections.Counter()
        self._done: collections.deque[float] = collections.deque()

    def on_response(self, route: str, status: int) -> None:
        with self._lock:
            self.by_status[status] += 1
            self.by_route[(route, status)] += 1

    def on_start(self, client: str) -> None:
        with self._lock:
            self.requests_total += 1
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._clients[client] += 1

    def on_end(self, client: str, completion_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.in_flight -= 1
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]
            self.completion_tokens_total += completion_tokens
            self._done.append(now)
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._done and self._done[0] < now - RATE_WINDOW_S:
            self._done.popleft()

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return {
                "requests_total": self.requests_total,
                "responses_by_status": dict(self.by_status),
                "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "clients": len(self._clients),
                "requests_per_s": len(self._done) / max(1.0, min(RATE_WINDOW_S, now - self.started)),
                "completion_tokens_total": self.completion_tokens_total,
            }

    def routes(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self.by_route)
