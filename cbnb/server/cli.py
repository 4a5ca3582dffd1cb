"""`cbnb serve MODEL`: the OpenAI-compatible server as a command, a drop-in for `vllm serve MODEL`.

::

    cbnb serve smollm2-135m --port 8000                   # or: python -m cbnb.server smollm2-135m --port 8000
    cbnb serve ./my-model --host 0.0.0.0 --api-key sk-... --max-num-seqs 32 --block-size 64

MODEL is anything `cbnb.load_model` takes: a bundled name (``smollm2-135m``, ``gemma3-270m``), ``tiny:llama``-style
test models, a local folder, or a hub id where the hub is reachable. The engine's settings are transformers'
`ContinuousBatchingConfig` fields as flags (``--page-size``, ``--max-batch-tokens``, ...; booleans also as
``--no-...``), and vLLM's spellings of the same knobs are accepted as aliases (`VLLM_ALIASES`); vLLM's flags that
change nothing here are accepted with a notice (`_IGNORED_VLLM`), its parallelism flags only at 1, and
``--max-model-len`` bounds prompt plus generated tokens as in vLLM. Serving settings
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
import errno
import os
import signal
import socket
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
# vLLM's flags that change nothing here: accepted, with a notice at start (flag -> why).
_IGNORED_VLLM = {"--trust-remote-code": "cbnb loads models with transformers' own classes",
                 "--disable-log-requests": "cbnb logs no requests", "--enable-log-requests": "cbnb logs no requests",
                 "--disable-log-stats": "cbnb logs no stats",
                 "--enable-chunked-prefill": "cbnb always splits long prompts into chunks of --max-batch-tokens",
                 "--enable-auto-tool-choice": "cbnb always reads tool calls from the answer (tool_choice 'auto')",
                 "--disable-uvicorn-access-log": "cbnb logs no requests"}
_IGNORED_VLLM_VALUES = {"--tool-call-parser": "cbnb reads tool calls itself (bare JSON and <tool_call> blocks)",
                        "--uvicorn-log-level": "cbnb logs warnings only"}
# vLLM's parallelism flags: cbnb serves on one device, so only 1 is accepted (flag -> short spelling).
_PARALLEL_VLLM = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp", "--data-parallel-size": "-dp"}


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
    p.add_argument("model", nargs="?", help="a bundled name (smollm2-135m, gemma3-270m), a tiny:NAME test model, "
                   "a local folder or a hub id")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="the same as the positional MODEL (vLLM's older spelling)")
    s = p.add_argument_group("serving (engine.serve's settings)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind; any non-loopback one needs --api-key")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one)")
    s.add_argument("--api-key", default=os.environ.get("CBNB_API_KEY"),
                   help="clients send 'Authorization: Bearer <key>' (default: $CBNB_API_KEY)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="bind a non-loopback address without an API key (anyone reaching the port can use it)")
    s.add_argument("--served-model-name", dest="model_names", nargs="+", default=None, metavar="NAME",
                   help="the model id clients name (default: the model's folder or bundled name); as in vLLM, "
                   "several names are all accepted and the first is the one listed first")
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
    m.add_argument("--chat-template", default=None, help="the chat template (Jinja) for /v1/chat/completions "
                   "and /v1/responses: a file, or the template itself (default: the tokenizer's)")
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
                   help="prompt plus generated tokens at most, at most the model's context (default: the model's "
                   "context); /v1/models reports it")
    for flag, why in _IGNORED_VLLM.items():
        v.add_argument(flag, action="store_true", help=f"accepted and ignored: {why}")
    for flag, why in _IGNORED_VLLM_VALUES.items():
        v.add_argument(flag, default=None, help=f"accepted and ignored: {why}")
    for flag, short in _PARALLEL_VLLM.items():
        v.add_argument(flag, short, type=int, default=1, help="cbnb serves on one device: only 1")
    return p


def _flag_of(field: str, argv: Sequence[str]) -> str | None:
    """The flag the user typed for config field `field` (its own or a vLLM alias), for error messages."""
    flags = [f"--{field.replace('_', '-')}", *(f for f, (name, _) in VLLM_ALIASES.items() if name == field)]
    flags += {"allow_block_sharing": ["--enable-prefix-caching", "--no-enable-prefix-caching"],
              "use_async_batching": ["--async-scheduling", "--no-async-scheduling"]}.get(field, [])
    for a in argv:
        if a.split("=", 1)[0] in flags:
            return a.split("=", 1)[0]
    return None


def _notices(args: argparse.Namespace) -> list[str]:
    """One line for each vLLM flag given that changes nothing here."""
    out = [f"{flag} is accepted and changes nothing: {why}" for flag, why in _IGNORED_VLLM.items()
           if getattr(args, flag[2:].replace("-", "_"))]
    out += [f"{flag} is accepted and changes nothing: {why}" for flag, why in _IGNORED_VLLM_VALUES.items()
            if getattr(args, flag[2:].replace("-", "_")) is not None]
    return out


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


def _port_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now, as the server binds it (SO_REUSEADDR: TIME_WAIT does not count)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE  # another error (a bad host) is the server's to report
    return True


def _template_text(value: str) -> str:
    """The Jinja text of ``--chat-template``: a file's content, or `value` itself when it holds Jinja markup.

    Raises:
        OSError: the file cannot be read. ValueError: no such file, and `value` is no template either.
    """
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"no file {value!r}, and it is no Jinja template either (no '{{{{' or '{{%')")


def _snippet(url: str, model: str, key: str | None) -> str:
    """A one-line openai call to the server. The key itself is never printed (consoles end up in logs and
    screenshots): the snippet reads it from $CBNB_API_KEY, as the dashboard's snippets do."""
    api_key = "os.environ['CBNB_API_KEY']" if key else "'none'"
    return (f"python -c \"{'import os; ' if key else ''}from openai import OpenAI; c = OpenAI(base_url='{url}', "
            f"api_key={api_key}); print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', "
            "'content': 'Hello'}], max_tokens=32).choices[0].message.content)\"" + (
                "   (with CBNB_API_KEY set to the key)" if key else ""))


