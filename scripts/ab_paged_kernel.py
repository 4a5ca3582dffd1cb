"""A/B of the CPU paged-attention kernel (`cbnb/runner/cpu/paged_decode.c`) against its source at a git revision,
end to end on a workload, in one process: the same model and engine config, the two builds alternating round by
round (the order flips each round), so both see the same machine. Prints each round's output tok/s, the median of
the per-round ratios with their range, and whether the greedy tokens agree.

    .venv/bin/python scripts/ab_paged_kernel.py --rev HEAD~1 --workload cpu-32 --rounds 5

Uses `cbnb.runner.cpu.cpu_kernels` internals (`build_library`, the bound library): a developer's tool, not an API.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision whose paged_decode.c is the baseline")
    ap.add_argument("--workload", default="cpu-32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from cbnb.core.config import ContinuousBatchingConfig
    from cbnb.engine.engine import Engine
    from cbnb.engine.models import load_model
    from cbnb.lab.workloads import get_workload
    from cbnb.runner.cpu import cpu_kernels as ck

    src_dir = ROOT / "cbnb" / "runner" / "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "paged_decode.c"
        base.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:cbnb/runner/cpu/paged_decode.c"],
                                       check=True, capture_output=True, text=True).stdout)
        for h in src_dir.glob("*.h"):  # the headers it includes, as they are now
            shutil.copy(h, tmp)
        libs = {args.rev: ck._Paged(ck.build_library(base)), "working tree": ck._PAGED.get()}
    if libs["working tree"] is None:
        print(f"the kernel is unavailable: {ck.build_error()}")
        return 1
    wl_name = args.workload
    model, tok = load_model(get_workload(wl_name).model, dtype="float32", device="cpu")
    wl = get_workload(wl_name, vocab_size=model.get_input_embeddings().num_embeddings)
    out_tokens = sum(wl.max_new_tokens)
    rates: dict[str, list[float]] = {k: [] for k in libs}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for name in (list(libs) if r % 2 == 0 else list(reversed(libs))):
            ck._PAGED.bound = libs[name]
            with Engine(model, tokenizer=tok, config=ContinuousBatchingConfig(**wl.config_hints)) as eng:
                t0 = time.perf_counter()
                hs = [eng.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(wl.prompts, wl.max_new_tokens)]
                outs = [h.result() for h in hs]
                rates[name].append(out_tokens / (time.perf_counter() - t0))
            tokens[name] = [list(o.token_ids) for o in outs]
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " out tok/s", flush=True)
    a, b = list(libs)
    ratios = [y / x for x, y in zip(rates[a], rates[b])]
    print(f"median out tok/s: {a} {statistics.median(rates[a]):.1f}, working tree {statistics.median(rates[b]):.1f}; "
          f"working tree / {a}: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print("same greedy tokens:", tokens[a] == tokens[b])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
