"""Paged KV bookkeeping: layout, pool, allocators, prefix index, cache manager, swap pool (torch-free)."""

from __future__ import annotations

import copy

import pytest

from cbnb.core.cache.allocators import FullAttentionCacheAllocator, SlidingAttentionCacheAllocator
from cbnb.core.cache.layout import FULL, SLIDING, KVLayout, layer_groups, layout_for, model_kv_spec
from cbnb.core.cache.manager import Allocation, CacheManager, Shortfall
from cbnb.core.cache.pool import RESERVED, UNASSIGNED, CachePool
from cbnb.core.cache.prefix import block_hash
from cbnb.core.requests import Request


def full_layout(page: int = 4, layers: int = 1) -> KVLayout:
    # 1 KV head, head_dim 16, float32: 128 * page bytes per page; with one layer a sector holds one block.
    return KVLayout(tuple(layer_groups(layers)), 1, 16, 4, page)


def hybrid_layout(page: int = 4, n_full: int = 1, n_sliding: int = 3, window: int = 8) -> KVLayout:
    types = [FULL] * n_full + [SLIDING] * n_sliding
    return KVLayout(tuple(layer_groups(len(types), types, window)), 1, 16, 4, page)


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start + 2, start + 2 + n)))


def state(cm: CacheManager):
    """Everything allocate() may touch, for all-or-nothing checks."""
    return copy.deepcopy((cm.pool._free, cm.pool.owner, [(a.tables, a.refcount, a._free, a._sector_free)
                                                         for a in cm.allocators],
                          (cm.prefix.block_of, list(cm.prefix.cached)) if cm.prefix else None, cm._hashed))


def compute(cm: CacheManager, r: Request, n: int):
    """Admit/grow `r` by `n` computed tokens and register its completed blocks (as a step would)."""
    out = cm.allocate(r, r.num_computed + n)
    assert isinstance(out, Allocation), out
    r.num_computed += n
    cm.register_completed(r, r.num_computed)
    return out


# ------------------------------------------------------------------------------------------------ layout
def test_layer_groups() -> None:
    g = layer_groups(3)
    assert [(x.attention_type, x.layers, x.window) for x in g] == [(FULL, (0, 1, 2), None)]
    g = layer_groups(2, None, 16)
    assert [(x.attention_type, x.layers, x.window) for x in g] == [(SLIDING, (0, 1), 16)]
    g = layer_groups(4, [SLIDING, FULL, SLIDING, FULL], 8)  # transformers: order of first appearance
    assert [(x.index, x.attention_type, x.layers) for x in g] == [(0, SLIDING, (0, 2)), (1, FULL, (1, 3))]
    assert g[0].window == 8 and g[1].window is None
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_groups(2, [FULL, "chunked_attention"])
    with pytest.raises(ValueError, match="3 entries"):
        layer_groups(2, [FULL] * 3)
    with pytest.raises(ValueError, match="sliding_window"):
        layer_groups(2, [FULL, SLIDING], None)
    with pytest.raises(ValueError, match="sliding_window"):
        layer_groups(2, [FULL, SLIDING], 0)


def test_layout_units_transformers_example() -> None:
    # transformers' run: 2 layers, 2 KV heads, head_dim 16, fp32, page 16, num_blocks=32.
    lay = KVLayout(tuple(layer_groups(2)), 2, 16, 4, 16)
    assert lay.bytes_per_page == 4096
    assert lay.bytes_per_block(0) == 8192 == lay.bytes_per_sector
    assert lay.sectors_for_blocks(32) == 32 and lay.whole_model_blocks(32) == 32
    assert lay.sectors_for_blocks(0) == 1  # at least one sector


def test_hybrid_sectors_tile_both_block_sizes() -> None:
    # 1 full layer and 3 sliding layers: a sector is 3 full blocks or 1 sliding block.
    lay = hybrid_layout(page=16)
    assert lay.bytes_per_block(0) * 3 == lay.bytes_per_block(1) == lay.bytes_per_sector
    assert (lay.blocks_per_sector(0), lay.blocks_per_sector(1)) == (3, 1)
    # 2 full and 3 sliding layers with tiny pages: lcm with 128 bytes matters.
    lay = KVLayout(tuple(layer_groups(5, [FULL] * 2 + [SLIDING] * 3, 8)), 1, 1, 2, 4)
    assert lay.bytes_per_page == 16 and lay.bytes_per_sector == 384
    assert (lay.blocks_per_sector(0), lay.blocks_per_sector(1)) == (12, 8)
    for g in (0, 1):
        assert lay.blocks_per_sector(g) * lay.bytes_per_block(g) == lay.bytes_per_sector
    assert not lay.supports_sharing and lay.max_window is None
    assert full_layout().supports_sharing
    assert KVLayout(tuple(layer_groups(2, None, 12)), 1, 16, 4, 4).max_window == 12


