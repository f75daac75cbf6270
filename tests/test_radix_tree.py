"""Property tests of the radix backend against a brute-force "longest cached prefix".

Random sequences of admit / prefill / decode / finish / evict / pin / unpin run through a
:class:`RadixCacheManager` on a small pool, with a fake KV store (``radix_sim``) that
records which token history each slot holds. After every operation: the pool's and the
tree's invariants hold; every hit equals the brute-force longest prefix over the sequences
the tree is known to hold; reused KV (shared blocks and copy-on-write) is the right KV;
eviction never shortens a locked (running or pinned) path; and at the end nothing leaks.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radix_sim import FakeKV, FakeReq, admit, make_manager, step

BS = 4


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Model:
    """The reference: the token sequences each namespace is known to hold."""

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.seqs: dict[tuple, set[tuple]] = {}

    def expected_hit(self, req: FakeReq) -> int:
        q = req.all_token_ids[:-1]
        ns = (req.cache_salt, req.adapter_id)
        return max((lcp(q, s) for s in self.seqs.get(ns, ())), default=0)

    def add(self, req: FakeReq) -> None:
        self.seqs.setdefault((req.cache_salt, req.adapter_id), set()).add(tuple(req.all_token_ids[: req.num_computed]))

    def refresh(self) -> None:
        """Truncate to what the tree still holds: eviction may only shorten sequences."""
        for (salt, adapter), seqs in self.seqs.items():
            kept = set()
            for s in seqs:
                n = self.mgr.tree.match(self.mgr.namespace(salt, adapter), s).num_tokens
                assert n <= len(s)
                if n:
                    kept.add(s[:n])
            seqs.clear()
            seqs.update(kept)


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "step", "step", "finish", "evict", "pin", "unpin"]),
        st.integers(0, 10_000),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
        st.sampled_from([None, None, "salt"]),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(6, 24), policy=st.sampled_from(["lru", "lfu", "slru", "priority"]))
def test_radix_matches_brute_force(ops, num_blocks, policy):
    mgr = make_manager("radix", num_blocks, BS, policy)
    kv = FakeKV(BS)
    model = Model(mgr)
    running: list[FakeReq] = []
    pins: list[tuple[int, str | None, tuple]] = []
    history: list[list[int]] = [[]]
    for i, (op, r, toks, salt) in enumerate(ops):
        if op == "admit":
            base = history[r % len(history)]
            prompt = base[: r % (len(base) + 1)] + toks  # often extends an earlier sequence
            req = FakeReq(f"r{i}", prompt, cache_salt=salt, priority=r % 3)
            expected = model.expected_hit(req)
            if admit(mgr, kv, req, chunk=1 + r % 9):
                assert req.num_hit == expected, (req.num_hit, expected)
                running.append(req)
        elif op == "step" and running:
            req = running[r % len(running)]
            if not step(mgr, kv, req, new_token=toks[0], chunk=1 + r % 5):
                mgr.free(req)
                running.remove(req)
        elif op == "finish" and running:
            req = running.pop(r % len(running))
            history.append(list(req.all_token_ids[: req.num_computed]))
            mgr.free(req)
        elif op == "evict":
            mgr.tree.evict(1 + r % 4)
        elif op == "pin":
            base = history[r % len(history)]
            res = mgr.pin_prefix(base, cache_salt=salt)
            if res.pin_id is not None:
                pins.append((res.pin_id, salt, tuple(base[: res.num_tokens])))
        elif op == "unpin" and pins:
            mgr.unpin(pins.pop(r % len(pins))[0])
        for req in running:
            if req.num_computed:
                model.add(req)
        model.refresh()
        mgr.check_invariants()
        for req in running:  # locked paths survive everything
            ns = mgr.namespace(req.cache_salt, req.adapter_id)
            assert mgr.tree.match(ns, req.all_token_ids[: req.num_computed]).num_tokens == req.num_computed
        for _, salt_, prefix in pins:
            assert mgr.tree.match(mgr.namespace(salt_, None), prefix).num_tokens == len(prefix)
    for req in running:
        mgr.free(req)
    for pin_id, _, _ in pins:
        mgr.unpin(pin_id)
    mgr.check_invariants()
    info = mgr.size_info()
    assert info.in_use == 0 and mgr.tree.protected_size == 0
    assert info.free + info.evictable == info.total
    assert mgr.reset_prefix_cache()
    assert mgr.pool.num_free_blocks == mgr.pool.num_blocks and not mgr.tree.roots


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=30), min_size=1, max_size=12),
       salts=st.lists(st.sampled_from([None, "a"]), min_size=12, max_size=12))
def test_radix_reuses_at_least_what_hash_reuses(prompts, salts):
    """Same requests through both backends (pool large enough not to evict): radix's hit is
    the whole common prefix (up to len - 1), hash's the block-aligned part of it."""
    hashm, radix = make_manager("hash", 256, BS), make_manager("radix", 256, BS)
    kvh, kvr = FakeKV(BS), FakeKV(BS)
    seen: list[tuple[str | None, list[int]]] = []
    for i, (p, salt) in enumerate(zip(prompts, salts)):
        rh, rr = FakeReq(f"h{i}", list(p), salt), FakeReq(f"r{i}", list(p), salt)
        assert admit(hashm, kvh, rh) and admit(radix, kvr, rr)
        best = max((lcp(p[:-1], q) for s, q in seen if s == salt), default=0)
        assert rr.num_hit == best
        assert rh.num_hit == best // BS * BS
        assert rr.num_hit >= rh.num_hit
        seen.append((salt, list(p)))
        hashm.free(rh)
        radix.free(rr)
    radix.check_invariants()
    assert radix.size_info().in_use == 0 and hashm.size_info().in_use == 0


