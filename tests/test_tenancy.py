"""Tenancy without torch: namespaces and public prefixes in the hash chain and in both cache
backends (via the real managers and the model-free driver of radix_sim), and TenantPolicy."""

from __future__ import annotations

import pytest
from radix_sim import SEED, FakeKV, FakeReq, admit, make_manager

from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn
from kvmosaic.server.errors import APIError
from kvmosaic.server.tenancy import PublicPrefixes, TenantPolicy, read_public_prefix_file

BS = 4
PUBLIC = list(range(100, 108))  # two public blocks
SECRET = [7, 7, 7, 7, 8, 8, 8, 8, 9]
OTHER = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def chain(salt, tokens, bs=BS, public=0):
    return BlockHasher(CacheNamespace(SEED, salt, None, public), bs, get_hash_fn("sha256_cbor")).update(tokens)


def test_default_chain_is_unchanged():
    ns = CacheNamespace(SEED, "t")
    assert ns.public_blocks == 0 and ns.extra_keys(0) == (("salt", "t"),) and ns.extra_keys(1) == ()
    assert CacheNamespace(SEED, None, None, 3) == CacheNamespace(SEED), "no salt: nothing is private"
    # bit-identical to the chain as it was written before public prefixes existed
    fn = get_hash_fn("sha256_cbor")
    h0 = fn((SEED, tuple(SECRET[:4]), (("salt", "t"),)))
    assert chain("t", SECRET)[0] == h0 and chain(None, SECRET)[0] == fn((SEED, tuple(SECRET[:4]), ()))


def test_public_blocks_are_shared_and_the_rest_is_salted():
    ha, hb = chain("alice", PUBLIC + SECRET, public=2), chain("bob", PUBLIC + SECRET, public=2)
    plain = chain(None, PUBLIC + SECRET)
    assert ha[:2] == hb[:2] == plain[:2], "the public head is the unsalted chain"
    assert ha[2] != hb[2] and ha[2] != plain[2] and ha[2] != chain("alice", PUBLIC + SECRET)[2]
    assert CacheNamespace(SEED, "alice", None, 2).public() == CacheNamespace(SEED, None)
    # the salt string carries no count: a salt that looks packed is just a salt
    assert CacheNamespace(SEED, "\x00public=2;alice").public_blocks == 0


