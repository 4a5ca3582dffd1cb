"""Data for the panels' tests, shared by tests/ui_state/ (Python side) and tests/ui/ (the browser): a synthetic KV
snapshot and a run log with a sweep."""

from __future__ import annotations

import numpy as np

from cbnb.core.cache.snapshot import BlockState, GroupSnapshot, KVSnapshot
from cbnb.core.config import ContinuousBatchingConfig as C
from cbnb.telemetry.runs import RunLog


def synthetic_snapshot(n_blocks: int, n_requests: int = 500, seed: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    state = rng.choice([BlockState.FREE, BlockState.ALLOCATED, BlockState.SHARED, BlockState.CACHED],
                       size=n_blocks, p=[0.4, 0.4, 0.1, 0.1]).astype(np.uint8)
    state[:2] = BlockState.RESERVED
    refcount = np.where(state == BlockState.ALLOCATED, 1, 0).astype(np.int32)
    shared = np.flatnonzero(state == BlockState.SHARED)
    refcount[shared] = rng.integers(2, 40, size=len(shared))
    owner = np.where(np.isin(state, [BlockState.ALLOCATED, BlockState.SHARED]),
                     rng.integers(0, n_requests, size=n_blocks), -1).astype(np.int32)
    tokens = np.where(state == BlockState.FREE, 0, rng.integers(1, 17, size=n_blocks)).astype(np.int32)
    shared_owners = {int(b): [int(owner[b]), (int(owner[b]) + 1) % n_requests] for b in shared[:50]}
    g = GroupSnapshot(0, "full_attention", 16, 30, 1, state, refcount, owner, tokens, (0, 1), shared_owners)
    return KVSnapshot([g], [f"req-{i}" for i in range(n_requests)], n_blocks - 2, 1 << 20)


WL = {"name": "cpu-poisson", "arrivals": {"kind": "poisson", "rate": 1.2}}


def make_log() -> RunLog:
    base = C(page_size=32, num_blocks=64)
    log = RunLog(base=base)
    for rep in range(3):
        for ps, good in ((16, 1.0), (32, 1.2), (64, 0.8)):
            log.add("run", config=base.copy(page_size=ps), workload=WL, sweep="s1", repeat=rep,
                    metrics={"goodput_requests_per_s": good + 0.1 * rep, "ttft_s_p99": 2.0 - good,
                             "soft_resets": rep})
    log.add("run", engine="hf-cb", config=base, workload=WL, metrics={"goodput_requests_per_s": 0.5})
    return log