def test_split_inside_a_block_shares_the_block():
    mgr = make_manager("radix", 32, BS)
    kv = FakeKV(BS)
    a = FakeReq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(mgr, kv, a)
    mgr.free(a)
    b = FakeReq("b", [1, 2, 3, 4, 5, 6, 0, 0, 0])  # diverges at token 6, inside block 1
    assert admit(mgr, kv, b)
    assert b.num_hit == 6 and mgr.num_cow_copies == 1
    mgr.free(b)
    mgr.check_invariants()
    ns = mgr.namespace(None, None)
    root = mgr.tree.roots[ns]
    (mid,) = root.children.values()
    assert (mid.start, mid.end) == (0, 6) and len(mid.children) == 2
    shared = mid.blocks[-1]
    assert any(c.blocks[0] is shared for c in mid.children.values())  # a's tail node
    assert shared.ref_cnt == 2  # held by the parent and by a's tail node


def test_decode_tokens_extend_one_leaf_and_turn_two_reuses_turn_one():
    mgr = make_manager("radix", 64, BS)
    kv = FakeKV(BS)
    a = FakeReq("a", list(range(10)))
    assert admit(mgr, kv, a)
    for t in range(20):
        assert step(mgr, kv, a, new_token=100 + t, chunk=1)
    ns = mgr.namespace(None, None)
    assert len(mgr.tree.roots[ns].children) == 1
    (leaf,) = mgr.tree.roots[ns].children.values()
    assert leaf.end == 30 and not leaf.children  # grown in place, not 20 one-token nodes
    mgr.free(a)
    turn2 = FakeReq("t2", list(a.all_token_ids) + [7, 7, 7])
    assert admit(mgr, kv, turn2)
    assert turn2.num_hit == 30


def test_cache_salt_and_adapter_separate_trees():
    mgr = make_manager("radix", 64, BS)
    kv = FakeKV(BS)
    for rid, salt, adapter in [("a", None, None), ("b", "s", None), ("c", None, "lora1")]:
        r = FakeReq(rid, list(range(12)), cache_salt=salt, adapter_id=adapter)
        assert admit(mgr, kv, r)
        assert r.num_hit == 0, f"{rid} hit another namespace"
        mgr.free(r)
    assert len(mgr.tree.roots) == 3
    again = FakeReq("d", list(range(12)), cache_salt="s")
    assert admit(mgr, kv, again) and again.num_hit == 11


