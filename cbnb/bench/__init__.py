"""`python -m cbnb.bench`: cbnb against its peers on one workload, in one process, in interleaved rounds.

Peers on the same workload and the same `ContinuousBatchingConfig` values: ``cbnb`` (this engine), ``hf-cb``
(transformers' continuous batching) and ``hf-static`` (static batched `generate`); see `cbnb.bench.peers`. Also
``llama-cpp`` and ``llama-cpp-q4_1``: llama.cpp's ``llama-server`` with continuous batching over one slot per request,
on the F32 GGUF of the same weights and on the shipped Q4_1 file (`cbnb.bench.llamacpp`; build it once with
``scripts/build_llamacpp.sh``).

``--repeat N`` runs N rounds, rotating the peers' order each round, and reports per peer the median and min-max of
its output tokens/s and the median of the per-round ratios (`cbnb.bench.rounds`). Each round first probes the
machine: the GEMM rate of the model's own linear layers at the workload's token counts and the copy bandwidth; from
those the workload's roofline floor (FLOPs and bytes, formulas printed) and each peer's share of it
(`cbnb.bench.roofline`). Also: peak memory, greedy token agreement with the first peer, and a lone streamed request's
first-token latency and inter-token gaps (cbnb and llama.cpp). ``--json PATH`` keeps everything (rewritten after every round). Speed claims come from
here, never from a timed test. Examples::

    python -m cbnb.bench --workload cpu-32 --repeat 5 --json cpu32.json
    python -m cbnb.bench --workload cpu-32 --peers cbnb,llama-cpp,llama-cpp-q4_1,hf-cb --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants telemetry=off,telemetry=on --repeat 3
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants cpu_kernels=off,cpu_kernels=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants onednn_linear=off,onednn_linear=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants packed_linear=off,packed_linear=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants mkl_gemv=off,mkl_gemv=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants cpu_layers=off,cpu_layers=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants cpu_prefill=off,cpu_prefill=on --repeat 5
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants sampled=off,sampled=on --repeat 3
    python -m cbnb.bench --workload cpu-32 --peers cbnb --variants json_schema=off,json_schema=on --repeat 3
    python -m cbnb.bench --workload nanovllm-256 --model shape:qwen3-0.6b --peers cbnb,hf-cb
"""

from __future__ import annotations

import argparse
import os
import sys

from .peers import PEERS, PeerResult, agreement, guard, run_cbnb, run_hf_cb, run_hf_static
from .report import format_report
from .run import run_bench

__all__ = ["main", "run_bench", "parse_args", "build_parser", "PeerResult", "PEERS", "run_cbnb", "run_hf_cb",
           "run_hf_static", "agreement", "format_report"]

_guard = guard  # the name scripts/gpu_check.py uses


def build_parser() -> argparse.ArgumentParser:
    from ..lab.workloads import WORKLOADS

    ap = argparse.ArgumentParser(prog="python -m cbnb.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="cpu-32", choices=WORKLOADS)
    ap.add_argument("--model", default=None, help="model name for cbnb.load_model (default: the workload's)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--peers", default="cbnb,hf-cb,hf-static", help="comma list of " + ", ".join(PEERS))
    ap.add_argument("--variants", default="", help="cbnb variants, e.g. telemetry=off,telemetry=on")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; the peers' order rotates each round")
    ap.add_argument("--no-probe", dest="no_probe", action="store_true",
                    help="skip the per-round GEMM/bandwidth probe (no roofline share)")
    ap.add_argument("--lone", type=int, default=3, help="lone streamed requests timed per round on cbnb and llama.cpp (0: none)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workload (0 < scale <= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--static-batch", type=int, default=0, help="hf-static batch size (default: all requests)")
    ap.add_argument("--page-size", dest="page_size", type=int)
    ap.add_argument("--num-blocks", dest="num_blocks", type=int)
    ap.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int)
    ap.add_argument("--max-requests-per-batch", dest="max_requests_per_batch", type=int)
    ap.add_argument("--scheduler-type", dest="scheduler_type")
    ap.add_argument("--safety-margin", dest="safety_margin", type=float)
    ap.add_argument("--cpu-offload-space", dest="cpu_offload_space", type=float)
    ap.add_argument("--no-sharing", action="store_true", help="allow_block_sharing=False")
    ap.add_argument("--default-compile-level", dest="default_compile_level", type=int, choices=range(4),
                    help="transformers' compile level for cbnb and hf-cb (0: eager)")
    ap.add_argument("--json", default=None, help="also write the full report (every round) to this file")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments before any model is loaded (errors exit with argparse's usage message)."""
    ap = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if not 0 < args.scale <= 1:
        ap.error(f"--scale must be in (0, 1]; got {args.scale}")
    bad = [p for p in (x.strip() for x in args.peers.split(",")) if p and p not in PEERS]
    if bad:
        ap.error(f"--peers: unknown {', '.join(map(repr, bad))}; choose from {', '.join(PEERS)}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1; got {args.repeat}")
    if args.lone < 0:
        ap.error(f"--lone must be >= 0; got {args.lone}")
    args.argv = raw
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_bench(args)
    print(format_report(report))
    return 0
