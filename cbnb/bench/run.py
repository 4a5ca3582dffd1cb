"""`run_bench`: load the model once, run the peers in rotated rounds with a machine probe per round, summarize."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any, Callable

from . import roofline
from .peers import (PEERS, PeerResult, guard, lone_prompts, release_memory, run_cbnb, run_hf_cb, run_hf_static,
                    run_variant)
from .rounds import Entry, Round, run_rounds, spread, summarize

__all__ = ["run_bench", "config_from", "probe_rows", "machine_name"]


def config_from(hints: dict[str, Any], args: argparse.Namespace):
    """The workload's `ContinuousBatchingConfig` hints overridden by the command-line fields that are set."""
    from ..core.config import ContinuousBatchingConfig

    kw = dict(hints)
    for name in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
                 "safety_margin", "cpu_offload_space", "default_compile_level"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "no_sharing", False):
        kw["allow_block_sharing"] = False
    return ContinuousBatchingConfig(**kw)


def probe_rows(config, device_type: str, num_requests: int, prompt_tokens: int) -> tuple[int, int]:
    """(prefill rows, decode rows) the GEMM probe uses: a full chunk, and every request decoding together."""
    r = config.resolve(device_type)
    mbt = int(r.max_batch_tokens)
    return max(1, min(mbt, prompt_tokens)), max(1, min(num_requests, int(r.max_requests_per_batch), mbt))


