"""Property tests: random workloads driven through the real `EngineCore` with a fake runner.

The fake runner is a *content oracle*: every forward "writes" a value for each computed position into a dict keyed by
(group, slot) through `CacheManager.write_slots`, and before writing it reads back, through the request's block
table, every cached position the step must attend to (full attention: all past positions, table[p // P] * P + p % P;
sliding: the last window - 1, ring slot p % window). The value of position p is (p, digest of tokens[0..p]), so a
block holding another prefix's K/V, a stale block, a lost swap copy or a wrongly shared block is caught. Swap-outs
and restores copy the dict entries along the pairs the core returns; blocks nobody references (and that are not
cached for their content) are poisoned (their entries deleted) after every step.

After every step the harness checks, independently of `CacheManager.check_invariants` (which it also calls): block
ownership and refcounts, free + used + cached + unassigned + reserved = total per group, reserved blocks never
handed out, all-or-nothing admission (a refused `allocate` changes nothing, compared against a snapshot), block
tables covering exactly the computed tokens, the safety margin (below it, at most the first scheduled entry is not a
decode), the last active request never offloaded, and at the end that every submitted request reached a terminal
state with the tokens the fake runner produced (progress survives offloads and soft resets), failing only when it
could not fit an empty cache or its forward was made to fail.

Half the examples run in async mode (step N + 1 planned before step N's tokens are applied, as with async batching);
the others in sync mode. Setups and workloads are drawn by hypothesis (derandomized, no shrinking: a failure prints
the setup and workload seed, which replay exactly).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cbnb.core.cache.allocators import SlidingAttentionCacheAllocator
from cbnb.core.cache.layout import KVLayout, layer_groups
from cbnb.core.cache.manager import CacheManager, Shortfall
from cbnb.core.cache.prefix import block_hash
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.engine_core import EngineCore
from cbnb.core.plan import QueueTail
from cbnb.core.requests import Request, RequestState, SamplingParams

EOS = 1
VOCAB = 40
STEPS = {"n": 0}  # total engine steps run by this module (reported by the last test)

# A few shared prompt prefixes (so that prefix hits and dedupe happen).
_PREFIX_RNG = random.Random(1234)
PREFIXES = [[_PREFIX_RNG.randrange(2, VOCAB) for _ in range(96)] for _ in range(3)]


# ---------------------------------------------------------------------------------------------------- setup
@dataclass
class Setup:
    family: str
    page_size: int
    n_full: int
    n_sliding: int
    window: int | None
    capacity: int  # device cache size target, in tokens of the first group
    sharing: bool
    eviction: str
    swap_sectors: int
    scheduler: str
    safety_margin: float | None
    max_batch_tokens: int
    max_requests: int
    eos_pct: int

    def build(self):
        n = self.n_full + self.n_sliding
        if self.family == "sliding":
            groups = layer_groups(n, None, self.window)
        elif self.family == "hybrid":
            # Interleave so that group order depends on the first layer's type.
            types = ["sliding_attention"] * self.n_sliding + ["full_attention"] * self.n_full
            order_rng = random.Random(n * 7 + self.n_full)
            order_rng.shuffle(types)
            groups = layer_groups(n, types, self.window)
        else:
            groups = layer_groups(n)
        layout = KVLayout(tuple(groups), 1, 16, 4, self.page_size)
        tokens_per_sector = layout.blocks_per_sector(0) * self.page_size
        num_sectors = max(1, math.ceil(self.capacity / tokens_per_sector))
        if self.family == "hybrid":
            # Room for the windows of about three requests on top of the full-attention capacity.
            sliding = 1 if groups[0].attention_type == "full_attention" else 0
            ring_blocks = math.ceil(self.window / self.page_size)
            num_sectors += math.ceil(3 * ring_blocks / layout.blocks_per_sector(sliding))
        cfg = ContinuousBatchingConfig(
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_requests,
            scheduler_type=self.scheduler,
            safety_margin=self.safety_margin,
            allow_block_sharing=self.sharing,
            prefix_eviction=self.eviction,
        ).resolve("cpu")
        cm = CacheManager(layout, num_sectors, allow_block_sharing=self.sharing,
                          prefix_eviction=self.eviction, swap_sectors=self.swap_sectors)
        return cfg, cm


def setups(family: str, schedulers: tuple[str, ...] = ("fifo", "prefill_first")):
    page = st.sampled_from([4, 8, 16]) if family != "large_page" else st.sampled_from([32, 64])
    fam = "full" if family in ("full", "full_noshare", "large_page") else family
    n_full = st.integers(1, 3) if fam in ("full", "hybrid") else st.just(0)
    n_sliding = st.integers(1, 3) if fam in ("hybrid", "sliding") else st.just(0)
    window = st.sampled_from([7, 3, 12, 24, 5]) if fam in ("hybrid", "sliding") else st.none()
    sharing = st.just(False) if family == "full_noshare" else st.just(True)
    return st.builds(
        Setup,
        family=st.just(fam),
        page_size=page,
        n_full=n_full,
        n_sliding=n_sliding,
        window=window,
        capacity=st.sampled_from([24, 16, 48, 32, 96, 64, 160, 400]),
        sharing=sharing,
        eviction=st.sampled_from(["transformers", "lru"]),
        swap_sectors=st.sampled_from([2, 0, 16, 1, 0]),
        scheduler=st.sampled_from(list(schedulers)),
        safety_margin=st.sampled_from([None, 0.0, None, 0.3, 0.6]),
        max_batch_tokens=st.sampled_from([8, 3, 64, 16, 1]),
        max_requests=st.sampled_from([64, 4, 2, 1]),
        eos_pct=st.sampled_from([5, 0, 20]),
    )


def gen_ops(seed: int, n_requests: int, prompt_scale: float, max_new: int, step_p: float) -> list[tuple]:
    """A random workload: bursts of submissions interleaved with steps, cancels and failed forwards.

    Prompt sizes are fractions of the cache (`Sim.submit` scales them); `step_p` is the chance of stepping after a
    submission (low: bursts that fill the cache and force offloads).
    """
    rng = random.Random(seed)
    ops: list[tuple] = []
    for _ in range(n_requests):
        big = rng.random() < 0.03
        if ops and rng.random() < 0.15:
            # The same prompt again: whole-prompt prefix hits and dedupe of blocks computed side by side.
            ops.append(("dup", rng.randrange(64), rng.randint(1, max_new)))
            continue
        ops.append(("submit", rng.randrange(4), rng.random(), rng.random() * prompt_scale + (2.0 if big else 0.0),
                    rng.randint(1, max_new)))
        r = rng.random()
        if r < step_p:
            ops.append(("step", rng.randint(1, 6)))
        elif r < step_p + 0.06:
            ops.append(("cancel", rng.randrange(64)))
        elif r < step_p + 0.10:
            ops.append(("cancel_mid", rng.randrange(64)))
        elif r < step_p + 0.12:
            ops.append(("fail", 0))
    return ops


WORKLOAD = st.tuples(
    st.integers(0, 2**32 - 1),  # seed
    st.integers(8, 24),  # requests
    st.sampled_from([0.3, 0.1, 0.6]),  # prompt scale (fraction of the cache)
    st.sampled_from([40, 16, 4, 64]),  # max_new_tokens upper bound
    st.sampled_from([0.2, 0.6]),  # chance of stepping after each submission
)


# ---------------------------------------------------------------------------------------------------- oracle
SALT = 0  # varies the fake runner's tokens (for soak runs); CI uses 0


def fake_token(rid: str, pos: int, eos_pct: int) -> int:
    # zlib.crc32, not hash(): str hashes are salted per process and runs must replay exactly.
    h = zlib.crc32(f"{SALT}:{rid}:{pos}".encode())
    if eos_pct and h % 100 < eos_pct:
        return EOS
    return 2 + (h >> 8) % (VOCAB - 2)


def snapshot(cm: CacheManager):
    def alloc_state(a):
        return (
            {k: list(v) for k, v in a.tables.items()},
            list(a.refcount),
            sorted(a._free),
            dict(a._sector_free),
        )

    s = [sorted(cm.pool._free), list(cm.pool.owner), [alloc_state(a) for a in cm.allocators], dict(cm._hashed)]
    if cm.prefix is not None:
        s.append((dict(cm.prefix.block_of), list(cm.prefix.cached)))
    if cm.swap is not None:
        s.append((sorted(cm.swap.pool._free), list(cm.swap.pool.owner), [alloc_state(a) for a in cm.swap.allocators]))
    return s


class Sim:
    def __init__(self, setup: Setup, async_mode: bool = False) -> None:
        self.setup = setup
        self.async_mode = async_mode
        self.prev = None  # the step in flight (async mode)
        self.cfg, self.cm = setup.build()
        self.P = setup.page_size
        self.terminal: dict[str, Request] = {}
        self.fail_tokens: dict[str, int] = {}
        self.core = EngineCore(self.cfg, self.cm, on_terminal=self._on_terminal)
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.host: dict[tuple[int, int], tuple[int, int]] = {}
        self.digests: dict[str, list[int]] = {}
        self.submitted: dict[str, Request] = {}
        self.cancelled: set[str] = set()
        self.injected: set[str] = set()
        self.rng = random.Random(zlib.crc32(repr(setup).encode()) + SALT)
        self.n = 0
        self.steps = 0
        self.n_offloads = 0
        self.n_hits = 0
        self.n_defrag = 0
        self.n_preempted = 0
        self.refused = 0
        orig_allocate = self.cm.allocate

        def allocate(req, total, match=None):
            before = snapshot(self.cm)
            out = orig_allocate(req, total, match)
            if isinstance(out, Shortfall):
                self.refused += 1
                assert snapshot(self.cm) == before, "a refused allocate changed the cache state"
            return out

        self.cm.allocate = allocate  # type: ignore[method-assign]
        self.n_dedup = 0
        orig_register = self.cm.register_completed

        def register_completed(req, end):
            out = orig_register(req, end)
            self.n_dedup += len(out)
            return out

        self.cm.register_completed = register_completed  # type: ignore[method-assign]

    # ------------------------------------------------------------------------------------------ helpers
    def _on_terminal(self, req: Request) -> None:
        self.terminal[req.request_id] = req
        if req.state == RequestState.FAILED or req.finish_reason == "cache_exhausted":
            self.fail_tokens[req.request_id] = req.num_tokens

    def value(self, req: Request, pos: int) -> tuple[int, int]:
        d = self.digests.setdefault(req.request_id, [])
        toks = req.all_known_ids()
        while len(d) <= pos:
            i = len(d)
            d.append(hash((d[-1] if d else 0, toks[i])))
        return (pos, d[pos])

    def read_slot(self, g: int, rid: str, pos: int) -> int:
        a = self.cm.allocators[g]
        table = a.tables[rid]
        if isinstance(a, SlidingAttentionCacheAllocator):
            r = pos % a.window
            return table[r // self.P] * self.P + r % self.P
        return table[pos // self.P] * self.P + pos % self.P

    def readable(self, g: int, upto: int) -> range:
        a = self.cm.allocators[g]
        if isinstance(a, SlidingAttentionCacheAllocator):
            return range(max(0, upto - (a.window - 1)), upto)
        return range(0, upto)

    def check_reads(self, req: Request, upto: int, when: str) -> None:
        for g in range(len(self.cm.allocators)):
            for pos in self.readable(g, upto):
                slot = self.read_slot(g, req.request_id, pos)
                got = self.kv.get((g, slot))
                want = self.value(req, pos)
                assert got == want, (
                    f"{when}: {req.request_id} group {g} position {pos} slot {slot}: read {got}, expected {want}"
                )

    # ------------------------------------------------------------------------------------------ ops
    def submit(self, prefix: int, prefix_frac: float, tail_frac: float, max_new: int) -> None:
        """Submit a prompt sized relative to the cache: a shared prefix (up to 60 % of the cache) and an own tail."""
        rid = f"r{self.n}"
        self.n += 1
        cap = self.setup.capacity
        base = PREFIXES[prefix] if prefix < len(PREFIXES) else []
        plen = int(prefix_frac * min(len(base), 0.6 * cap))
        tail = int(tail_frac * cap)
        prompt = base[:plen] + [self.rng.randrange(2, VOCAB) for _ in range(tail)]
        if not prompt:
            prompt = [5]
        req = Request(rid, prompt, SamplingParams(max_new_tokens=max_new, eos_token_ids=EOS))
        self.submitted[rid] = req
        ok = self.core.add(req)
        if not ok:
            assert req.state == RequestState.FAILED
            assert not self.cm.fits_empty(len(prompt))
        else:
            assert self.cm.fits_empty(len(prompt))

    def dup(self, idx: int, max_new: int) -> None:
        if not self.submitted:
            return
        prompt = list(self.submitted[f"r{idx % self.n}"].prompt_ids)
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, prompt, SamplingParams(max_new_tokens=max_new, eos_token_ids=EOS))
        self.submitted[rid] = req
        assert self.core.add(req) == self.cm.fits_empty(len(prompt))

    def cancel(self, idx: int) -> None:
        if not self.submitted:
            return
        rid = f"r{idx % self.n}"
        r = self.core.cancel(rid)
        if r is not None:
            self.cancelled.add(rid)
            assert r.state == RequestState.CANCELLED
            for a in self.cm.allocators:
                assert rid not in a.tables
            if self.cm.swap is not None:
                assert not self.cm.swap.holds(rid)

    def step(self, fail: bool = False, cancel_mid: int | None = None) -> None:
        core, cm = self.core, self.cm
        active_before = len(core.scheduler.active)
        self.admitted_now = set(core.scheduler.waiting)
        free_before = independent_free_fraction(cm)
        in_flight = ({x.request_id for x in self.prev.plan.scheduled if x.samples and not x.request.is_terminal}
                     if self.prev is not None else set())
        work = core.schedule()
        self.steps += 1
        STEPS["n"] += 1
        plan = work.plan
        # ---- plan checks
        if not work.offloads:
            assert abs(plan.free_fraction - free_before) < 1e-9
        vllm = self.setup.scheduler == "vllm"
        if plan.free_fraction < plan.safety_margin and not vllm:  # (vLLM's policy reads it as its watermark)
            assert all(s.phase == "decode" for s in plan.scheduled[1:]), "prefill admitted below the safety margin"
        if vllm:
            # max_num_seqs caps the running requests; a step that preempted admits nobody (strict vLLM order).
            assert len(core.scheduler.active) <= self.cfg.max_requests_per_batch
            if plan.preempted:
                assert all(s.request.request_id in core.scheduler.active and s.request_id not in self.admitted_now
                           for s in plan.scheduled)
            self.n_preempted += len(plan.preempted)
        if work.offloads:
            self.n_offloads += len(work.offloads)
            if work.offloads[0].reason.startswith("defragment"):
                # The one exception: a lone request stalled by sector fragmentation that fits an empty cache.
                d, = work.offloads
                assert active_before == 1 and len(cm.allocators) > 1
                assert cm.fits_empty(d.request.num_tokens)
                self.n_defrag += 1
            else:
                # Never the last active request: someone that was not offloaded stays active and runs. (It may have
                # been admitted in this very plan: as in transformers, a waiting request that fits is admitted even
                # when an active one stalled, and the stalled one may then be the victim.)
                assert active_before >= 1
                assert core.scheduler.active, "the last active request was offloaded"
                victims = {d.request.request_id for d in work.offloads}
                assert not victims & set(core.scheduler.active)
        assert plan.num_tokens <= self.cfg.max_batch_tokens
        assert len(plan.scheduled) <= self.cfg.max_requests_per_batch
        ids = [s.request_id for s in plan.scheduled]
        assert len(ids) == len(set(ids))
        live = set(core.requests)
        listed = set(ids)
        for sk in plan.skipped:
            listed.update(sk.request_ids)
        # every live request is either scheduled or listed with a reason (requests offloaded this step re-listed
        # only on the next plan).
        offloaded = {d.request.request_id for d in work.offloads}
        assert live - offloaded <= listed | {s.request_id for s in plan.stalled}, (live - listed)
        for st_ in plan.stalled:
            assert st_.request_id not in {s.request_id for s in plan.scheduled}
        for s in plan.scheduled:
            req = s.request
            assert req.num_computed == s.end
            assert s.num_tokens >= 1
            if s.phase == "decode":
                assert s.num_tokens == 1 and len(req.output_ids) + req.pending_samples - 1 > 0
            if s.prefix_hit_tokens:
                self.n_hits += 1
                assert self.cm.sharing
                assert s.start == s.prefix_hit_tokens and s.start % self.P == 0
            if s.samples:
                # the sampled token's position (with async batching, the previous step's sample is in flight)
                assert s.end == len(req.prompt_ids) + len(req.output_ids) + req.pending_samples - 1
        for d in work.offloads:
            assert d.request.request_id not in in_flight, "a request with an in-flight step was offloaded"
        # ---- fake runner: swap-outs, restores, then the forward (read before write)
        for req, so in work.swap_outs:
            for g, pairs in enumerate(so.pairs):
                for dev, hst in pairs:
                    for o in range(self.P):
                        v = self.kv.get((g, dev * self.P + o))
                        if v is None:
                            self.host.pop((g, hst * self.P + o), None)
                        else:
                            self.host[(g, hst * self.P + o)] = v
        for req, restored in work.restores:
            for g, pairs in enumerate(restored):
                for hst, dev in pairs:
                    for o in range(self.P):
                        v = self.host.get((g, hst * self.P + o))
                        if v is None:
                            self.kv.pop((g, dev * self.P + o), None)
                        else:
                            self.kv[(g, dev * self.P + o)] = v
        if self.async_mode:
            # Async batching: step N+1 was planned before step N's tokens are applied.
            prev, self.prev = self.prev, work
            if prev is not None:
                self.finish(prev, fail)
            self.cancel_mid(work, cancel_mid)
            self.forward(work)
        else:
            self.cancel_mid(work, cancel_mid)
            self.forward(work)
            self.finish(work, fail)
        self.after_step()

    def cancel_mid(self, work, cancel_mid: int | None) -> None:
        plan = work.plan
        if cancel_mid is not None and plan.scheduled:
            victim = plan.scheduled[cancel_mid % len(plan.scheduled)].request_id
            if self.core.cancel(victim) is not None:
                self.cancelled.add(victim)

    def forward(self, work) -> None:
        """The fake forward: read back every position the step attends to, then write the chunk's K/V."""
        cm, plan = self.cm, work.plan
        writes = []
        for s in plan.scheduled:
            req = s.request
            if req.is_terminal:
                continue
            self.check_reads(req, s.start, f"step {work.step_id} before forward")
            slots = cm.write_slots(req, s.start, s.end)
            for g, gs in enumerate(slots):
                a = cm.allocators[g]
                assert len(gs) == s.num_tokens
                for pos, slot in zip(range(s.start, s.end), gs):
                    if slot == -1:
                        assert isinstance(a, SlidingAttentionCacheAllocator) and pos < s.end - a.window
                        continue
                    b = slot // self.P
                    assert b >= cm.pool.num_reserved * a.blocks_per_sector, "write into a reserved block"
                    assert a.refcount[b] == 1, f"write into block {b} with refcount {a.refcount[b]}"
                    if cm.prefix is not None:
                        assert not cm.prefix.is_hashed(b), f"write into hashed block {b}"
                    writes.append(((g, slot), self.value(req, pos)))
        for key, v in writes:
            self.kv[key] = v

    def finish(self, work, fail: bool) -> None:
        core, plan = self.core, work.plan
        if fail and plan.scheduled:
            failed = core.fail_batch(work, RuntimeError("injected"))
            self.injected.update(r.request_id for r in failed)
            for r in failed:
                assert r.state == RequestState.FAILED and "injected" in r.error
        else:
            toks = {s.request_id: fake_token(s.request_id, s.end, self.setup.eos_pct)
                    for s in plan.scheduled if s.samples}
            core.apply(work, toks)

    def flush(self) -> None:
        if self.prev is not None:
            prev, self.prev = self.prev, None
            self.finish(prev, False)
            self.after_step()

    # ------------------------------------------------------------------------------------------ checks
    def after_step(self) -> None:
        core, cm = self.core, self.cm
        live = list(core.requests.values())
        cm.check_invariants(live)
        check_blocks(cm, live)
        in_flight = {x.request_id for x in self.prev.plan.scheduled if x.samples} if self.prev else set()
        for req in live:
            assert not req.is_terminal
            assert req.pending_samples == (1 if req.request_id in in_flight else 0)
            if req.swapped:
                assert req.state == RequestState.PENDING
                continue
            if req.num_computed:
                self.check_reads(req, req.num_computed, "after step")
        # poison blocks nobody references and that are not cached
        for g, a in enumerate(cm.allocators):
            keep = set()
            for t in a.tables.values():
                keep.update(t)
            if a.prefix is not None:
                keep.update(a.prefix.cached)
            for key in [k for k in self.kv if k[0] == g and k[1] // self.P not in keep]:
                del self.kv[key]
        if cm.swap is not None:
            for g, a in enumerate(cm.swap.allocators):
                keep = set()
                for t in a.tables.values():
                    keep.update(t)
                for key in [k for k in self.host if k[0] == g and k[1] // self.P not in keep]:
                    del self.host[key]
            for req in live:
                if cm.swap.holds(req.request_id):
                    # swapped out, or restored this step (its host copy is freed at the next scheduling pass)
                    assert req.swapped or req.request_id in cm._host_release

    def drain(self) -> None:
        """Step until idle; fail on a livelock (no token generated and no request ended for too long)."""
        core = self.core
        since_progress = 0
        while core.has_work or self.prev is not None:
            if not core.has_work:
                self.flush()
                break
            before = (len(self.terminal), sum(len(r.output_ids) for r in core.requests.values()))
            self.step()
            after = (len(self.terminal), sum(len(r.output_ids) for r in core.requests.values()))
            since_progress = 0 if after != before else since_progress + 1
            # The longest legitimate stretch without a new token: recomputing the longest request one token a step,
            # a few times over (soft resets).
            longest = max((r.num_tokens for r in core.requests.values()), default=0)
            assert since_progress <= 4 * longest + 50, (
                f"livelock: {since_progress} steps without progress: {list(core.requests.values())}"
            )
        cm = self.cm
        for rid, req in self.submitted.items():
            assert req.is_terminal, rid
            assert self.terminal.get(rid) is req, f"{rid} ended without the terminal callback"
            if req.state == RequestState.CANCELLED:
                assert rid in self.cancelled
            elif req.state == RequestState.FAILED:
                if rid not in self.injected:
                    assert not cm.fits_empty(self.fail_tokens[rid]), (
                        f"{rid} FAILED although {self.fail_tokens[rid]} tokens fit an empty cache: {req.error}"
                    )
            else:
                assert req.state == RequestState.FINISHED
                assert rid not in self.cancelled
            # progress survives offloads and soft resets: every generated token is the runner's token
            L = len(req.prompt_ids)
            for k, t in enumerate(req.output_ids):
                assert t == fake_token(rid, L + k, self.setup.eos_pct), f"{rid} token {k} wrong"
            if req.state == RequestState.FINISHED:
                if req.finish_reason == "eos":
                    assert req.output_ids[-1] == EOS and EOS not in req.output_ids[:-1]
                elif req.finish_reason == "cache_exhausted":
                    # only a request warned at admission, ended when its tokens no longer fit an empty cache
                    assert req.warning is not None
                    assert not cm.fits_empty(len(req.prompt_ids) + req.max_new_tokens)
                    assert not cm.fits_empty(self.fail_tokens[rid]) and len(req.output_ids) < req.max_new_tokens
                else:
                    assert req.finish_reason == "length"
                    assert len(req.output_ids) == req.max_new_tokens and EOS not in req.output_ids
        # idle cache: nothing referenced, all blocks free or cached, the host pool empty
        for a in cm.allocators:
            assert not a.tables
            assert all(c == 0 for c in a.refcount)
        if cm.swap is not None:
            assert all(not a.tables for a in cm.swap.allocators)
        assert not self.kv or cm.prefix is not None

    def run(self, ops) -> None:
        for op in ops:
            kind = op[0]
            if kind == "submit":
                self.submit(*op[1:])
            elif kind == "step":
                for _ in range(op[1]):
                    self.step()
            elif kind == "dup":
                self.dup(*op[1:])
            elif kind == "cancel":
                self.cancel(op[1])
            elif kind == "cancel_mid":
                self.step(cancel_mid=op[1])
            elif kind == "fail":
                self.step(fail=True)
        self.drain()
        self.flush()


def independent_free_fraction(cm: CacheManager) -> float:
    """Free bytes (unassigned sectors + free and cached blocks in owned sectors) / usable bytes."""
    L = cm.layout
    free = cm.pool.num_free * L.bytes_per_sector
    for a in cm.allocators:
        n = len(a._free) + (len(a.prefix.cached) if a.prefix is not None else 0)
        free += n * L.bytes_per_block(a.index)
    return free / (cm.pool.num_sectors * L.bytes_per_sector)


def check_blocks(cm: CacheManager, live: list[Request]) -> None:
    """Ownership, refcounts, the block partition and table coverage, computed from scratch."""
    pool = cm.pool
    assert sorted(pool._free) == sorted(set(pool._free))
    for s in range(pool.num_reserved):
        assert pool.owner[s] == -2 and s not in pool._free
    live_ids = {r.request_id for r in live}
    for a in cm.allocators:
        bps = a.blocks_per_sector
        owners: dict[int, list[str]] = {}
        for rid, t in a.tables.items():
            assert rid in live_ids, f"table of a dead request {rid}"
            for b in t:
                owners.setdefault(b, []).append(rid)
        cached = set(a.prefix.cached) if a.prefix is not None else set()
        free = set(a._free)
        for b, who in owners.items():
            assert len(set(who)) == len(who), f"block {b} twice in one table"
            assert a.refcount[b] == len(who)
            if len(who) > 1:
                assert cm.sharing
            assert b // bps >= pool.num_reserved
        used = set(owners)
        assert not (used & free) and not (used & cached) and not (free & cached)
        owned_sectors = {s for s in range(pool.total_sectors) if pool.owner[s] == a.index}
        for b in used | free | cached:
            assert b // bps in owned_sectors
        reserved = pool.num_reserved * bps
        unassigned = sum(bps for s in range(pool.total_sectors) if pool.owner[s] == -1)
        other = sum(bps for s in range(pool.total_sectors) if pool.owner[s] >= 0 and pool.owner[s] != a.index)
        assert len(used) + len(free) + len(cached) + unassigned + other + reserved == a.total_blocks
        assert len(used) + len(free) + len(cached) == len(owned_sectors) * bps
        if cm.prefix is not None:
            for b in cached:
                assert cm.prefix.is_hashed(b) and a.refcount[b] == 0
            for b in free:
                assert not cm.prefix.is_hashed(b), f"free block {b} is still indexed"
            # Every indexed block a request references holds that request's prefix: its hash is the chain hash of
            # the request's tokens up to the end of that block (computed here independently).
            for r in live:
                t = a.tables.get(r.request_id, [])
                toks = r.all_known_ids()
                parent = None
                for i, b in enumerate(t):
                    if (i + 1) * a.page_size > min(r.num_computed, len(toks)):
                        break
                    parent = block_hash(parent, toks[i * a.page_size:(i + 1) * a.page_size])
                    h = cm.prefix.hash_of.get(b)
                    assert h is None or h == parent, f"{r.request_id} block {i} ({b}) indexed under another prefix"
        for r in live:
            t = a.tables.get(r.request_id, [])
            if r.swapped:
                assert not t
                continue
            P = a.page_size
            if isinstance(a, SlidingAttentionCacheAllocator):
                want = math.ceil(min(r.num_computed, a.window) / P)
            else:
                want = math.ceil(r.num_computed / P)
            assert len(t) == want, f"{r.request_id} group {a.index}: {len(t)} blocks for {r.num_computed} tokens"
    used_sectors = sum(1 for o in pool.owner if o >= 0)
    assert pool.num_free + used_sectors + pool.num_reserved == pool.total_sectors


# ---------------------------------------------------------------------------------------------------- tests
# No shrinking: a failing example is printed whole (setup + workload seed) and replays exactly; shrinking a long
# random workload costs minutes for little gain.
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), print_blob=True,
                phases=[Phase.explicit, Phase.generate])