class NamespacedKV(FakeKV):
    """KV of a position is (namespace, history), where the namespace is None in the public head."""

    def write(self, table, req, start, end):
        bs, head = self.block_size, req.public_blocks * self.block_size
        for p in range(start, end):
            ns = (None if p < head else req.cache_salt, req.adapter_id)
            self.slots.setdefault(table[p // bs], [None] * bs)[p % bs] = (ns, tuple(req.all_token_ids[: p + 1]))

    def check(self, table, req, end):
        bs, head = self.block_size, req.public_blocks * self.block_size
        for p in range(end):
            ns = (None if p < head else req.cache_salt, req.adapter_id)
            got = self.slots.get(table[p // bs], [None] * bs)[p % bs]
            assert got[1] == tuple(req.all_token_ids[: p + 1]), f"wrong KV at position {p}"
            assert got[0][0] in (None, ns[0]), f"position {p}: another tenant's KV"


def run(mgr, kv, rid, salt, tokens, public=0):
    req = FakeReq(rid, list(tokens), cache_salt=salt, public_blocks=public)
    assert admit(mgr, kv, req)
    mgr.free(req)
    if hasattr(mgr, "check_invariants"):
        mgr.check_invariants()
    return req.num_hit


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_isolated_tenants_never_hit_each_other(kind):
    mgr, kv = make_manager(kind, 64, BS), NamespacedKV(BS)
    assert run(mgr, kv, "a1", "alice", PUBLIC + SECRET) == 0
    assert run(mgr, kv, "b1", "bob", PUBLIC + SECRET) == 0, "bob's probe of alice's prompt misses"
    assert run(mgr, kv, "a2", "alice", PUBLIC + SECRET) >= 16, "alice still hits her own"


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_shared_public_shares_the_public_head_only(kind):
    mgr, kv = make_manager(kind, 64, BS), NamespacedKV(BS)
    assert run(mgr, kv, "a1", "alice", PUBLIC + SECRET, 2) == 0
    # bob probes alice's exact prompt: only the public head is found (not her secret tail)
    assert run(mgr, kv, "b1", "bob", PUBLIC + SECRET, 2) == 8
    assert run(mgr, kv, "b2", "bob", PUBLIC + OTHER, 2) == 8
    # declaring more of the prompt public does not reach alice's salted blocks
    assert run(mgr, kv, "b3", "bob", PUBLIC + SECRET[:8] + [5], 4) == 8
    # alice still reuses her whole prompt
    assert run(mgr, kv, "a2", "alice", PUBLIC + SECRET, 2) >= 16


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_shared_public_under_eviction_pressure(kind):
    mgr, kv = make_manager(kind, 12, BS), NamespacedKV(BS)
    for i in range(30):
        tail = [(i * 7 + j) % 50 for j in range(6)]
        run(mgr, kv, f"r{i}", f"t{i % 3}", PUBLIC + tail, 2)
    info = mgr.size_info()
    assert info.num_free_blocks + info.num_evictable_blocks == info.num_blocks if hasattr(info, "num_free_blocks") \
        else True


def test_public_prefixes_from_tokens_and_hashes():
    pp = PublicPrefixes(BS, [PUBLIC + [0]])
    assert pp.blocks(PUBLIC + SECRET) == 2 and pp.blocks(PUBLIC[:6] + SECRET) == 1 and pp.blocks(SECRET) == 0
    assert pp.blocks(SECRET, marked=SECRET[:8]) == 2
    h = chain(None, PUBLIC)
    by_hash = PublicPrefixes(BS, [], frozenset({h[1]}), lambda ids: chain(None, ids))
    assert by_hash.blocks(PUBLIC + SECRET) == 2 and by_hash.blocks(SECRET) == 0


def test_public_prefix_file(tmp_path):
    f = tmp_path / "public.txt"
    f.write_text("You are a helpful assistant.\n---\nsha256:" + "ab" * 32 + "\n---\nSecond text\n")
    texts, hashes = read_public_prefix_file(str(f))
    assert texts == ["You are a helpful assistant.", "Second text"] and hashes == [bytes.fromhex("ab" * 32)]


def test_modes_and_salts():
    assert TenantPolicy().mode == "shared" and TenantPolicy().cache_salt("k", None) is None
    iso = TenantPolicy(api_keys=frozenset({"k1", "k2"}))
    assert iso.mode == "isolated" and iso.salt_secret, "keys known: isolated by default, secret generated"
    assert iso.cache_salt("k1", None) != iso.cache_salt("k2", None)
    assert TenantPolicy(api_keys=frozenset({"k1"})).cache_salt("k1", None) != iso.cache_salt("k1", None)
    assert TenantPolicy(api_keys=frozenset({"k1"}), mode="shared").cache_salt("k1", None) is None
    with pytest.raises(ValueError):
        TenantPolicy(mode="open")
    with pytest.raises(ValueError):
        TenantPolicy(api_keys=frozenset({"k"}), admin_keys=frozenset({"k"}))
    sp = TenantPolicy(api_keys=frozenset({"k1"}), mode="shared-public", public=PublicPrefixes(BS, [PUBLIC]))
    assert sp.public_blocks(PUBLIC + SECRET) == 2 and iso.public_blocks(PUBLIC + SECRET) == 0


@pytest.mark.parametrize("header", ["Bearer \u00e9l\u00e8ve", "Bearer k1\x00", "Bearer ", "Basic k1", "k1",
                                    "Bearer \u2603"])
def test_malformed_credentials_are_401(header):
    p = TenantPolicy(api_keys=frozenset({"k1"}), admin_keys=frozenset({"adm"}))
    for call in (p.authenticate, p.role, lambda h: p.require_admin(h, "/metrics")):
        with pytest.raises(APIError) as e:
            call(header)
        assert e.value.status == 401
    assert p.is_admin(header) is False


def test_admin_and_tenant_roles():
    p = TenantPolicy(api_keys=frozenset({"k1"}), admin_keys=frozenset({"adm"}))
    assert p.authenticate("Bearer k1") == "k1" and p.authenticate("Bearer adm") == "adm"
    p.require_admin("Bearer adm", "x")
    for header, status in ((None, 401), ("Bearer k1", 403), ("Bearer nope", 401)):
        with pytest.raises(APIError) as e:
            p.require_admin(header, "x")
        assert e.value.status == status
    open_policy = TenantPolicy()
    open_policy.require_admin(None, "x")  # no keys configured: open, as before
    assert open_policy.authenticate("Bearer \u00e9") is None, "no keys: a malformed header is anonymous"