def test_model_kv_spec_from_transformers_configs() -> None:
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                     hidden_size=256, vocab_size=100)
    spec = model_kv_spec(llama)
    assert spec["num_layers"] == 4 and spec["num_kv_heads"] == 2 and spec["head_dim"] == 32
    assert spec["layer_types"] in (None, [FULL] * 4) and spec["sliding_window"] is None
    lay = layout_for(spec, 2, 16)
    assert len(lay.groups) == 1 and lay.groups[0].attention_type == FULL
    qwen2 = transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=64, vocab_size=100, use_sliding_window=True, sliding_window=32,
                                     max_window_layers=0,
                                     layer_types=[FULL, SLIDING, FULL, SLIDING])
    lay = layout_for(model_kv_spec(qwen2), 2, 16)
    assert [(g.attention_type, g.layers, g.window) for g in lay.groups] == [(FULL, (0, 2), None),
                                                                            (SLIDING, (1, 3), 32)]
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=18, sliding_window=512, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=256, hidden_size=640, vocab_size=100)
    lay = layout_for(model_kv_spec(gemma), 4, 16)  # Gemma 3 270M's shape: full attention at layers 5, 11, 17
    assert [(g.attention_type, len(g.layers), g.window) for g in lay.groups] == [(SLIDING, 15, 512), (FULL, 3, None)]
    assert lay.groups[1].layers == (5, 11, 17)
    assert (lay.blocks_per_sector(0), lay.blocks_per_sector(1)) == (1, 5)  # 15 sliding pages = 5 full blocks
    assert model_kv_spec(transformers.Gemma3Config(text_config=gemma.to_dict()))["num_layers"] == 18
    qwen3 = transformers.Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=64, head_dim=16, vocab_size=100)
    spec = model_kv_spec(qwen3)
    assert spec["sliding_window"] is None and spec["head_dim"] == 16
    assert layout_for(spec, 2, 16).supports_sharing


# ------------------------------------------------------------------------------------------------ pool
def test_pool_reserved_sectors_never_handed_out() -> None:
    pool = CachePool(3, num_reserved=2)
    assert pool.owner == [RESERVED, RESERVED, UNASSIGNED, UNASSIGNED, UNASSIGNED]
    got = [pool.take(0), pool.take(1), pool.take(0)]
    assert got == [2, 3, 4]  # lowest first, never 0 or 1
    with pytest.raises(RuntimeError):
        pool.take(0)
    pool.give_back(3)
    assert pool.take(1) == 3
    with pytest.raises(ValueError, match="reserved"):
        pool.give_back(0)
    pool.give_back(2)
    with pytest.raises(ValueError, match="already free"):
        pool.give_back(2)
    assert CachePool(2, num_reserved=0).take(0) == 0


def test_padding_blocks_are_the_reserved_ones() -> None:
    cm = CacheManager(hybrid_layout(), 8)
    full, sliding = cm.allocators
    assert (full.read_padding_block, full.write_padding_block) == (0, 3)  # first block of sectors 0 and 1
    assert (sliding.read_padding_block, sliding.write_padding_block) == (0, 1)
    r = req("a", 30)
    compute(cm, r, 30)
    for a in cm.allocators:
        for b in a.tables["a"]:
            assert b // a.blocks_per_sector >= 2


