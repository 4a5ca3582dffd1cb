"""`cbnb.runner.cpu.openmp`: a thread's idle OpenMP pool is released in the calling thread, and the engine does it for
the thread that submits (the slowdown it prevents is measured in the module docstring, never in a test)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info(),
    reason="libgomp thread pools (Linux, OpenMP torch)")

# Run in a fresh process: the test process's own threads (and pools made by other tests) would blur the counts.
_SCRIPT = textwrap.dedent("""
    import os, json
    import torch
    torch.set_num_threads(2)
    from cbnb.runner.cpu.openmp import release_caller_threads

    def threads():
        return len(os.listdir("/proc/self/task"))

    def main_op():  # big enough for torch to run it on 2 threads
        a = torch.ones(1 << 22)
        assert float((a + a).sum()) == 2.0 * (1 << 22)

    out = {"start": threads()}
    main_op(); out["after_op"] = threads()
    out["released"] = release_caller_threads(); out["after_release"] = threads()

    from transformers import LlamaConfig, LlamaForCausalLM
    import cbnb
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    eng = cbnb.Engine(model, config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    with eng:
        first = eng.submit(list(range(3, 40)), max_new_tokens=4, eos_token_id=-1).result(timeout=300)
        main_op(); out["engine_then_op"] = threads()
        second = eng.submit(list(range(3, 40)), max_new_tokens=4, eos_token_id=-1)
        out["after_submit"] = threads()
        out["same_tokens"] = second.result(timeout=300).token_ids == first.token_ids
    print(json.dumps(out))
""")


def test_release_frees_the_callers_pool_and_submit_does_it_for_the_caller():
    env = dict(os.environ, CBNB_OMP_RELEASE="1", OMP_NUM_THREADS="2")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    out = json.loads(p.stdout.strip().splitlines()[-1])
    pool = out["after_op"] - out["start"]
    assert pool >= 1, out  # the main thread's op made a pool worker
    assert out["released"] is True
    assert out["after_release"] == out["start"], out
    # with the engine running (its own pool stays), a main-thread op adds the pool back and submit removes it
    assert out["after_submit"] == out["engine_then_op"] - pool, out
    assert out["same_tokens"] is True


def test_release_can_be_turned_off(monkeypatch):
    from cbnb.runner.cpu import openmp

    monkeypatch.setenv("CBNB_OMP_RELEASE", "0")
    assert openmp.release_caller_threads() is False
