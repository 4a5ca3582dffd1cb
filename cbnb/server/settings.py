"""`ServerSettings`: where the server listens, who may call it, and the limits on each request (dependency-free)."""

from __future__ import annotations

import dataclasses
import ipaddress
import warnings

__all__ = ["ServerSettings", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _positive(name: str, v: object, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None' if allow_none else ''}; got {v!r}")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How `serve()` runs.

    Attributes:
        host: address to bind. Loopback (the default, 127.0.0.1) is reachable only from this machine; any other
            address needs `api_key`, or `allow_unauthenticated=True` (with a warning).
        port: TCP port (0: a free one, see `Server.port`).
        api_key: clients must send ``Authorization: Bearer <api_key>`` (compared in constant time); None: no key.
        allow_unauthenticated: bind a non-loopback address without a key anyway.
        model_name: the model id in `/v1/models` and responses (None: taken from the model).
        model_aliases: more names a request's `model` may give (vLLM's ``--served-model-name A B``: B), listed
            after `model_name` in `/v1/models`; a response echoes the name the request used.
        max_body_bytes: largest request body (413 above it).
        max_prompt_tokens: largest prompt in tokens (400 above it); None: the model's context minus one.
        max_tokens_limit: largest `max_tokens` a request may ask (400 above it); None: the model's context.
        max_model_len: prompt plus generated tokens at most, in tokens (vLLM's ``--max-model-len``): requests are
            checked against it as against the model's context, and `/v1/models` reports it; None: the model's
            context. It must not exceed the model's context (`Server.start` raises ValueError).
        max_concurrent_requests: generation requests in flight at once (429 above it).
        graceful_shutdown_s: seconds `stop()` waits for open responses before closing them.

    Raises:
        ValueError: naming the field and its allowed values.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_unauthenticated: bool = False
    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_model_len: int | None = None
    max_concurrent_requests: int = 256
    graceful_shutdown_s: float = 3.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string; got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535]; got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ValueError(f"model_name must be a non-empty string or None; got {self.model_name!r}")
        if not isinstance(self.model_aliases, tuple) or not all(isinstance(a, str) and a for a in self.model_aliases):
            raise ValueError(f"model_aliases must be a tuple of non-empty strings; got {self.model_aliases!r}")
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("max_prompt_tokens", self.max_prompt_tokens, allow_none=True)
        _positive("max_tokens_limit", self.max_tokens_limit, allow_none=True)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("max_concurrent_requests", self.max_concurrent_requests)
        if not isinstance(self.graceful_shutdown_s, (int, float)) or not self.graceful_shutdown_s >= 0:
            raise ValueError(f"graceful_shutdown_s must be a number >= 0; got {self.graceful_shutdown_s!r}")
        if not is_loopback(self.host) and self.api_key is None:
            if not self.allow_unauthenticated:
                raise ValueError(
                    f"host {self.host!r} is reachable from other machines: pass api_key='...' (clients send it as "
                    "'Authorization: Bearer ...'), or allow_unauthenticated=True to serve without one")
            warnings.warn(f"serving on {self.host!r} without an api_key: anyone who can reach this port can use the "
                          "engine", UserWarning, stacklevel=4)