@pytest.mark.parametrize(
    "family, examples",
    [
        ("full", 150),
        ("full_noshare", 60),
        ("large_page", 50),
        ("hybrid", 150),
        ("sliding", 80),
    ],
)
def test_random_workloads(family: str, examples: int) -> None:
    @settings(max_examples=examples, **SETTINGS)
    @given(setup=setups(family), workload=WORKLOAD, async_mode=st.sampled_from([False, True]))
    def inner(setup: Setup, workload, async_mode: bool) -> None:
        Sim(setup, async_mode).run(gen_ops(*workload))

    inner()


VLLM_RUNS = {"preempted": 0}


@pytest.mark.parametrize("family, examples", [("full", 80), ("hybrid", 40)])
def test_vllm_policy_random_workloads(family: str, examples: int) -> None:
    """vLLM's policy under the same content oracle and invariants: every step within max_batch_tokens (vLLM's
    max_num_batched_tokens) and with at most max_requests_per_batch (max_num_seqs) running requests, recompute
    preemptions free blocks and the preempted requests finish with the tokens the fake runner produced."""

    @settings(max_examples=examples, **SETTINGS)
    @given(setup=setups(family, ("vllm",)), workload=WORKLOAD, async_mode=st.sampled_from([False, True]))
    def inner(setup: Setup, workload, async_mode: bool) -> None:
        sim = Sim(setup, async_mode)
        sim.run(gen_ops(*workload))
        VLLM_RUNS["preempted"] += sim.n_preempted

    inner()
    assert VLLM_RUNS["preempted"] > 0, "no preemption was exercised"


