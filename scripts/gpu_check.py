#!/usr/bin/env python3
"""The device check of cbnb's GPU path: one prepared run (at most ``--deadline`` seconds, 540 by default) that writes
``gpu_check.json`` (results, rewritten after every part and while one runs) and ``gpu_check.log`` under ``--out``
(default ``$OUT``).

It runs these parts in this order, each in its own process with a hard time cap (killed at the cap; what it had
published by then is kept), and prints the plan with each part's cap first:

1. ``probe``: versions (torch, transformers, Triton), the GPU, the C compiler and ``Python.h`` (Triton builds its
   launcher at the first launch), a 1-element Triton kernel, the device-to-device copy bandwidth. When Triton cannot
   launch, the rest of the run uses the PyTorch reference attention (``CBNB_ATTENTION=torch``) and says so.
2. ``headline_cbnb``: the headline: cbnb on nanovllm-256 (``shape:qwen3-0.6b``, bf16, graphs + async) at
   ``--hf-scale`` (default 0.25) for the side-by-side, then at ``--scale`` (default 1.0) for the tok/s target: output
   tok/s, peak memory against the sizing's estimate, graph captures / replays / failed captures, per-step GPU time
   against the bandwidth floor.
3. ``headline_hf``: transformers' continuous batching on the same ``--hf-scale`` workload and config (a partial
   figure when it reaches its cap); the speedup and greedy agreement are computed here.
4. ``sync_debug``: sampled and greedy requests, with per-request logits processors and logprobs, graphs + async,
   under ``torch.cuda.set_sync_debug_mode("error")``
   (``CBNB_SYNC_DEBUG``): any host synchronisation while a step is queued fails that step and is reported.
5. ``kernels``: every Triton kernel case against its PyTorch reference (each case guarded), decode timings at the
   nanovllm-256 decode shapes against the bandwidth floor, prefill TFLOP/s.
6. ``fp32_tiny``: fp32 tiny models through the engine (graphs, async, chunking) vs per-request ``generate``: the share
   of token-identical requests (target 100 %).
7. ``bf16_agreement``: bf16 ``shape:qwen3-0.6b`` and tiny models vs per-request bf16 ``generate``: the distribution of
   the first index where the tokens differ (random-init logits have tiny top-1/top-2 gaps: a metric, not a verdict).
8. ``variants``: the rest of the graphs x async matrix at ``--scale``, while time is left.

``--cpu-smoke`` runs every part's code path on CPU (tiny shapes, Triton's interpreter, the CUDA runner with fake
graphs; each part a fork of one process that imported torch once) in under a minute; CI runs it
(``tests/runner/test_gpu_check.py``). Run from the repository root with the machine's python3 (no virtualenv; no
gguf/ipywidgets needed)::

    scripts/gpu_check.sh            # = python3 scripts/gpu_check.py --out "${OUT:-gpu_check_out}"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
T_START = float(os.environ.get("GPU_CHECK_T0") or time.time())
TARGET_TOK_S = 30000  # nanovllm-256 on an H200 (design.md, section 5)

#: (part, hard cap in seconds (None: whatever is left), what it does)
UNITS: list[tuple[str, float | None, str]] = [
    ("probe", 30, "versions, GPU, gcc / Python.h, a 1-element Triton kernel, copy bandwidth"),
    ("headline_cbnb", 120, "cbnb, nanovllm-256 (qwen3-0.6b bf16, graphs + async) at --hf-scale and --scale"),
    ("headline_hf", 120, "transformers' continuous batching, nanovllm-256 at --hf-scale, same config"),
    ("sync_debug", 40, "sampled + greedy requests, graphs + async, set_sync_debug_mode('error')"),
    ("kernels", 80, "Triton kernels vs references (each case guarded); decode vs bandwidth floor; prefill"),
    ("fp32_tiny", 60, "fp32 tiny models through the engine vs per-request generate (identical share)"),
    ("bf16_agreement", 45, "bf16 vs per-request bf16 generate: first-divergence distribution"),
    ("variants", None, "graphs x async matrix at --scale, while time is left"),
]
MIN_START_S = 8.0  # a part is skipped when less than this is left
GRACE_S = 3.0  # after SIGTERM at the cap, SIGKILL

RESULTS: dict[str, Any] = {"sections": {}}
_LOG_PATH: str | None = None


def log(*parts: Any) -> None:
    """Print one line with the seconds since the run started, and append it to gpu_check.log."""
    line = f"[{time.time() - T_START:7.1f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    path = _LOG_PATH or (os.path.join(os.environ["GPU_CHECK_OUT"], "gpu_check.log")
                         if os.environ.get("GPU_CHECK_OUT") else None)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def write_json(path: str, data: Any) -> None:
    """Write `data` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def plan(deadline: float, wanted: set[str]) -> list[tuple[str, float | None, str, float]]:
    """The parts that will run, each with its cap and the latest time it ends (caps only ever shrink)."""
    out, t = [], 0.0
    for name, cap, what in UNITS:
        if name not in wanted:
            continue
        c = max(0.0, deadline - t) if cap is None else min(cap, max(0.0, deadline - t))
        t += c
        out.append((name, c, what, t))
    return out