def machine_name() -> str:
    """CPU model and core count (plus the GPU name when there is one): the machine a figure was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            name += f", {torch.cuda.get_device_name()}"
    except Exception:  # the name is informative only
        pass
    return name


def _entries(peers: list[str], variants: list[str], model, tokenizer, wl, config, static_batch: int,
             lone: list[list[int]] | None, model_name: str = "smollm2-135m") -> list[Entry]:
    from . import llamacpp

    out: list[Entry] = []
    for peer in peers:
        if peer == "cbnb":
            if variants:
                for v in variants:
                    out.append(Entry(f"cbnb[{v}]", lambda v=v: run_variant(model, tokenizer, wl, config, v)))
            else:
                out.append(Entry("cbnb", lambda: run_cbnb(model, tokenizer, wl, config, lone=lone)))
        elif peer == "hf-cb":
            out.append(Entry("hf-cb", lambda: guard("hf-cb", lambda: run_hf_cb(model, wl, config))))
        elif peer == "hf-static":
            out.append(Entry("hf-static", lambda: guard("hf-static", lambda: run_hf_static(model, wl, static_batch))))
        elif peer in llamacpp.PEERS:
            import torch

            threads = torch.get_num_threads()
            out.append(Entry(peer, lambda peer=peer: llamacpp.run_llamacpp(peer, wl, threads=threads, model=model_name,
                                                                        lone=lone)))
        else:
            raise SystemExit(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
    return out


def _result_dict(r: PeerResult, base: PeerResult | None) -> dict[str, Any]:
    from .peers import agreement

    d: dict[str, Any] = {
        "seconds": r.seconds, "output_tokens": r.output_tokens, "output_tok_per_s": r.tok_per_s,
        "peak_bytes": r.peak_bytes, "error": r.error,
        "greedy_agreement_vs_first": agreement(base, r) if base is not None else None,
        "tokens": r.tokens,
    }
    keep = ("stats", "batch_size", "variant", "lone_ttft_s", "lone_itl_s", "compile", "grammar", "gguf", "argv",
            "fallback")
    d.update({k: v for k, v in r.extra.items() if k in keep})
    return d


def _round_dict(rnd: Round, names: list[str], floor_s: float | None) -> dict[str, Any]:
    base = rnd.results.get(names[0])
    return {"index": rnd.index, "order": rnd.order, "machine": rnd.machine, "floor_s": floor_s,
            "results": {n: _result_dict(r, base) for n, r in rnd.results.items()}}


def sample_ms(r: Any) -> float | None:
    """Milliseconds per step a cbnb run spent sampling (logits processors, warpers, the draw, the report): its
    `stats()["run"]["time_by_phase_s"]["sample"]` over its steps; None for other peers."""
    run = ((r.extra or {}).get("stats") or {}).get("run") or {}
    steps = run.get("steps")
    sample = (run.get("time_by_phase_s") or {}).get("sample")
    return 1000 * sample / steps if steps and sample is not None else None


def run_bench(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the peers named in `args.peers` (plus cbnb variants) for `args.repeat` rounds; return a JSON-able report.

    The machine is probed at the start of each round and before every peer's run; the floor uses the best rates.

    The report holds the run's metadata (date, machine, threads, config), the roofline (formulas, work, per-round
    machine probes and floors), every round's results (order, seconds, tokens, agreement) and the summary per peer
    (see `cbnb.bench.rounds.summarize`). With `args.json` set, the report is also rewritten after every round.
    """
    import torch

    from ..engine.models import load_model
    from ..lab.workloads import get_workload

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    wl0 = get_workload(args.workload, scale=args.scale, seed=args.seed)
    model_name = args.model or wl0.model
    dtype = args.dtype or (wl0.dtype if not torch.cuda.is_available() and wl0.dtype == "float32" else None)
    model, tokenizer = load_model(model_name, dtype=dtype, device=args.device)
    vocab = model.get_input_embeddings().num_embeddings
    wl = get_workload(args.workload, vocab_size=vocab, scale=args.scale, seed=args.seed)
    config = config_from(wl.config_hints, args)
    device = next(model.parameters()).device
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    variants = [v for v in (args.variants or "").split(",") if v]
    n_lone = getattr(args, "lone", 3)
    lone = lone_prompts(wl, vocab, count=n_lone, seed=args.seed) if n_lone else None
    entries = _entries(peers, variants, model, tokenizer, wl, config, args.static_batch or wl.num_requests, lone,
                       model_name)
    from . import llamacpp

    for p in peers:
        why = llamacpp.missing(p, model_name) if p in llamacpp.PEERS else None
        if why:
            log(f"{p}: {why}; its rounds will report that as their error")
    names = [e.name for e in entries]

    cost = roofline.model_cost(model)
    work = roofline.workload_work(cost, wl.prompts, wl.max_new_tokens)
    pre_rows, dec_rows = probe_rows(config, device.type, wl.num_requests, wl.prompt_tokens)
    probe = None if getattr(args, "no_probe", False) else (lambda: roofline.probe(model, pre_rows, dec_rows))

    report: dict[str, Any] = {
        "command": "python -m cbnb.bench " + " ".join(getattr(args, "argv", None) or []),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_name(), "workload": wl.name, "model": model_name,
        "dtype": str(next(model.parameters()).dtype), "device": str(device), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "requests": wl.num_requests, "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens, "repeat": args.repeat, "config": config.transformers_dict(),
        "roofline": {
            "formulas": roofline.FORMULAS, "work": roofline.work_dict(work),
            "model": {"body_params": cost.body_params, "lm_head": list(cost.head), "weight_bytes": cost.weight_bytes,
                      "kv_bytes_per_token": cost.kv_bytes_per_token},
            "prefill_rows": pre_rows, "decode_rows": dec_rows,
        },
        "rounds": [],
    }
    def on_round(rnd: Round) -> None:
        m = rnd.machine
        f = None
        if m:  # this round's own floor: informative (machine state); the shares use the run's best rates
            fl = roofline.floor(work, m["prefill_flops_per_s"], m["decode_flops_per_s"], m["copy_bytes_per_s"])
            m.update(fl)
            f = fl["floor_s"]
        report["rounds"].append(_round_dict(rnd, names, f))
        parts = [f"{n} {rnd.results[n].tok_per_s:.1f}" for n in rnd.order]
        gemm = f"; GEMM prefill {m['prefill_flops_per_s'] / 1e9:.0f} GFLOP/s" if m else ""
        log(f"round {rnd.index + 1}/{args.repeat}: " + ", ".join(parts) + " out tok/s" + gemm)
        if args.json:
            _write(args.json, report)

    extra_probes: list[dict[str, Any]] = []

    def between() -> None:
        release_memory()
        if probe is not None:  # more probes, more chances to catch the machine quiet (the best rates set the floor)
            extra_probes.append(probe())

    rounds = run_rounds(entries, args.repeat, probe=probe, between=between, on_round=on_round)
    machines = [r.machine for r in rounds if r.machine]
    report["roofline"]["probes"] = len(machines) + len(extra_probes)
    report["roofline"]["between_probes"] = extra_probes  # the probes taken before each peer's run
    floors: list[float | None] = [None] * len(rounds)
    if machines:
        best = {k: max(m[k] for m in machines + extra_probes) for k in ("prefill_flops_per_s", "decode_flops_per_s",
                                                                        "copy_bytes_per_s")}
        fl = roofline.floor(work, best["prefill_flops_per_s"], best["decode_flops_per_s"], best["copy_bytes_per_s"])
        report["roofline"]["best_rates"] = best
        report["roofline"].update(fl)
        floors = [fl["floor_s"]] * len(rounds)
    summary = summarize(rounds, names, floors)
    for n in names:
        ttfts = [x for rnd in rounds for x in rnd.results[n].extra.get("lone_ttft_s", [])]
        summary[n]["lone_ttft_s"] = spread(ttfts)
        summary[n]["lone_itl_s"] = spread([x for rnd in rounds for x in rnd.results[n].extra.get("lone_itl_s", [])])
        summary[n]["sample_ms_per_step"] = spread([x for x in (sample_ms(rnd.results[n]) for rnd in rounds)
                                                   if x is not None])
        summary[n]["peak_bytes_max"] = max(rnd.results[n].peak_bytes for rnd in rounds)
        comp = [rnd.results[n].extra.get("compile") for rnd in rounds if rnd.results[n].extra.get("compile")]
        if comp:
            summary[n]["compile"] = comp[-1]  # one compiled forward per process: the last round has the totals
    report["summary"] = summary
    report["peers"] = names
    if machines:
        report["machine_state"] = {k: spread([m[k] for m in machines]) for k in machines[0]
                                   if isinstance(machines[0][k], (int, float))}
    if args.json:
        _write(args.json, report)
    return report


def _write(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)
