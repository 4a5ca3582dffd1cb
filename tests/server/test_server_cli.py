"""`cbnb serve` as users run it: a subprocess that prints its URL, answers the openai SDK, drains a request in
flight on SIGINT and exits with status 0; its flags (ContinuousBatchingConfig fields and vLLM's spellings)."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import openai
import pytest

from cbnb.server.cli import build_parser, config_of

from helpers_engine import TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
# exactly what the `cbnb` console script runs (pyproject's [project.scripts]), without installing it
COMMAND = [sys.executable, "-c", "import sys; from cbnb.server.cli import main; sys.exit(main())", "serve"]


def test_the_console_script_is_the_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"cbnb": "cbnb.server.cli:main"}
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert any(d.startswith("llguidance") for d in extra)  # response_format and forced tool calls work


def test_config_flags_and_their_vllm_aliases():
    p = build_parser()
    a = config_of(p.parse_args(["m", "--page-size", "32", "--max-batch-tokens", "256", "--no-allow-block-sharing"]))
    b = config_of(p.parse_args(["m", "--block-size", "32", "--max-num-batched-tokens", "256",
                                "--no-enable-prefix-caching"]))
    assert (a.page_size, a.max_batch_tokens, a.allow_block_sharing) == (32, 256, False)
    assert (b.page_size, b.max_batch_tokens, b.allow_block_sharing) == (32, 256, False)
    c = config_of(p.parse_args(["m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--enforce-eager",
                                "--num-gpu-blocks-override", "100", "--max-num-queued-reqs", "64"]))
    assert (c.max_requests_per_batch, c.max_memory_percent, c.use_cuda_graph, c.num_blocks, c.max_queue_size) == (
        8, 0.5, False, 100, 64)
    assert config_of(p.parse_args(["m", "--scheduling-policy", "fcfs"])).scheduler_type == "vllm"
    assert config_of(p.parse_args(["m", "--scheduler-type", "prefill_first"])).scheduler_type == "prefill_first"
    with pytest.raises(ValueError, match="page_size"):
        config_of(p.parse_args(["m", "--page-size", "0"]))


def test_off_localhost_without_a_key_is_refused_before_loading():
    r = subprocess.run([*COMMAND, "tiny:llama", "--host", "0.0.0.0"], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 2 and "api_key" in r.stderr and "loading" not in r.stdout


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_line(q: queue.Queue, pattern: str, seen: list[str]) -> re.Match:
    while True:
        line = q.get(timeout=TIMEOUT)
        assert line is not None, "the command ended early:\n" + "".join(seen)
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m


def test_serve_command_answers_then_drains_on_sigint_and_exits_0():
    proc = subprocess.Popen([*COMMAND, "tiny:llama", "--port", "0", "--page-size", "16", "--num-blocks", "64",
                             "--served-model-name", "tiny", "--drain-timeout", str(TIMEOUT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    seen: list[str] = []
    try:
        q = _lines(proc)
        url = _wait_line(q, r"serving tiny at (http://127\.0\.0\.1:\d+/v1)", seen).group(1)
        _wait_line(q, r"try .*OpenAI\(base_url=", seen)  # the one-line client snippet
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT) as client:
            r = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
            # a streamed request in flight when SIGINT arrives is drained: it finishes whole
            # (tiny:llama has no tokenizer: logprobs make every token a chunk of its own)
            stream = client.completions.create(model="tiny", prompt=[4, 5, 6], max_tokens=24, temperature=0,
                                               stream=True, logprobs=0, extra_body={"ignore_eos": True})
            it = iter(stream)
            first = next(it)
            assert first.choices[0].finish_reason is None
            proc.send_signal(signal.SIGINT)
            _wait_line(q, r"draining", seen)
            chunks = [first, *it]
            assert chunks[-1].choices[0].finish_reason == "length"
            assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 24
        assert proc.wait(timeout=TIMEOUT) == 0, "".join(seen)
        _wait_line(q, r"cbnb: stopped", seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