def _load(args: argparse.Namespace) -> Any:
    from ..engine.engine import Engine
    from ..engine.models import load_model

    dtype = args.dtype if args.dtype not in (None, "auto") else None
    try:
        model, tok = load_model(args.model, dtype=dtype, device=args.device)
    except (OSError, ValueError) as e:
        from .app import HF_IDS

        bundled = {hf: name for name, hf in HF_IDS.items()}.get(args.model)
        if bundled is None:
            raise
        # `vllm serve HuggingFaceTB/SmolLM2-135M-Instruct` offline: cbnb ships that model, so serve its copy
        print(f"cbnb: cannot fetch {args.model} from the hub ({str(e).splitlines()[0][:160]}); serving the "
              f"bundled copy of the same model, {bundled}", file=sys.stderr, flush=True)
        model, tok = load_model(bundled, dtype=dtype, device=args.device)
        if getattr(args, "model_name", None) is None:
            args.model_name = args.model  # clients name the id they gave, as with vLLM
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.chat_template is not None:
        if tok is None:
            raise ValueError("--chat-template needs a tokenizer, and this model has none (give --tokenizer)")
        tok.chat_template = args.chat_template
    return Engine(model, tokenizer=tok, config=config_of(args))


def serve_main(argv: Sequence[str]) -> int:
    """`cbnb serve ...`; returns the exit status (0 after a drained shutdown, 1 when the model does not load, 2 for
    bad arguments)."""
    from .lifecycle import serve
    from .settings import ServerSettings

    parser = build_parser()
    argv = list(argv)
    args = parser.parse_args(argv)
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        parser.error(f"two models: {args.model!r} and --model {args.model_flag!r}; give one")
    args.model = args.model or args.model_flag
    args.model_name, args.model_aliases = (args.model_names[0], tuple(args.model_names[1:])) if (
        args.model_names) else (None, ())
    if args.model is None:
        parser.error("the model is missing: cbnb serve MODEL (a bundled name, a local folder or a hub id)" + (
            "; --served-model-name takes every name after it, so give MODEL first" if args.model_names else ""))
    for flag, short in _PARALLEL_VLLM.items():
        if getattr(args, flag[2:].replace("-", "_")) != 1:
            parser.error(f"{flag} ({short}) must be 1: cbnb serves a model on one device")
    try:  # settings and config first: a bad flag fails before the model loads
        ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                       allow_unauthenticated=args.allow_unauthenticated, model_name=args.model_name,
                       model_aliases=args.model_aliases, max_prompt_tokens=args.max_prompt_tokens,
                       max_tokens_limit=args.max_tokens_limit, max_model_len=args.max_model_len,
                       max_concurrent_requests=args.max_concurrent_requests)
        config_of(args)
    except ValueError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0].removeprefix("ContinuousBatchingConfig.")
        flag = _flag_of(field, argv) or (f"--{field.replace('_', '-')}" if field in (
            "port", "max_model_len", "max_prompt_tokens", "max_tokens_limit", "max_concurrent_requests") else None)
        parser.error(f"{flag}: {msg}" if flag and flag not in msg else msg)
    if args.chat_template is not None:  # vLLM's --chat-template: a file, or the template itself
        try:
            args.chat_template = _template_text(args.chat_template)
        except (OSError, ValueError) as e:
            parser.error(f"--chat-template: {e}")
    if args.port and not _port_free(args.host, args.port):  # before a load that may take minutes
        print(f"cbnb serve: error: port {args.port} on {args.host} is in use by another program: stop it, or pass "
              "another --port (--port 0 picks a free one)", file=sys.stderr, flush=True)
        return 1
    for line in _notices(args):
        print(f"cbnb: {line}", file=sys.stderr, flush=True)
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
        try:
            server = serve(engine, host=args.host, port=args.port, api_key=args.api_key,
                           allow_unauthenticated=args.allow_unauthenticated, model_name=args.model_name or
                           _default_name(args.model), model_aliases=args.model_aliases,
                           max_prompt_tokens=args.max_prompt_tokens,
                           max_tokens_limit=args.max_tokens_limit, max_model_len=args.max_model_len,
                           max_concurrent_requests=args.max_concurrent_requests)
        except ValueError as e:  # a setting that needs the model to check (--max-model-len above its context)
            print(f"cbnb serve: error: {e}", file=sys.stderr, flush=True)
            return 2
        except OSError as e:  # the port is taken: the reason, not a traceback
            why = (e.strerror or str(e)).replace("port=0 picks", "--port 0 picks")
            print(f"cbnb serve: error: {why}", file=sys.stderr, flush=True)
            return 1
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