def test_eviction_frees_blocks_when_the_pool_is_short_and_spares_locked_paths():
    mgr = make_manager("radix", 8, BS)
    kv = FakeKV(BS)
    a = FakeReq("a", list(range(12)))  # 3 blocks, stays running (locked)
    assert admit(mgr, kv, a)
    b = FakeReq("b", list(range(50, 62)))  # 3 blocks, finishes: evictable
    assert admit(mgr, kv, b)
    mgr.free(b)
    assert mgr.size_info() == mgr.size_info().__class__(8, 2, 3, 3)
    c = FakeReq("c", list(range(100, 116)))  # needs 4 blocks, 2 are free: evicts 2 of b's
    assert admit(mgr, kv, c)
    # only the tail blocks needed go; b's head block keeps serving hits
    assert mgr.tree.match(mgr.namespace(None, None), b.all_token_ids).num_tokens == 4
    assert mgr.tree.match(mgr.namespace(None, None), a.all_token_ids).num_tokens == 12
    d = FakeReq("d", list(range(200, 208)))  # nothing evictable is left: refused
    assert not admit(mgr, kv, d)
    mgr.check_invariants()
    mgr.free(a)
    mgr.free(c)
    assert mgr.size_info().in_use == 0


@given(held=st.lists(st.booleans(), min_size=3, max_size=3), ask=st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_eviction_of_held_blocks_gives_up_the_tree_and_frees_what_it_can(held, ask):
    """Blocks another owner holds (``KVCacheManager.hold``: work deferred past a step) outlive their leaf:
    evicting it frees none of them, and eviction goes on with what is left (a split head pushed twice
    is evicted once) until it freed what was asked of the blocks nobody else holds; the held ones come back
    on release."""
    mgr = make_manager("radix", 9, BS)
    kv = FakeKV(BS)
    reqs = [FakeReq(f"r{i}", [10 * i + t for t in range(12)]) for i in range(3)]  # 3 blocks each
    holds = []
    for req, h in zip(reqs, held):
        assert admit(mgr, kv, req)
        if h:
            holds.append(mgr.hold(req.request_id))
        mgr.free(req)
    mgr.tree.evict(ask)
    mgr.check_invariants()
    unheld = 9 - 3 * len(holds)
    assert min(ask, unheld) <= mgr.pool.num_free_blocks <= unheld
    for blocks in holds:
        mgr.release(blocks)
    mgr.check_invariants()
    mgr.tree.evict(9)
    assert mgr.pool.num_free_blocks == 9


def test_reset_refused_while_running():
    mgr = make_manager("radix", 16, BS)
    kv = FakeKV(BS)
    a = FakeReq("a", list(range(9)))
    assert admit(mgr, kv, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.size_info().free == 16


def test_short_partial_blocks_are_recomputed_below_min_cow_tokens():
    from kvmosaic.cache.block_pool import BlockPool
    from kvmosaic.cache.radix import RadixCacheManager

    mgr = RadixCacheManager(BlockPool(32, BS), b"s", min_cow_tokens=3)
    kv = FakeKV(BS)
    a = FakeReq("a", list(range(12)))
    assert admit(mgr, kv, a)
    mgr.free(a)
    two = FakeReq("two", list(range(6)) + [50, 51])  # 2 tokens into block 1: recomputed
    assert admit(mgr, kv, two) and two.num_hit == 4 and mgr.num_cow_copies == 0
    three = FakeReq("three", list(range(7)) + [60])  # 3 tokens into block 1: copied
    assert admit(mgr, kv, three) and three.num_hit == 7 and mgr.num_cow_copies == 1


def test_commit_after_a_split_above_the_anchor():
    """A request anchored on a node that reaches past its tokens keeps its path when another
    request splits that node above the anchor's committed tokens (found by the property test)."""
    mgr, kv = make_manager("radix", 6, BS), FakeKV(BS)
    long_req, short_req = FakeReq("long", [0, 2]), FakeReq("short", [0])
    assert admit(mgr, kv, long_req, chunk=1) and step(mgr, kv, long_req, new_token=1, chunk=2)
    assert admit(mgr, kv, short_req, chunk=1)  # anchored on the node [0, 2, 1]
    assert admit(mgr, kv, FakeReq("split", [0, 2, 0]), chunk=1)  # splits it after [0, 2]
    assert step(mgr, kv, short_req, new_token=0, chunk=2)  # [0, 0] diverges inside the parent
    ns = mgr.namespace(None, None)
    assert mgr.tree.match(ns, short_req.all_token_ids[:2]).num_tokens == 2
    mgr.check_invariants()
