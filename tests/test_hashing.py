"""Invariant 3: a hash names content, history and namespace, the same in every process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn, make_seed

ALGOS = ["sha256", "sha256_cbor", "xxh3_128"]


def chain(tokens, algo="sha256_cbor", salt=None, adapter=None, seed=None, bs=4):
    seed = seed or make_seed("model-a", "bfloat16", bs, algo)
    return BlockHasher(CacheNamespace(seed, salt, adapter), bs, get_hash_fn(algo)).update(tokens)


@pytest.mark.parametrize("algo", ALGOS)
def test_only_full_blocks_and_prefix_property(algo):
    h = chain(list(range(11)), algo)
    assert len(h) == 2
    assert chain(list(range(8)) + [99], algo) == h  # same history, same names
    changed = chain([0, 1, 2, 3, 4, 5, 6, 70, 8], algo)
    assert changed[0] == h[0] and changed[1] != h[1]
    early = chain([50, 1, 2, 3, 4, 5, 6, 7], algo)
    assert early[1] != h[1]  # a change in block 0 renames every later block


@pytest.mark.parametrize("algo", ALGOS)
def test_namespaces_never_share(algo):
    toks = list(range(12))
    base = chain(toks, algo)
    salted = chain(toks, algo, salt="tenant-a")
    assert all(a != b for a, b in zip(base, salted))
    assert all(a != b for a, b in zip(salted, chain(toks, algo, salt="tenant-b")))
    assert all(a != b for a, b in zip(base, chain(toks, algo, adapter="lora-1")))


def test_seed_covers_model_dtype_block_size():
    seeds = {
        make_seed("model-a", "bfloat16", 16, "sha256_cbor"),
        make_seed("model-b", "bfloat16", 16, "sha256_cbor"),
        make_seed("model-a", "float32", 16, "sha256_cbor"),
        make_seed("model-a", "bfloat16", 32, "sha256_cbor"),
        make_seed("model-a", "bfloat16", 16, "xxh3_128"),
    }
    assert len(seeds) == 5


@pytest.mark.parametrize("algo", ALGOS)
def test_stable_across_processes(algo):
    code = (
        "from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn, make_seed;"
        f"s = make_seed('model-a', 'bfloat16', 4, '{algo}');"
        f"print(BlockHasher(CacheNamespace(s, 'salt'), 4, get_hash_fn('{algo}')).update(list(range(9)))[-1].hex())"
    )
    env = {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == chain(list(range(9)), algo, salt="salt")[-1].hex()


def test_unknown_hash_algo_is_refused():
    with pytest.raises(ValueError, match="unknown hash_algo"):
        get_hash_fn("md5")


class Req:
    def __init__(self, rid, tokens, salt=None):
        self.request_id, self.all_token_ids, self.cache_salt, self.adapter_id = rid, tokens, salt, None


def manager(num_blocks=16, bs=4, verify=False, hash_fn=None):
    pool = BlockPool(num_blocks, bs, verify_tokens=verify)
    return HashCacheManager(pool, make_seed("m", "float32", bs, "x"), hash_fn or get_hash_fn("xxh3_128"))


def serve(mgr, req):
    """Admit, compute everything, finish: what the scheduler does for one request."""
    match = mgr.match_prefix(req)
    assert mgr.allocate_slots(req, len(req.all_token_ids), match) is not None
    mgr.commit(req, len(req.all_token_ids))
    mgr.free(req)
    return match


def test_lookup_stops_at_first_miss_and_keeps_one_token():
    mgr = manager()
    serve(mgr, Req("a", list(range(16))))
    assert serve(mgr, Req("b", list(range(16)))).num_tokens == 12  # n-1 rounded down to blocks
    assert serve(mgr, Req("c", list(range(17)))).num_tokens == 16
    gap = list(range(16))
    gap[5] = 99  # block 1 differs: blocks 2 and 3 cannot hit although their tokens match
    assert serve(mgr, Req("d", gap + [1])).num_tokens == 4


def test_salted_requests_share_nothing_in_the_manager():
    mgr = manager()
    serve(mgr, Req("a", list(range(17)), salt="t1"))
    assert serve(mgr, Req("b", list(range(17)), salt="t2")).num_tokens == 0
    assert serve(mgr, Req("c", list(range(17)))).num_tokens == 0
    assert serve(mgr, Req("d", list(range(17)), salt="t1")).num_tokens == 16


def test_token_check_guards_against_a_colliding_hash():
    collide = lambda obj: b"same"  # noqa: E731 - every block gets one name
    mgr = manager(verify=True, hash_fn=collide)
    serve(mgr, Req("a", [1, 2, 3, 4, 5]))
    assert serve(mgr, Req("b", [9, 9, 9, 9, 5])).num_tokens == 0
    unchecked = manager(verify=False, hash_fn=collide)
    serve(unchecked, Req("a", [1, 2, 3, 4, 5]))
    assert serve(unchecked, Req("b", [9, 9, 9, 9, 5])).num_tokens == 4  # what the check prevents


def test_kv_is_indexed_only_once_computed():
    mgr = manager()
    req = Req("a", list(range(12)))
    mgr.allocate_slots(req, 12, mgr.match_prefix(req))
    mgr.commit(req, 6)  # only block 0 is complete
    assert len(mgr.pool.cached) == 1
    mgr.commit(req, 12)
    assert len(mgr.pool.cached) == 3
    assert not mgr.reset_prefix_cache()  # refused while a request holds blocks
    mgr.free(req)
    assert mgr.reset_prefix_cache() and not mgr.pool.cached


def test_sha256_is_the_documented_fixed_width_encoding():
    """``sha256``: parent, then each token as 8 little-endian bytes, then CBOR extra keys —
    what another process or language must reproduce to name our blocks."""
    import hashlib
    import struct

    import cbor2

    seed = make_seed("model-a", "bfloat16", 4, "sha256")
    tokens = [1, 2, 49151, 7]
    first = hashlib.sha256(seed + struct.pack("<4q", *tokens) + cbor2.dumps((("salt", "t"),), canonical=True)).digest()
    second = hashlib.sha256(first + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert chain(tokens + [5, 6, 7, 8], "sha256", salt="t") == [first, second]
