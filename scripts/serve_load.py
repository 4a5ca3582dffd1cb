"""A load run against cbnb's OpenAI-compatible server: what the client measured next to cbnb's own stats.

    .venv/bin/python scripts/serve_load.py --model smollm2-135m --workload cpu-32 --rate 1.5
    .venv/bin/python scripts/serve_load.py --guidellm /path/to/guidellm --rate 1 --requests 16

Starts an engine (the workload's config hints) and `engine.serve()` in this process, then runs the client in a separate
process: cbnb's own load generator (`python -m cbnb.server.loadgen`, Poisson arrivals, streamed completions), or
GuideLLM (`--guidellm`: its CLI, given the local tokenizer folder, no model hub; constant rate, synthetic prompts).
Prints one JSON object: {"client": ..., "engine": engine.stats()["run"] for the same run, "server": counters}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import cbnb
from cbnb.engine.models import model_cache_dir
from cbnb.lab.workloads import get_workload


def _engine_side(stats: dict) -> dict:
    keep = ("span_s", "requests_finished", "requests_failed", "requests_cancelled", "output_tokens_per_s",
            "ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s", "mean_kv_usage_blocks_frac",
            "mean_kv_usage_tokens_frac", "prefix_hit_tokens")
    out = {k: stats[k] for k in keep}
    out["requests_per_s"] = stats["requests_finished"] / stats["span_s"] if stats["span_s"] else None
    return out


def _guidellm(exe: str, url: str, model: str, tokenizer_dir: str, rate: float, n: int, prompt_tokens: int,
              output_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "guidellm.json"
        cmd = [exe, "run",
               "--backend", f"kind=openai_http,target={url.removesuffix('/v1')},model={model},"
                            "request_format=/v1/completions",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
               "--profile", f"kind=constant,rate={rate}",
               "--constraint", f"kind=max_requests,count={n}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
               "--output", f"kind=json,path={path}", "--disable-console-interactive"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-3000:])
        res.check_returncode()
        return {"command": " ".join(cmd), "report": json.loads(path.read_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default="cpu-32")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--guidellm", default=None, help="path of the guidellm executable: use it as the client")
    p.add_argument("--requests", type=int, default=16, help="GuideLLM: requests to send")
    p.add_argument("--prompt-tokens", type=int, default=128, help="GuideLLM: synthetic prompt length")
    p.add_argument("--output-tokens", type=int, default=32, help="GuideLLM: tokens to generate")
    a = p.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    w = get_workload(a.workload, scale=a.scale)
    model, tok = cbnb.load_model(a.model, dtype="float32", device="cpu")
    engine = cbnb.Engine(model, tokenizer=tok, config=cbnb.ContinuousBatchingConfig(**w.config_hints))
    with engine:
        engine.generate([w.prompts[0]], max_new_tokens=4)  # warm-up, not measured
        server = engine.serve(port=0, model_name=a.model)
        engine.reset_stats()
        if a.guidellm:
            client = _guidellm(a.guidellm, server.url, a.model, str(model_cache_dir() / a.model), a.rate,
                               a.requests, a.prompt_tokens, a.output_tokens)
        else:
            cmd = [sys.executable, "-m", "cbnb.server.loadgen", "--url", server.url, "--workload", a.workload,
                   "--scale", str(a.scale), "--rate", str(a.rate)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
            client = json.loads(res.stdout)
        out = {"command": " ".join(sys.argv), "client": client, "engine": _engine_side(engine.stats()["run"]),
               "server": server.counters(),
               "config": engine.user_config.to_code()}
        server.stop()
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
