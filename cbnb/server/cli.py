"""`cbnb serve MODEL`: the OpenAI-compatible server as a command, a drop-in for `vllm serve MODEL`.

::

    cbnb serve smollm2-135m --port 8000                   # or: python -m cbnb.server smollm2-135m --port 8000
    cbnb serve ./my-model --host 0.0.0.0 --api-key sk-... --max-num-seqs 32 --block-size 64

MODEL is anything `cbnb.load_model` takes: a bundled name (``smollm2-135m``, ``gemma3-270m``), ``tiny:llama``-style
test models, a local folder, or a hub id where the hub is reachable. The engine's settings are transformers'
`ContinuousBatchingConfig` fields as flags (``--page-size``, ``--max-batch-tokens``, ...; booleans also as
``--no-...``), and vLLM's spellings of the same knobs are accepted as aliases (`VLLM_ALIASES`). Serving settings
are `engine.serve()`'s, with the same safety defaults: 127.0.0.1, and an API key required on any other address
(``--allow-unauthenticated`` to go without, with a warning).

Once the port accepts connections the command prints the URL and a one-line client snippet. Ctrl-C (SIGINT) or
SIGTERM drains: new requests get 503 (and `/health` 503), the requests in flight finish (at most
``--drain-timeout`` seconds, then they are cancelled), the port closes, the engine stops, and the command exits
with status 0. A second Ctrl-C cancels what is left at once. No dashboard: it is a notebook widget (serve from a
notebook with ``engine.serve()`` to watch the engine while it serves).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Any, Sequence

__all__ = ["main", "build_parser", "config_of", "VLLM_ALIASES"]

# vLLM flag -> (ContinuousBatchingConfig field, how the value maps). Semantics from cbnb.export.vllm (vLLM 0.33).
VLLM_ALIASES: dict[str, tuple[str, str]] = {
    "--block-size": ("page_size", "tokens per KV block"),
    "--num-gpu-blocks-override": ("num_blocks", "KV blocks in the cache"),
    "--max-num-batched-tokens": ("max_batch_tokens", "query tokens per step"),
    "--max-num-seqs": ("max_requests_per_batch", "requests per step"),
    "--max-num-queued-reqs": ("max_queue_size", "requests in flight, waiting or running"),
    "--gpu-memory-utilization": ("max_memory_percent",
                                 "approximate: vLLM's share of the whole GPU for weights, activations and KV; "
                                 "cbnb's (transformers') share of the memory free after loading, for KV and "
                                 "activations"),
    "--watermark": ("safety_margin", "approximate: the share of the cache kept free when admitting a request"),
}
# Config fields not offered as flags: compile configs (objects) and transformers' deprecated fields.
_SKIPPED = {"varlen_compile_config", "decode_compile_config", "use_default_compile_configs", "max_cached_graphs",
            "block_size"}
# vLLM's serving flags that are cbnb serving settings or that cbnb takes and ignores (one GPU, no remote code).
_IGNORED_VLLM = {"--trust-remote-code": "cbnb loads models with transformers' own classes",
                 "--disable-log-requests": "cbnb logs no requests", "--disable-log-stats": "cbnb logs no stats"}


def _field_type(f: dataclasses.Field) -> Any:
    """The scalar type of a config field for argparse (bool, int, float or str), or None when it has none."""
    t = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if t.split(" | ")[0] == name:
            return typ
    return None


def build_parser() -> argparse.ArgumentParser:
    """The parser of `cbnb serve` (the ``serve`` subcommand's options)."""
    from ..core.config import ContinuousBatchingConfig

    p = argparse.ArgumentParser(
        prog="cbnb serve", description="Serve a model over an OpenAI-compatible HTTP API (a drop-in for `vllm "
        "serve`). Ctrl-C or SIGTERM drains the requests in flight and exits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="a bundled name (smollm2-135m, gemma3-270m), a tiny:NAME test model, a local "
                   "folder or a hub id")
    s = p.add_argument_group("serving (engine.serve's settings)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind; any non-loopback one needs --api-key")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one)")
    s.add_argument("--api-key", default=os.environ.get("CBNB_API_KEY"),
                   help="clients send 'Authorization: Bearer <key>' (default: $CBNB_API_KEY)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="bind a non-loopback address without an API key (anyone reaching the port can use it)")
    s.add_argument("--served-model-name", dest="model_name", default=None,
                   help="the model id clients name (default: the model's folder or bundled name)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="largest prompt (default: the context - 1)")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask")
    s.add_argument("--max-concurrent-requests", type=int, default=256, help="requests in flight (429 above)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds Ctrl-C / SIGTERM waits for the requests in flight before cancelling them")
    m = p.add_argument_group("model")
    m.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, bfloat16 "
                   "on a GPU); vLLM's 'auto' is the default")
    m.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    m.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id (default: the model's)")
    c = p.add_argument_group("engine (transformers' ContinuousBatchingConfig fields; vLLM's flags as aliases)")
    fields = {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}
    aliases: dict[str, list[str]] = {}
    for flag, (name, _) in VLLM_ALIASES.items():
        aliases.setdefault(name, []).append(flag)
    for name, f in fields.items():
        typ = _field_type(f) if name not in _SKIPPED else None
        if typ is None:
            continue
        flags = [f"--{name.replace('_', '-')}", *aliases.get(name, [])]
        help_ = f"ContinuousBatchingConfig.{name}" + (f" (vLLM: {', '.join(aliases[name])}: "
                                                       f"{VLLM_ALIASES[aliases[name][0]][1]})" if name in aliases
                                                      else "")
        if typ is bool:
            c.add_argument(flags[0], dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            c.add_argument(*flags, dest=name, type=typ, default=None, help=help_)
    v = p.add_argument_group("vLLM's other spellings")
    v.add_argument("--enable-prefix-caching", dest="allow_block_sharing", action=argparse.BooleanOptionalAction,
                   default=None, help="= --allow-block-sharing")
    v.add_argument("--async-scheduling", dest="use_async_batching", action=argparse.BooleanOptionalAction,
                   default=None, help="= --use-async-batching")
    v.add_argument("--enforce-eager", action="store_true", help="= --no-use-cuda-graph")
    v.add_argument("--scheduling-policy", choices=["fcfs"], default=None,
                   help="fcfs = --scheduler-type vllm (vLLM V1's scheduling policy, in cbnb's core; cbnb has no "
                   "priority policy)")
    v.add_argument("--max-model-len", type=int, default=None,
                   help="prompt plus generated tokens at most (sets --max-prompt-tokens and --max-tokens-limit "
                   "when they are not given)")
    for flag, why in _IGNORED_VLLM.items():
        v.add_argument(flag, action="store_true", help=f"accepted and ignored: {why}")
    return p


def config_of(args: argparse.Namespace) -> Any:
    """The `ContinuousBatchingConfig` of parsed arguments (only the fields given; the rest keep their defaults).

    Raises:
        ValueError: a value outside a field's range (the config's own message, naming the field).
    """
    from ..core.config import ContinuousBatchingConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ContinuousBatchingConfig)
             if getattr(args, f.name, None) is not None}
    if getattr(args, "enforce_eager", False):
        given["use_cuda_graph"] = False
    if getattr(args, "scheduling_policy", None) == "fcfs":  # what `vllm serve --scheduling-policy fcfs` runs
        if given.get("scheduler_type", "vllm") != "vllm":
            raise ValueError(f"--scheduling-policy fcfs is scheduler_type 'vllm'; got --scheduler-type "
                             f"{given['scheduler_type']!r} too")
        given["scheduler_type"] = "vllm"
    return ContinuousBatchingConfig(**given)


