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

from cbnb.server.cli import _load, _notices, _template_text, build_parser, config_of, serve_main

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


def _refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        serve_main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_vllm_flags_that_change_nothing_are_accepted_with_a_notice(capsys):
    p = build_parser()
    a = p.parse_args(["--model", "m", "--tensor-parallel-size", "1", "-pp", "1", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--enable-chunked-prefill", "--trust-remote-code",
                      "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--enable-log-requests"])
    assert a.model_flag == "m" and a.tensor_parallel_size == 1
    assert build_parser().parse_args(["m", "--served-model-name", "a", "b"]).model_names == ["a", "b"]
    said = "\n".join(_notices(a))
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--enable-chunked-prefill", "--trust-remote-code",
                 "--uvicorn-log-level", "--disable-uvicorn-access-log", "--enable-log-requests"):
        assert f"{flag} is accepted and changes nothing" in said
    assert _notices(p.parse_args(["m"])) == []
    # refused before the model loads, each naming the flag the vLLM user typed
    assert "--tensor-parallel-size (-tp) must be 1" in _refused(capsys, "m", "-tp", "2")
    assert "--max-num-seqs: ContinuousBatchingConfig.max_requests_per_batch must be" in _refused(
        capsys, "m", "--max-num-seqs", "0")
    assert "--max-model-len: max_model_len must be an integer >= 1" in _refused(capsys, "m", "--max-model-len", "0")
    assert "--chat-template: no file 'nope.jinja'" in _refused(capsys, "m", "--chat-template", "nope.jinja")
    assert "the model is missing" in _refused(capsys, "--port", "0")
    assert "give MODEL first" in _refused(capsys, "--served-model-name", "a", "m")
    assert "unrecognized arguments: --quantization" in _refused(capsys, "m", "--quantization", "fp8")


def test_chat_template_flag_sets_the_served_template(tmp_path):
    from helpers_server import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "tok")
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert _template_text(template) == template  # the template itself, as vLLM takes it
    args = build_parser().parse_args(["tiny:llama", "--tokenizer", str(tmp_path / "tok"), "--chat-template",
                                      str(tmp_path / "t.jinja")])
    args.chat_template = _template_text(args.chat_template)
    engine = _load(args)
    try:
        assert engine.tokenizer.chat_template == template
        assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == (
            "<|im_start|>ab<|im_end|>")
    finally:
        engine.stop()


def test_the_hub_id_of_a_bundled_model_serves_its_copy_when_the_hub_is_unreachable(monkeypatch, capsys):
    """`cbnb serve HuggingFaceTB/SmolLM2-135M-Instruct`, as a vLLM user types it, on a laptop offline."""
    import cbnb.engine.models as models

    real, asked, hf = models.load_model, [], "HuggingFaceTB/SmolLM2-135M-Instruct"

    def offline(name, **kw):
        asked.append(name)
        if "/" in name:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        return real("tiny:llama", **kw)  # stands in for the bundled copy

    monkeypatch.setattr(models, "load_model", offline)
    args = build_parser().parse_args([hf])
    engine = _load(args)
    try:
        assert asked == [hf, "smollm2-135m"] and args.model_name == hf
        assert "serving the bundled copy of the same model, smollm2-135m" in capsys.readouterr().err
    finally:
        engine.stop()
    with pytest.raises(OSError, match="couldn't connect"):  # any other hub id: the hub's own error
        _load(build_parser().parse_args(["someone/other-model"]))


def test_the_printed_snippet_never_shows_the_key():
    from cbnb.server.cli import _snippet

    line = _snippet("http://127.0.0.1:8000/v1", "foo", "sk-secret-123")
    assert "sk-secret-123" not in line and "os.environ['CBNB_API_KEY']" in line
    code = re.search(r'python -c "(.*)"', line).group(1)
    compile(code, "<snippet>", "exec")  # valid Python as printed
    assert "api_key='none'" in _snippet("http://127.0.0.1:8000/v1", "foo", None)


def test_off_localhost_without_a_key_is_refused_before_loading():
    r = subprocess.run([*COMMAND, "tiny:llama", "--host", "0.0.0.0"], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 2 and "api_key" in r.stderr and "loading" not in r.stdout


def test_a_port_in_use_is_a_one_line_error_not_a_traceback():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([*COMMAND, "tiny:llama", "--port", str(port)], capture_output=True, text=True,
                           timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert f"cbnb serve: error: port {port} on 127.0.0.1 is in use by another program" in r.stderr
    assert "--port 0 picks a free one" in r.stderr and "Traceback" not in r.stderr
    assert "loading" not in r.stdout  # found before the model loads


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
