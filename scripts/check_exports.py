#!/usr/bin/env python
"""Run every exporter's commands through the real parser of the release it targets; write the result as data.

    python scripts/check_exports.py                       # vLLM (downloads its wheel) and transformers (installed)
    python scripts/check_exports.py --vllm path/to/vllm-0.33.0-...whl --model-dir ~/.cache/cbnb/smollm2-135m

Run it when a release changes (with scripts/refresh_export_flags.py); commit cbnb/export/data/checked-exports.json,
which `tests/lab/test_export.py` compares with what the exporters emit today (a changed exporter fails that test
until the check is run again).

- vLLM (``vllm serve``): the wheel is unpacked (``pip download --no-deps``; its compiled parts are left out) with
  the few pure-Python packages its config classes import (`VLLM_DEPS`, ``pip install --no-deps --target`` into a
  temporary folder: nothing is installed into this environment), and a child process does what ``vllm serve`` does
  with the flags before it touches a GPU: ``EngineArgs.add_cli_args`` builds the parser, ``EngineArgs.from_cli_args``
  reads the flags, ``create_engine_config()`` builds and validates every config class (model, cache, scheduler,
  parallel). It runs on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``: there is no GPU here) with a local model
  folder (its config.json and tokenizer; default the converted smollm2-135m in ~/.cache/cbnb). What it cannot
  check: the start-up checks that need the device (the cache's bytes against free memory; ``--max-model-len``
  against the cache) and the attention backend's block sizes.
- transformers (``transformers serve``): the installed release's own parser (typer's command, strict: an unknown
  option is an error), nothing started.
- SGLang: its wheel needs CUDA-only packages to import its argument classes; its flags are checked against the list
  scripts/refresh_export_flags.py reads from the wheel's source (no run here).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "cbnb" / "export" / "data" / "checked-exports.json"

#: Pure-Python packages vLLM's argument and config classes import that this environment lacks (found by importing
#: ``vllm.engine.arg_utils`` and building a config; torch, transformers, pydantic and the rest come from here).
VLLM_DEPS = ["cbor2", "openai-harmony", "msgspec", "pillow", "pybase64", "cachetools", "uvloop", "py-cpuinfo",
             "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions", "partial-json-parser",
             "xgrammar", "apache-tvm-ffi", "einops", "fastapi"]

#: The model the checks serve (its shape gives the cache's bytes; its folder is the child's --model).
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def configs() -> list[tuple[str, object]]:
    """The configs whose exports are checked: the defaults, a tuned one, one with a cache smaller than the model's
    context, and one with every non-default option the exporters map."""
    from cbnb.core.config import ContinuousBatchingConfig as C

    return [
        ("defaults", C()),
        ("tuned", C(page_size=16, num_blocks=512, max_batch_tokens=256, max_requests_per_batch=64, seed=7,
                    use_cuda_graph=False, use_async_batching=True, max_queue_size=100, safety_margin=0.2)),
        ("short cache", C(page_size=32, num_blocks=64, max_batch_tokens=512)),
        ("no sharing, prefill_first", C(allow_block_sharing=False, scheduler_type="prefill_first", seed=1,
                                        use_cuda_graph=(False, False), safety_margin=0.3, max_requests_per_batch=8,
                                        num_blocks=1024, use_async_batching=False)),
    ]


def exports() -> dict[str, list[dict]]:
    """Per target, the command of each config (the exporters as they are now)."""
    import warnings

    from cbnb.export import to_transformers_serve, to_vllm

    out: dict[str, list[dict]] = {"vllm": [], "transformers-serve": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short cache's warning is expected
        for name, cfg in configs():
            for target, fn in (("vllm", to_vllm), ("transformers-serve", to_transformers_serve)):
                ex = fn(cfg, model=MODEL)
                out[target].append({"config": name, "flags": ex.flags, "command": ex.command})
    return out


# ------------------------------------------------------------------------------------------------ vLLM
_CHILD = r'''
import json, sys, warnings
warnings.simplefilter("ignore")
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
model, cases = sys.argv[1], json.loads(sys.stdin.read())
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
out = []
for case in cases:
    r = {"config": case["config"]}
    try:
        ns = parser.parse_args(["--model", model, *case["flags"]])
        cfg = EngineArgs.from_cli_args(ns).create_engine_config()
        c, s, m = cfg.cache_config, cfg.scheduler_config, cfg.model_config
        r.update(ok=True, read_back={
            "block_size": c.block_size, "kv_cache_memory_bytes": c.kv_cache_memory_bytes,
            "num_gpu_blocks_override": c.num_gpu_blocks_override, "enable_prefix_caching": c.enable_prefix_caching,
            "max_model_len": m.max_model_len, "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens, "policy": str(s.policy),
            "watermark": getattr(s, "watermark", None), "seed": m.seed, "enforce_eager": m.enforce_eager})
    except BaseException as e:  # argparse exits on a bad flag
        r.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    out.append(r)
print("RESULT " + json.dumps(out))
'''


def vllm_check(wheel: str, model_dir: str, cases: list[dict]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        p = pathlib.Path(wheel)
        if not (p.suffix == ".whl" and p.exists()):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                            wheel], check=True, stdout=sys.stderr)
            p = sorted(t.glob("vllm-*.whl"))[-1]
        src = t / "src"
        with zipfile.ZipFile(p) as zf:
            zf.extractall(src, [n for n in zf.namelist() if not n.endswith(".so")])
        deps = t / "deps"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps),
                        *VLLM_DEPS], check=True, stdout=sys.stderr)
        env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{deps}", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run([sys.executable, "-c", _CHILD, model_dir], input=json.dumps(cases), env=env,
                              capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"the vLLM check did not run:\n{proc.stderr[-3000:]}")
        return {"wheel": p.name, "results": json.loads(line[len("RESULT "):])}


# ------------------------------------------------------------------------------------------------ transformers
def transformers_check(cases: list[dict]) -> dict:
    import transformers
    import typer
    from transformers.cli.serve import Serve
    from typer.main import get_command

    app = typer.Typer()
    app.command()(Serve)
    cmd = get_command(app)
    results = []
    for case in cases:
        try:
            ctx = cmd.make_context("serve", [MODEL, *case["flags"]])
            results.append({"config": case["config"], "ok": True, "read_back": {
                k: v for k, v in ctx.params.items() if k.startswith("cb_") or k in (
                    "continuous_batching", "default_seed", "max_model_len")}})
        except Exception as e:
            results.append({"config": case["config"], "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
    return {"version": transformers.__version__, "results": results}


def main(argv: list[str] | None = None) -> int:
    from cbnb.export import vllm as vllm_mod

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default=f"vllm=={vllm_mod.VERSION}", help="wheel path or requirement")
    ap.add_argument("--model-dir", default=str(pathlib.Path.home() / ".cache" / "cbnb" / "smollm2-135m"),
                    help="a local folder with the served model's config.json and tokenizer (default: %(default)s)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    ex = exports()
    data = {"generated_by": "scripts/check_exports.py", "model": MODEL, "exports": ex,
            "vllm": vllm_check(a.vllm, a.model_dir, ex["vllm"]),
            "transformers-serve": transformers_check(ex["transformers-serve"]),
            "sglang": "not run: checked against the flag list of its wheel (scripts/refresh_export_flags.py)"}
    pathlib.Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    for target in ("vllm", "transformers-serve"):
        for r in data[target]["results"]:
            print(f"{target:<19} {r['config']:<28} {'ok' if r['ok'] else 'FAILED: ' + r['error']}")
    print(f"wrote {a.out}")
    return 0 if all(r["ok"] for t in ("vllm", "transformers-serve") for r in data[t]["results"]) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