class RecordingSim(Sim):
    """A `Sim` whose scheduler records skips compactly or one by one, keeping every step's plan in plain form."""

    def __init__(self, setup: Setup, async_mode: bool, compact: bool) -> None:
        super().__init__(setup, async_mode)
        self.core.scheduler.compact_skips = compact
        self.plans: list[tuple] = []
        self.tails = 0
        schedule = self.core.schedule

        def recorded():
            work = schedule()
            p = work.plan
            skipped = []
            for k in p.skipped:
                ids = list(k.request_ids)
                if isinstance(k.request_ids, QueueTail):
                    self.tails += 1
                    assert len(k.request_ids) == len(ids) and k.request_ids == ids
                skipped.append((k.reason, ids, dict(k.detail)))
            self.plans.append(([(s.request_id, s.start, s.num_tokens, s.phase) for s in p.scheduled], skipped,
                               [(x.request_id, x.blocks_needed) for x in p.stalled],
                               [(d.request.request_id, d.path) for d in work.offloads],
                               list(p.skipped_requests())))
            return work

        self.core.schedule = recorded  # type: ignore[method-assign]


TAILS = {"n": 0}


@pytest.mark.parametrize("family, examples, schedulers", [("full", 60, ("fifo", "prefill_first")),
                                                         ("hybrid", 40, ("fifo", "prefill_first")),
                                                         ("full", 30, ("vllm",))])
