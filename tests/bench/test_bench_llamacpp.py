"""The llama.cpp peer (`cbnb.bench.llamacpp`) without llama.cpp: its request and answer shapes, and whole runs
against a fake `llama-server` (tests/bench/fake_llama_server.py) that answers the same HTTP shape."""

from __future__ import annotations

import json
import pathlib
import stat
import sys
from types import SimpleNamespace

import pytest

from cbnb import bench
from cbnb.bench import llamacpp

FAKE = pathlib.Path(__file__).with_name("fake_llama_server.py")
sys.path.insert(0, str(FAKE.parent))
from fake_llama_server import answer  # noqa: E402


def fake_executable(tmp_path: pathlib.Path) -> pathlib.Path:
    """An executable that starts the fake server, as `CBNB_LLAMA_SERVER` would point at a real binary."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_completion_request_is_greedy_token_ids_without_prompt_cache():
    body = llamacpp.completion_request([5, 6, 7], 32)
    assert body == {"prompt": [5, 6, 7], "n_predict": 32, "ignore_eos": True, "temperature": 0.0,
                    "cache_prompt": False, "return_tokens": True, "stream": False}
    assert llamacpp.completion_request([5], 1, stream=True)["stream"] is True
    with pytest.raises(ValueError, match="at least one token"):
        llamacpp.completion_request([], 4)
    with pytest.raises(ValueError, match="n_predict must be >= 1; got 0"):
        llamacpp.completion_request([1], 0)


def test_parse_completion_reads_tokens_and_refuses_errors():
    assert llamacpp.parse_completion({"content": "ab", "tokens": [3, 4], "stop": True}) == [3, 4]
    with pytest.raises(ValueError, match="answered an error"):
        llamacpp.parse_completion({"error": {"code": 400, "message": "context full"}})
    with pytest.raises(ValueError, match="no 'tokens' list"):
        llamacpp.parse_completion({"content": "ab"})


def test_parse_stream_yields_the_tokens_of_each_event():
    lines = [b"data: " + json.dumps({"tokens": [1], "stop": False}).encode() + b"\n", b"\n",
             b"data: " + json.dumps({"tokens": [2, 3], "stop": False}).encode() + b"\n", b": keep-alive\n",
             b"data: " + json.dumps({"tokens": [], "stop": True, "timings": {}}).encode() + b"\n",
             b"data: " + json.dumps({"tokens": [9]}).encode() + b"\n"]  # after stop: not read
    assert list(llamacpp.parse_stream(lines)) == [[1], [2, 3]]
    with pytest.raises(ValueError, match="answered an error"):
        list(llamacpp.parse_stream([b'data: {"error": {"message": "boom"}}\n']))


def test_context_size_gives_each_slot_the_longest_request_rounded_to_256():
    assert llamacpp.context_size([[1] * 250, [1] * 10], [32, 32], 2) == 2 * 512
    assert llamacpp.context_size([[1] * 200], [56], 32) == 32 * 256


def test_gguf_paths_and_the_missing_build_message(tmp_path, monkeypatch):
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CBNB_LLAMA_SERVER", raising=False)
    assert llamacpp.server_binary() == tmp_path / "llama.cpp" / "bin" / "llama-server"
    assert llamacpp.gguf_path("llama-cpp") == tmp_path / "llama.cpp" / "smollm2-135m-f32.gguf"
    with pytest.raises(ValueError, match="serve smollm2-135m only"):
        llamacpp.gguf_path("llama-cpp", "gemma3-270m")
    with pytest.raises(ValueError, match="peer must be one of"):
        llamacpp.gguf_path("llama", "smollm2-135m")
    why = llamacpp.missing("llama-cpp")
    assert "llama-server not found" in why and llamacpp.BUILD_COMMAND in why
    r = llamacpp.run_llamacpp("llama-cpp", SimpleNamespace(prompts=[[40, 41]], max_new_tokens=[2]), threads=1)
    assert r.error == why and r.output_tokens == 0
    exe = fake_executable(tmp_path)
    assert "smollm2-135m-f32.gguf not found" in llamacpp.missing("llama-cpp", binary=exe)
    (tmp_path / "llama.cpp").mkdir()
    (tmp_path / "llama.cpp" / "smollm2-135m-f32.gguf").write_bytes(b"GGUF")
    assert llamacpp.missing("llama-cpp", binary=exe) is None


def test_a_run_against_the_fake_server(tmp_path, monkeypatch):
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_file))
    wl = SimpleNamespace(prompts=[[40 + i] * (3 + i) for i in range(5)], max_new_tokens=[4, 5, 6, 7, 8])
    lone = [[50, 51, 52], [60]]
    r = llamacpp.run_llamacpp("llama-cpp", wl, threads=2, lone=lone, gguf=tmp_path / "m.gguf",
                              launcher=[sys.executable, str(FAKE)])
    assert r.error is None, r.error
    assert r.tokens == [answer(p, n) for p, n in zip(wl.prompts, wl.max_new_tokens)]
    assert r.output_tokens == sum(wl.max_new_tokens) and r.seconds > 0 and r.peak_bytes > 0
    n = llamacpp.LONE_NEW_TOKENS
    assert len(r.extra["lone_ttft_s"]) == 2 and len(r.extra["lone_itl_s"]) == 2 * (n - 1)
    assert all(x >= 0 for x in r.extra["lone_itl_s"])
    argv = json.loads(argv_file.read_text())
    assert argv == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-tb", "2", "-np", "5", "-c", str(5 * 256),
                    "--cont-batching", "--host", "127.0.0.1", "--port", argv[-1]]
    # the server was stopped: its port no longer answers
    with pytest.raises(OSError):
        llamacpp.LlamaServer.complete(SimpleNamespace(url=f"http://127.0.0.1:{argv[-1]}"), [1], 1, timeout_s=5)


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path):
    wl = SimpleNamespace(prompts=[[40]], max_new_tokens=[1])
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('error: unknown model format')\nsys.exit(3)\n")
    r = llamacpp.run_llamacpp("llama-cpp", wl, threads=1, gguf=tmp_path / "m.gguf", launcher=[sys.executable, str(bad)])
    assert "exited with code 3" in r.error and "unknown model format" in r.error and r.tokens == []


def test_a_server_crashing_at_start_is_restarted_without_repacking(tmp_path, monkeypatch):
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_file))
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "1")
    wl = SimpleNamespace(prompts=[[40, 41], [42]], max_new_tokens=[3, 2])
    r = llamacpp.run_llamacpp("llama-cpp-q4_1", wl, threads=1, gguf=tmp_path / "q.gguf",
                              launcher=[sys.executable, str(FAKE)])
    assert r.error is None, r.error
    assert r.tokens == [answer(p, n) for p, n in zip(wl.prompts, wl.max_new_tokens)]
    assert llamacpp.NO_REPACK in json.loads(argv_file.read_text()) and llamacpp.NO_REPACK in r.extra["argv"]
    assert r.extra["fallback"].startswith("--no-repack: without it llama-server exited with code -11")


def test_bench_with_llama_cpp_peers(tmp_path, monkeypatch, capsys):
    """`python -m cbnb.bench --peers cbnb,llama-cpp,llama-cpp-q4_1`: the built peer runs in the rounds (here the fake),
    a missing one reports the build command instead of failing the run."""
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CBNB_LLAMA_SERVER", str(fake_executable(tmp_path)))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real = llamacpp.gguf_path
    monkeypatch.setattr(llamacpp, "gguf_path", lambda peer, model="smollm2-135m": gguf if peer == "llama-cpp"
                        else real(peer, model))
    path = tmp_path / "bench.json"
    assert bench.main(["--model", "tiny:llama", "--scale", "0.1", "--repeat", "2", "--lone", "1", "--threads", "1",
                       "--peers", "cbnb,llama-cpp,llama-cpp-q4_1", "--no-probe", "--json", str(path)]) == 0
    out = capsys.readouterr()
    rep = json.loads(path.read_text())
    assert rep["peers"] == ["cbnb", "llama-cpp", "llama-cpp-q4_1"]
    s = rep["summary"]["llama-cpp"]
    assert s["tok_per_s"]["n"] == 2 and not s["errors"] and s["lone_ttft_s"]["n"] == 2
    assert s["lone_itl_s"]["n"] == 2 * (llamacpp.LONE_NEW_TOKENS - 1)
    for rnd in rep["rounds"]:
        res = rnd["results"]["llama-cpp"]
        assert res["output_tokens"] == rep["output_tokens"] and res["argv"][1:3] == ["-m", str(gguf)]
        # agreement with cbnb's greedy tokens is reported per round (the fake's tokens are not the model's)
        mine = rnd["results"]["cbnb"]["tokens"]
        assert res["greedy_agreement_vs_first"] == sum(a == b for a, b in zip(mine, res["tokens"])) / len(mine)
    assert rep["summary"]["cbnb"]["lone_itl_s"]["n"] == 2 * (llamacpp.LONE_NEW_TOKENS - 1)
    q4 = rep["summary"]["llama-cpp-q4_1"]
    assert q4["tok_per_s"]["n"] == 0 and all("serve smollm2-135m only" in e for e in q4["errors"])
    assert "llama-cpp" in out.out and "lone ITL ms" in out.out and "ran with" not in out.out