# ------------------------------------------------------------------------------------------------ allocators
def test_full_allocator_slots() -> None:
    cm = CacheManager(full_layout(page=4), 8, allow_block_sharing=False)
    r = req("a", 10)
    out = cm.allocate(r, 10)
    assert isinstance(out, Allocation) and len(out.new_blocks[0]) == 3
    t = cm.block_tables(r)[0]
    assert t == [2, 3, 4]
    assert cm.write_slots(r, 0, 10) == [[8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    assert cm.write_slots(r, 5, 7) == [[t[1] * 4 + 1, t[1] * 4 + 2]]
    assert cm.allocators[0].slot("a", 9) == t[2] * 4 + 1
    assert isinstance(cm.allocators[0], FullAttentionCacheAllocator)
    assert cm.allocators[0].covers("a", 12) and not cm.allocators[0].covers("a", 13)


def test_sliding_allocator_ring() -> None:
    lay = KVLayout(tuple(layer_groups(1, None, 6)), 1, 16, 4, 4)  # window 6, page 4: 2 blocks per request
    cm = CacheManager(lay, 8)
    a = cm.allocators[0]
    assert isinstance(a, SlidingAttentionCacheAllocator) and not cm.sharing
    r = req("a", 20)
    cm.allocate(r, 3)
    assert len(a.tables["a"]) == 1
    cm.allocate(r, 20)
    t = a.tables["a"]
    assert len(t) == 2 and a.blocks_for_tokens(10**6) == 2  # never more than ceil(window / page)
    ring = [t[0] * 4 + 0, t[0] * 4 + 1, t[0] * 4 + 2, t[0] * 4 + 3, t[1] * 4 + 0, t[1] * 4 + 1]
    for p in range(20):
        assert a.slot("a", p) == ring[p % 6]
    # A chunk longer than the window keeps only its last `window` positions; earlier ones go to padding (-1).
    slots = a.write_slots("a", 3, 15)
    assert slots[:6] == [-1] * 6 and slots[6:] == [ring[p % 6] for p in range(9, 15)]
    assert len(set(slots[6:])) == 6
    assert a.write_slots("a", 18, 20) == [ring[0], ring[1]]
    assert a.read_positions(3) == (0, 3) and a.read_positions(20) == (15, 20)
    assert a.covers("a", 10**6)
    with pytest.raises(ValueError, match="window"):
        SlidingAttentionCacheAllocator(layer_groups(1, None, 6)[0].__class__(0, SLIDING, (0,), None), lay, cm.pool)


def test_blocks_grow_only_when_a_page_fills() -> None:
    cm = CacheManager(full_layout(page=4), 8)
    r = req("a", 4)
    a = compute(cm, r, 4)
    assert len(a.new_blocks[0]) == 1
    r.prompt_ids.append(50)
    grow = cm.allocate(r, 5)
    assert len(grow.new_blocks[0]) == 1 and len(cm.block_tables(r)[0]) == 2
    assert cm.allocate(r, 5).new_blocks == [[]]


# ------------------------------------------------------------------------------------------------ admission
def test_admission_all_or_nothing_across_groups() -> None:
    # Hybrid: full blocks 3 per sector, sliding 1 per sector; 3 usable sectors.
    cm = CacheManager(hybrid_layout(page=4, window=8), 3)
    r1 = req("a", 8)
    compute(cm, r1, 8)  # full: 2 blocks (1 sector); sliding: 2 blocks (2 sectors)
    assert cm.pool.num_free == 0
    r2 = req("b", 4)
    before = state(cm)
    out = cm.allocate(r2, 4)
    assert isinstance(out, Shortfall)
    # the full group alone could take it (a free block in its sector), the sliding group cannot
    assert out.needed == [1, 1] and out.available == [1, 0]
    assert "group 1: needs 1 blocks, 0 obtainable" in out.describe()
    assert state(cm) == before
    cm.check_invariants([r1, r2])


def test_admission_uses_free_blocks_before_new_sectors() -> None:
    cm = CacheManager(hybrid_layout(page=4, window=8), 6)
    r1 = req("a", 4)
    compute(cm, r1, 4)
    sectors_after_one = cm.pool.num_free
    r2 = req("b", 4)
    compute(cm, r2, 4)
    # r2's full block comes from the sector r1's full block opened; the sliding group needs its own sector.
    assert cm.pool.num_free == sectors_after_one - 1
    assert cm.allocators[0].tables["b"][0] // 3 == cm.allocators[0].tables["a"][0] // 3


def test_fits_empty_capacity_and_max_request_tokens() -> None:
    cm = CacheManager(full_layout(page=4), 5)
    assert cm.capacity_tokens == 20
    assert cm.fits_empty(20) and not cm.fits_empty(21)
    assert cm.max_request_tokens() == 20
    hy = CacheManager(hybrid_layout(page=4, window=8), 4)  # sliding needs 2 sectors, full 3 blocks per sector
    assert hy.fits_empty(24) and not hy.fits_empty(25)
    assert hy.max_request_tokens() == 24
    sl = CacheManager(KVLayout(tuple(layer_groups(1, None, 8)), 1, 16, 4, 4), 2)
    assert sl.fits_empty(10**9) and sl.max_request_tokens() >= 2**40


def test_free_fraction_counts_cached_blocks_as_free() -> None:
    cm = CacheManager(full_layout(page=4), 4)
    assert cm.free_fraction() == 1.0
    r = req("a", 9)
    compute(cm, r, 9)  # 3 blocks, 2 of them full and hashed
    assert cm.free_fraction() == pytest.approx(0.25)
    cm.release(r)
    assert cm.prefix.num_cached == 2
    assert cm.free_fraction() == 1.0
    assert cm.obtainable_blocks(0) == 4


# ------------------------------------------------------------------------------------------------ prefix index
def test_block_hash_is_chained_and_stable() -> None:
    h0 = block_hash(None, [1, 2, 3, 4])
    assert h0 == block_hash(None, [1, 2, 3, 4]) and 0 <= h0 < 2**64
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    # transformers' scheme: blake2b(parent as 8 LE bytes || int32 tokens), 8-byte digest, little endian
    import hashlib
    from array import array

    h = hashlib.blake2b(digest_size=8)
    h.update(h0.to_bytes(8, "little"))
    h.update(array("i", [5, 6, 7, 8]).tobytes())
    assert block_hash(h0, [5, 6, 7, 8]) == int.from_bytes(h.digest(), "little")


def test_prefix_hit_and_refcounts() -> None:
    cm = CacheManager(full_layout(page=4), 10)
    a = Request("a", list(range(2, 12)))  # 10 tokens: 2 full blocks + 2 tokens
    compute(cm, a, 10)
    b = Request("b", list(range(2, 12)) + [40, 41])
    m = cm.match_prefix(b)
    assert m is not None and m.num_tokens == 8 and m.blocks == cm.block_tables(a)[0][:2]
    out = cm.allocate(b, 12, m)
    assert isinstance(out, Allocation) and out.prefix is m and len(out.new_blocks[0]) == 1
    b.num_computed = 12
    cm.register_completed(b, 12)
    ta, tb = cm.block_tables(a)[0], cm.block_tables(b)[0]
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    full = cm.allocators[0]
    assert [full.refcount[x] for x in tb] == [2, 2, 1]
    assert cm.exclusive_blocks(a) == [1] and cm.exclusive_blocks(b) == [1]
    cm.check_invariants([a, b])
    cm.release(a)
    assert [full.refcount[x] for x in tb] == [1, 1, 1]
    assert cm.prefix.num_cached == 0  # still referenced by b
    cm.release(b)
    assert cm.prefix.num_cached == 3  # 12 tokens: 3 full blocks, all hashed
    cm.check_invariants([])


def test_shared_reads_count_prefix_blocks_an_earlier_row_read() -> None:
    from types import SimpleNamespace as Row

    cm = CacheManager(full_layout(page=4), 12)
    a = Request("a", list(range(2, 12)))  # 2 full blocks + 2 tokens
    compute(cm, a, 10)
    b = Request("b", list(range(2, 12)) + [40, 41])
    cm.allocate(b, 12, cm.match_prefix(b))  # shares a's 2 full blocks
    b.num_computed = 12
    c = req("c", 9, start=100)  # its own blocks
    compute(cm, c, 9)
    rows = [Row(request=a, start=10), Row(request=b, start=12), Row(request=c, start=9)]
    assert cm.shared_reads(rows) == [0, 8, 0]  # a reads the prefix first; b's 2 blocks are read again
    assert cm.shared_reads(rows[1:]) == []  # alone in a step nothing is read twice
    assert cm.shared_reads([Row(request=a, start=6), Row(request=b, start=12)]) == [0, 4]  # a's past: 1 block
    assert cm.shared_reads([rows[2]]) == []
    unshared = CacheManager(full_layout(page=4), 12, allow_block_sharing=False)
    compute(unshared, a2 := req("a2", 9), 9)
    assert unshared.shared_reads([Row(request=a2, start=9)]) == []


def test_match_leaves_the_last_prompt_token() -> None:
    cm = CacheManager(full_layout(page=4), 10)
    a = Request("a", list(range(2, 10)))  # exactly 2 blocks
    compute(cm, a, 8)
    cm.release(a)
    same = Request("b", list(range(2, 10)))
    m = cm.match_prefix(same)
    assert m.num_tokens == 4  # not 8: the last token must be computed for its logits
    longer = Request("c", list(range(2, 11)))
    assert cm.match_prefix(longer).num_tokens == 8
    assert cm.match_prefix(Request("d", [2, 3, 4, 5])) is None  # a 1-block prompt: nothing to share
    assert cm.match_prefix(Request("e", [9, 3, 4, 5, 6, 7, 8, 9, 10])) is None  # first block differs


def test_no_sharing_for_hybrid_sliding_or_when_disallowed() -> None:
    assert not CacheManager(hybrid_layout(), 4).sharing
    assert not CacheManager(KVLayout(tuple(layer_groups(1, None, 8)), 1, 16, 4, 4), 4).sharing
    cm = CacheManager(full_layout(), 8, allow_block_sharing=False)
    assert not cm.sharing and cm.prefix is None
    a = req("a", 9)
    compute(cm, a, 9)
    assert cm.register_completed(a, 9) == []
    assert cm.match_prefix(req("b", 9)) is None
    cm.release(a)
    assert len(cm.allocators[0]._free) == 3 and cm.allocators[0].num_demotable == 0  # nothing kept


def test_dedupe_of_blocks_computed_side_by_side() -> None:
    cm = CacheManager(full_layout(page=4), 10)
    a, b = Request("a", list(range(2, 12))), Request("b", list(range(2, 12)))
    for r in (a, b):
        cm.allocate(r, 10)
        r.num_computed = 10
    assert cm.block_tables(a)[0][:2] != cm.block_tables(b)[0][:2]
    assert cm.register_completed(a, 10) == []
    b_old = list(cm.block_tables(b)[0])
    dedup = cm.register_completed(b, 10)
    assert [(i, dup, keep) for i, dup, keep in dedup] == [(0, b_old[0], cm.block_tables(a)[0][0]),
                                                          (1, b_old[1], cm.block_tables(a)[0][1])]
    assert cm.block_tables(b)[0][:2] == cm.block_tables(a)[0][:2]
    full = cm.allocators[0]
    assert b_old[0] in full._free and b_old[1] in full._free  # duplicates freed at once
    cm.check_invariants([a, b])


def test_eviction_is_lazy_and_follows_the_policy() -> None:
    for policy, first_demoted in (("transformers", "newest tail"), ("lru", "oldest tail")):
        cm = CacheManager(full_layout(page=4), 6, prefix_eviction=policy)
        a = Request("a", list(range(2, 14)))  # 3 full blocks
        compute(cm, a, 12)
        b = Request("b", list(range(50, 62)))
        compute(cm, b, 12)
        ta, tb = list(cm.block_tables(a)[0]), list(cm.block_tables(b)[0])
        cm.release(a)
        cm.release(b)
        assert cm.prefix.num_cached == 6 and cm.pool.num_free == 0
        # Nothing is demoted while the cache is not needed: both prefixes still hit.
        assert cm.match_prefix(Request("a2", list(range(2, 14)) + [1])).num_tokens == 12
        c = req("c", 4, start=100)
        out = compute(cm, c, 4)
        demoted = out.demoted[0]
        assert len(demoted) == 1
        if policy == "transformers":
            assert demoted == [tb[-1]]  # most recently freed: the tail of the last finished request
        else:
            assert demoted == [ta[-1]]  # least recently freed request, its tail first
        assert cm.block_tables(c)[0] == demoted
        cm.check_invariants([c])
        # The demoted block's old content is no longer indexed; the other prefix still hits in full.
        a_hit = cm.match_prefix(Request("a3", list(range(2, 14)) + [1]))
        b_hit = cm.match_prefix(Request("b3", list(range(50, 62)) + [1]))
        hits = sorted([a_hit.num_tokens, b_hit.num_tokens])
        assert hits == [8, 12]
        assert (b_hit.num_tokens == 8) == (policy == "transformers")


def test_cached_block_claimed_back_without_copy() -> None:
    cm = CacheManager(full_layout(page=4), 4)
    a = Request("a", list(range(2, 11)))
    compute(cm, a, 9)
    blocks = cm.block_tables(a)[0][:2]
    cm.release(a)
    b = Request("b", list(range(2, 11)))
    m = cm.match_prefix(b)
    out = cm.allocate(b, 9, m)
    assert cm.block_tables(b)[0][:2] == blocks and out.demoted == [[]]
    assert cm.prefix.num_cached == 0
    cm.check_invariants()


def test_admission_with_a_match_does_not_demote_its_own_prefix() -> None:
    # 3 blocks; a's two hashed blocks are cached; b matches both and needs 2 more: only 1 obtainable.
    cm = CacheManager(full_layout(page=4), 3)
    a = Request("a", list(range(2, 10)) + [77])
    compute(cm, a, 9)
    cm.release(a)
    b = Request("b", list(range(2, 10)) + list(range(30, 35)))
    m = cm.match_prefix(b)
    assert m.num_tokens == 8
    before = state(cm)
    out = cm.allocate(b, 13, m)
    assert isinstance(out, Shortfall) and out.needed == [2] and out.available == [1]
    assert state(cm) == before
    out = cm.allocate(b, 12, m)
    assert isinstance(out, Allocation) and out.demoted == [[]]


def test_sharing_survives_many_sharers() -> None:
    cm = CacheManager(full_layout(page=4), 20)
    base = list(range(2, 10))
    reqs = []
    for i in range(5):
        r = Request(f"r{i}", base + [100 + i])
        m = cm.match_prefix(r)
        cm.allocate(r, 9, m)
        r.num_computed = 9
        cm.register_completed(r, 9)
        reqs.append(r)
    first = cm.block_tables(reqs[0])[0][:2]
    full = cm.allocators[0]
    assert all(cm.block_tables(r)[0][:2] == first for r in reqs)
    assert [full.refcount[b] for b in first] == [5, 5]
    cm.check_invariants(reqs)
    for r in reqs[:4]:
        cm.release(r)
    assert [full.refcount[b] for b in first] == [1, 1]
    cm.check_invariants(reqs[4:])


# ------------------------------------------------------------------------------------------------ swap
def test_swap_out_and_restore_pairs() -> None:
    cm = CacheManager(hybrid_layout(page=4, window=8), 8, swap_sectors=6)
    r = req("a", 10)
    compute(cm, r, 10)
    dev = [list(t) for t in cm.block_tables(r)]
    assert cm.can_swap(r)
    so = cm.swap_out(r)
    r.swapped = True
    assert so.num_blocks == sum(len(t) for t in dev)
    assert [[d for d, _ in p] for p in so.pairs] == dev
    host = [[h for _, h in p] for p in so.pairs]
    assert cm.block_tables(r) == [[], []] and cm.swap.holds("a")
    cm.check_invariants([r])
    r.prompt_ids.append(99)
    out = cm.allocate(r, 11)
    assert isinstance(out, Allocation) and out.restored is not None
    for g in range(2):
        assert [h for h, _ in out.restored[g]] == host[g]
        assert [d for _, d in out.restored[g]] == cm.block_tables(r)[g][: len(host[g])]
    # The host copy is freed at the next scheduling pass, not during this one: a swap-out decided later in the same
    # step must not reuse a host block that the runner has yet to read back.
    assert cm.swap.holds("a")
    other = req("b", 4, start=40)
    compute(cm, other, 4)
    so = cm.swap_out(other)
    assert not {h for _, h in so.pairs[0]} & set(host[0])
    cm.flush_host_releases()
    assert not cm.swap.holds("a") and cm.swap.holds("b")
    assert all(b in cm.swap.allocators[g]._free for g in range(2) for b in host[g])


def test_swap_pool_too_small() -> None:
    cm = CacheManager(full_layout(page=4), 8, swap_sectors=1)
    r = req("a", 10)
    compute(cm, r, 10)
    assert not cm.can_swap(r)
    with pytest.raises(RuntimeError, match="swap pool"):
        cm.swap_out(r)
    assert CacheManager(full_layout(), 4).can_swap(r) is False  # no pool


def test_release_frees_host_copy() -> None:
    cm = CacheManager(full_layout(page=4), 8, swap_sectors=4)
    r = req("a", 6)
    compute(cm, r, 6)
    cm.swap_out(r)
    assert cm.swap.holds("a")
    cm.release(r)
    assert not cm.swap.holds("a") and cm.swap.pool.num_free + len(cm.swap.allocators[0]._sector_free) == 4


# ------------------------------------------------------------------------------------------------ invariants
def test_check_invariants_catches_corruption() -> None:
    cm = CacheManager(full_layout(page=4), 6)
    a = req("a", 9)
    compute(cm, a, 9)
    cm.check_invariants([a])
    full = cm.allocators[0]
    full.refcount[full.tables["a"][0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        cm.check_invariants([a])
    full.refcount[full.tables["a"][0]] -= 1
    a.num_computed = 13
    with pytest.raises(AssertionError, match="need"):
        cm.check_invariants([a])
    a.num_computed = 9
    full.tables["a"][0] = 0
    with pytest.raises(AssertionError):
        cm.check_invariants([a])


def test_block_states_partition() -> None:
    cm = CacheManager(full_layout(page=4), 6)
    a = req("a", 9)
    compute(cm, a, 9)
    b = req("b", 5, start=50)
    compute(cm, b, 5)
    cm.release(b)
    st = cm.allocators[0].block_states()
    assert st["reserved"] == [0, 1]
    assert len(st["used"]) == 3 and len(st["cached"]) == 1 and len(st["free"]) == 1
    total = sum(len(v) for k, v in st.items())
    assert total == cm.allocators[0].total_blocks


def test_sink_receives_cache_events() -> None:
    events: list[tuple[str, dict]] = []
    cm = CacheManager(full_layout(page=4), 8, swap_sectors=4, sink=lambda kind, **kw: events.append((kind, kw)))
    a = Request("a", list(range(2, 11)))
    compute(cm, a, 9)
    b = Request("b", list(range(2, 11)))
    cm.allocate(b, 9)
    b.num_computed = 9
    cm.register_completed(b, 9)
    cm.swap_out(b)
    cm.release(a)
    kinds = [k for k, _ in events]
    assert kinds == ["blocks_allocated", "blocks_allocated", "blocks_deduplicated", "swapped_out", "blocks_freed"]
    assert events[0][1]["request_id"] == "a" and len(events[0][1]["new_blocks"][0]) == 3
    assert len(events[2][1]["pairs"]) == 2


def test_a_step_carries_its_own_block_tables_and_slots():
    """`StepWork.kv` (`cbnb.core.plan.StepKV`): per row and group the block table, the chunk's write slots, a sliding
    chunk's earlier window slots, and a decode row's slot from its table: what the runners read instead of the
    cache manager."""
    from cbnb.core.config import ContinuousBatchingConfig
    from cbnb.core.engine_core import EngineCore
    from cbnb.core.plan import decode_slot
    from cbnb.core.requests import SamplingParams

    groups = layer_groups(2, ["full_attention", "sliding_attention"], sliding_window=6)
    layout = KVLayout(tuple(groups), 2, 8, 4, 4)
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=5).resolve("cpu")
    cm = CacheManager(layout, 32)
    core = EngineCore(cfg, cm)
    core.add(Request("r", list(range(3, 17)), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    seen_ring = seen_decode = False
    while core.has_work:
        work = core.schedule()
        kv = work.kv
        assert kv.page_size == 4 and [g.window for g in kv.groups] == [0, 6]
        for s in work.plan.scheduled:
            row = kv.rows[s.request_id]
            assert row.tables == [a.tables["r"] for a in cm.allocators]
            end = s.start + s.num_tokens
            if s.num_tokens == 1:
                seen_decode = True
                assert row.write_slots is None
                assert [decode_slot(t, s.start, g.window, 4) for t, g in zip(row.tables, kv.groups)] == [
                    a.write_slots("r", s.start, end)[0] for a in cm.allocators]
            else:
                assert row.write_slots == [a.write_slots("r", s.start, end) for a in cm.allocators]
                if s.start > 0:
                    seen_ring = True
                    sliding = cm.allocators[1]
                    assert row.window_slots[0] is None
                    assert row.window_slots[1] == [sliding.slot("r", p) for p in range(*sliding.read_positions(s.start))]
        core.apply(work, {s.request_id: 5 for s in work.plan.scheduled if s.samples})
    assert seen_ring and seen_decode