def _snippet(url: str, model: str, key: str | None) -> str:
    return (f"python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}', api_key='{key or 'none'}'); "
            f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], "
            "max_tokens=32).choices[0].message.content)\"")


def _load(args: argparse.Namespace) -> Any:
    from ..engine.engine import Engine
    from ..engine.models import load_model

    model, tok = load_model(args.model, dtype=args.dtype if args.dtype not in (None, "auto") else None,
                            device=args.device)
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    return Engine(model, tokenizer=tok, config=config_of(args))


def serve_main(argv: Sequence[str]) -> int:
    """`cbnb serve ...`; returns the exit status (0 after a drained shutdown, 1 when the model does not load, 2 for
    bad arguments)."""
    from .lifecycle import serve
    from .settings import ServerSettings

    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.max_model_len is not None:
        args.max_prompt_tokens = args.max_prompt_tokens or args.max_model_len - 1
        args.max_tokens_limit = args.max_tokens_limit or args.max_model_len
    try:  # settings and config first: a bad flag fails before the model loads
        ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                       allow_unauthenticated=args.allow_unauthenticated, model_name=args.model_name,
                       max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                       max_concurrent_requests=args.max_concurrent_requests)
        config_of(args)
    except ValueError as e:
        parser.error(str(e))
    stop = threading.Event()
    signals = {"n": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["n"] += 1
        stop.set()
        if signals["n"] > 1:
            print("cbnb: second signal: cancelling the requests in flight", file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"cbnb: loading {args.model} ...", flush=True)
    t0 = time.monotonic()
    try:
        engine = _load(args)
    except (ImportError, OSError, ValueError) as e:  # a missing package or folder, a hub that cannot be reached
        print(f"cbnb: cannot load {args.model!r}: {e}", file=sys.stderr, flush=True)
        return 1
    server = None
    try:
        server = serve(engine, host=args.host, port=args.port, api_key=args.api_key,
                       allow_unauthenticated=args.allow_unauthenticated, model_name=args.model_name or
                       _default_name(args.model), max_prompt_tokens=args.max_prompt_tokens,
                       max_tokens_limit=args.max_tokens_limit, max_concurrent_requests=args.max_concurrent_requests)
        print(f"cbnb: serving {server.model_name} at {server.url} (loaded in {time.monotonic() - t0:.1f} s; "
              "Ctrl-C to stop)", flush=True)
        print(f"cbnb: try  {_snippet(server.url, server.model_name, args.api_key)}", flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print("cbnb: the server stopped on its own", file=sys.stderr, flush=True)
                return 1
        print("cbnb: draining the requests in flight (Ctrl-C again to cancel them) ...", flush=True)
        left = server.drain(args.drain_timeout, give_up=lambda: signals["n"] > 1)
        if left:
            print(f"cbnb: cancelling {left} request(s) still in flight", flush=True)
    finally:
        if server is not None:
            server.stop()
        engine.stop()
    print("cbnb: stopped", flush=True)
    return 0


def _default_name(model: str) -> str | None:
    """The served name of a bundled or tiny model is its cbnb name (`load_model`'s), else the server's default."""
    return model if (":" in model or "/" not in model) and not os.path.exists(model) else None


def main(argv: Sequence[str] | None = None) -> int:
    """The `cbnb` console script: ``cbnb serve MODEL [flags]`` (``cbnb serve --help`` lists them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cbnb serve MODEL [flags]   (cbnb serve --help for the flags)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"cbnb: unknown command {argv[0]!r}; the command is: cbnb serve MODEL [flags]", file=sys.stderr)
        return 2
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