def test_compact_skips_expand_to_the_per_request_reasons(family: str, examples: int, schedulers) -> None:
    """`QueueTail` entries (the rest of the waiting queue in one record) expand to exactly the ids and reasons the
    per-request loop (`compact_skips = False`) lists, and the decisions are the same, step for step."""

    @settings(max_examples=examples, **SETTINGS)
    @given(setup=setups(family, schedulers), workload=WORKLOAD, async_mode=st.sampled_from([False, True]))
    def inner(setup: Setup, workload, async_mode: bool) -> None:
        ops = gen_ops(*workload)
        compact, reference = RecordingSim(setup, async_mode, True), RecordingSim(setup, async_mode, False)
        compact.run(ops)
        reference.run(ops)
        assert reference.tails == 0
        assert len(compact.plans) == len(reference.plans)
        for k, (a, b) in enumerate(zip(compact.plans, reference.plans)):
            assert a == b, f"step {k + 1} differs"
        TAILS["n"] += compact.tails

    inner()
    assert TAILS["n"] > 0, "no compact entry was exercised"


def test_step_count_reported() -> None:
    """The random tests above must have run at least 10,000 engine steps (when run together)."""
    if STEPS["n"] == 0:
        pytest.skip("run with the random workload tests")
    print(f"random engine steps: {STEPS['n']}")
    assert STEPS["n"] >= 10_000