def print_plan(rows: list[tuple[str, float | None, str, float]], deadline: float) -> None:
    log(f"plan: {len(rows)} parts inside {deadline:.0f} s; each part runs in its own process with a hard cap, and "
        "gpu_check.json is rewritten after each part and while one runs")
    caps = dict((u[0], u[1]) for u in UNITS)
    for i, (name, cap, what, end) in enumerate(rows, 1):
        more = " + what the parts before leave" if caps[name] is None else ""
        log(f"  {i}. {name:<15} <= {cap:5.0f} s{more} (ends by {end:5.0f} s)  {what}")


def part_path(out: str, name: str) -> str:
    return os.path.join(out, "parts", f"{name}.json")


def save(out: str) -> None:
    RESULTS["elapsed_s"] = round(time.time() - T_START, 1)
    RESULTS["summary"] = summary()
    write_json(os.path.join(out, "gpu_check.json"), RESULTS)


def run_part(name: str, cap: float, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Run one part (`scripts/gpu_check_units.py`) under `supervise`: a fresh interpreter on the GPU machine, a
    fork of this process in the CPU smoke run (`ForkedPart`)."""
    argv = [name, "--out", args.out, "--cap", f"{cap:.1f}", "--scale", str(args.scale),
            "--hf-scale", str(args.hf_scale)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    if args.cpu_smoke:
        return supervise(name, lambda: ForkedPart(argv, env), cap, args.out)
    return supervise(name, [sys.executable, os.path.join(HERE, "gpu_check_units.py")] + argv, cap, args.out, env)


class ForkedPart:
    """A part run in a fork of this process, which imported torch, transformers and cbnb once (`preload`): on
    2 CPU cores a fresh interpreter spends ~4 s importing them, for each of the 8 parts. CPU only: CUDA does not
    survive a fork, so the GPU run starts every part fresh. Has what `supervise` and `_stop` use of
    `subprocess.Popen`: its own process group, ``pid``, ``returncode`` (negative: killed by that signal) and
    ``wait(timeout)`` (raises `subprocess.TimeoutExpired`)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.argv, self.returncode = argv, None
        self.pid = os.fork()
        if self.pid == 0:  # the part
            code = 1
            try:
                os.setpgid(0, 0)
                os.environ.clear()
                os.environ.update(env)
                import gpu_check_units

                code = gpu_check_units.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(self.pid, self.pid)  # also here: a stop right after the fork must find the group
        except OSError:
            pass  # the child did it first (or has already exited)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.argv, timeout)
            time.sleep(0.02)
        return self.returncode


def preload(env: dict[str, str]) -> None:
    """The CPU smoke run: take the parts' environment (set before torch / Triton read it), then import what every
    part imports, once, for `ForkedPart`. Imports only: no thread (OpenMP's pool starts at the first op) and no
    engine exists before a fork."""
    os.environ.update(env)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import cbnb  # noqa: F401
    import cbnb.engine.models  # noqa: F401
    import gpu_check_units  # noqa: F401


def supervise(name: str, cmd: list[str] | Any, cap: float, out: str, env: dict[str, str] | None = None
              ) -> dict[str, Any]:
    """Run `cmd` in its own process group, stopped (SIGTERM, then SIGKILL) once `cap` seconds have passed, so it
    cannot block beyond that; meanwhile mirror what it publishes to ``parts/<name>.json`` into gpu_check.json.
    `cmd`: an argv, or a callable that starts the process and returns it (`ForkedPart`).
    Returns that file's content with seconds, cap_s, rc, timed_out and ok."""
    path = part_path(out, name)
    if os.path.exists(path):
        os.remove(path)
    t0 = time.time()
    proc = cmd() if callable(cmd) else subprocess.Popen(cmd, env=env, start_new_session=True)
    timed_out = False
    last_mtime = 0.0
    while True:
        try:
            proc.wait(timeout=max(0.05, min(1.0, t0 + cap - time.time())))
            break
        except subprocess.TimeoutExpired:
            pass
        if time.time() - t0 >= cap:
            timed_out = True
            log(f"!! {name}: hard cap of {cap:.0f} s reached: stopping it (its published results are kept)")
            _stop(proc)
            break
        m = os.path.getmtime(path) if os.path.exists(path) else 0.0
        if m != last_mtime:  # mirror a running part's partial results into gpu_check.json
            last_mtime = m
            RESULTS["sections"][name] = {"running": True, **read_json(path)}
            save(out)
    part = read_json(path)
    entry = {"seconds": round(time.time() - t0, 1), "cap_s": round(cap, 1), "rc": proc.returncode,
             "timed_out": timed_out, **part}
    entry["ok"] = bool(part.get("ok")) and proc.returncode == 0 and not timed_out
    if not part:
        entry["error"] = entry.get("error") or f"the part published nothing (exit code {proc.returncode})"
    return entry


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def side_by_side(out: str) -> dict[str, Any]:
    """cbnb vs hf-cb on the same workload, from the two headline parts (speedup, greedy agreement)."""
    sec = RESULTS["sections"]
    cb = ((sec.get("headline_cbnb") or {}).get("runs") or {}).get("side_by_side") or {}
    hf = (sec.get("headline_hf") or {}).get("hf_cb") or {}
    res: dict[str, Any] = {"scale": cb.get("scale"), "cbnb_tok_per_s": cb.get("tok_per_s"),
                           "hf_cb_tok_per_s": hf.get("tok_per_s"), "hf_cb_error": hf.get("error")}
    if cb.get("tok_per_s") and hf.get("tok_per_s"):
        res["speedup"] = round(cb["tok_per_s"] / hf["tok_per_s"], 2)
    a = read_json(os.path.join(out, "parts", "tokens_cbnb_side_by_side.json")).get("tokens")
    b = read_json(os.path.join(out, "parts", "tokens_hf_cb.json")).get("tokens")
    if a and b and len(a) == len(b):
        both = [(x, y) for x, y in zip(a, b) if x and y]
        res["greedy_identical_share"] = round(sum(x == y for x, y in both) / len(both), 3) if both else None
        res["compared_requests"] = len(both)
    return res


def summary() -> dict[str, Any]:
    """Headline figures (None where a part did not run)."""
    sec = RESULTS["sections"]
    probe = sec.get("probe") or {}
    head = ((sec.get("headline_cbnb") or {}).get("runs") or {}).get("full") or {}
    out: dict[str, Any] = {
        "device": probe.get("device"), "attention": probe.get("attention"), "fallback": probe.get("fallback"),
        "target_tok_per_s": TARGET_TOK_S, "cbnb_tok_per_s": head.get("tok_per_s"),
        "workload_scale": head.get("scale"), "cbnb_error": head.get("error"),
        "peak_allocated_gib": round(head["peak_allocated_bytes"] / 2**30, 2) if head.get("peak_allocated_bytes")
        else None,
        "peak_over_sizing_estimate": head.get("peak_over_estimate"),
        "graph_captures_replays_failures": head.get("graph_counts"),
        "decode_floor_over_gpu": ((head.get("per_step") or {}).get("all_decode") or {}).get("floor_over_gpu"),
        "side_by_side": RESULTS.get("side_by_side"),
        "sync_debug": {k: (sec.get("sync_debug") or {}).get(k) for k in ("ok", "mode", "errors")},
        "kernels_ok": (sec.get("kernels") or {}).get("all_ok"),
        "fp32_tiny_all_identical": (sec.get("fp32_tiny") or {}).get("all_identical"),
        "bf16_first_divergence_p50": {k: (v.get("first_divergence") or {}).get("p50")
                                      for k, v in ((sec.get("bf16_agreement") or {}).get("models") or {}).items()},
        "variants_tok_per_s": {k: v.get("tok_per_s")
                               for k, v in ((sec.get("variants") or {}).get("variants") or {}).items()},
        "parts": {k: ("timed out" if v.get("timed_out") else "ok" if v.get("ok") else
                      "skipped" if v.get("skipped") else "failed") for k, v in sec.items()},
    }
    tok = out["cbnb_tok_per_s"]
    out["target_met"] = None if tok is None else tok >= TARGET_TOK_S
    return out


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GPU_CHECK_T0=repr(T_START), GPU_CHECK_OUT=args.out, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.cpu_smoke:
        env.setdefault("TRITON_INTERPRET", "1")
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny shapes: threads only contend with the rest of the machine
        env["CBNB_CUDA_RUNNER"] = "fake"
    return env


def main(argv: list[str] | None = None) -> int:
    global _LOG_PATH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--scale", type=float, default=1.0, help="nanovllm-256 scale of the cbnb headline and variants")
    ap.add_argument("--hf-scale", type=float, default=0.25, help="scale of the cbnb vs hf-cb side-by-side runs")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run (parts are capped)")
    ap.add_argument("--sections", default=",".join(u[0] for u in UNITS), help="parts to run (probe always runs)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every part's code path on CPU: tiny shapes, Triton interpreter, fake graphs")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.scale = min(args.scale, 0.03)
        args.hf_scale = min(args.hf_scale, 0.03)
    wanted = {s.strip() for s in args.sections.split(",") if s.strip()} | {"probe"}
    unknown = wanted - {u[0] for u in UNITS}
    if unknown:
        ap.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(u[0] for u in UNITS)}")
    if args.no_hf:
        wanted.discard("headline_hf")
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    _LOG_PATH = os.path.join(args.out, "gpu_check.log")
    open(_LOG_PATH, "w").close()
    RESULTS["args"] = vars(args)
    env = child_env(args)
    if args.cpu_smoke:
        preload(env)
    rows = plan(args.deadline, wanted)
    RESULTS["plan"] = [{"part": n, "cap_s": c, "ends_by_s": e, "what": w} for n, c, w, e in rows]
    print_plan(rows, args.deadline)
    save(args.out)
    for name, _, _, _ in rows:
        left = args.deadline - (time.time() - T_START)
        cap_def = dict((u[0], u[1]) for u in UNITS)[name]
        room = left - 2 * GRACE_S - 1.0  # what a part stopped at its cap may still take
        cap = room if cap_def is None else min(cap_def, room)
        if cap < MIN_START_S:
            RESULTS["sections"][name] = {"skipped": f"{left:.0f} s left: a part needs {MIN_START_S:.0f} s, plus "
                                                    f"{2 * GRACE_S + 1:.0f} s to stop it at its cap"}
            log(f"== {name}: SKIPPED ({left:.0f} s left)")
            save(args.out)
            continue
        log(f"== {name} (cap {cap:.0f} s)")
        env_part = dict(env, CBNB_SYNC_DEBUG="error") if name == "sync_debug" else env
        RESULTS["sections"][name] = entry = run_part(name, cap, args, env_part)
        if not entry["ok"]:
            log(f"!! {name}: {entry.get('error') or ('timed out' if entry['timed_out'] else 'failed')}")
        if name == "probe" and entry.get("attention") == "torch" and not args.cpu_smoke:
            env["CBNB_ATTENTION"] = "torch"
            log("!! " + (entry.get("fallback") or "Triton cannot launch: the PyTorch reference attention is used"))
        if name in ("headline_cbnb", "headline_hf"):
            RESULTS["side_by_side"] = side_by_side(args.out)
        save(args.out)
    log("summary", json.dumps(RESULTS["summary"], default=str))
    log("done; results in", os.path.join(args.out, "gpu_check.json"))
    save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
