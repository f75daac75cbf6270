"""`kvmosaic explain`: where the hash chain breaks and what each backend reuses."""

from __future__ import annotations

from kvmosaic.explain import Prompt, against_cache, compare, replay

BS = 4


def test_token_difference_inside_a_block():
    a = Prompt(list(range(20)))
    b = Prompt(list(range(10)) + [99] + list(range(11, 20)))
    ex = compare(a, b, BS)
    assert ex.first_diff == 10 and ex.break_block == 2
    assert ex.hash_reuse == 8 and ex.radix_reuse == 10
    assert any("token 10 differs" in r for r in ex.reasons)
    assert any("inside block 2" in r for r in ex.reasons)
    assert ex.hash_a != ex.hash_b


def test_identical_prompts_reuse_all_but_the_last_token():
    p = Prompt(list(range(10)))
    ex = compare(p, p, BS)
    assert ex.first_diff is None
    assert ex.radix_reuse == 9 and ex.hash_reuse == 8
    assert any("always recomputed" in r for r in ex.reasons)


def test_salt_breaks_the_chain_at_block_zero():
    ex = compare(Prompt(list(range(12)), cache_salt="t1"), Prompt(list(range(12)), cache_salt="t2"), BS)
    assert ex.hash_reuse == ex.radix_reuse == 0 and ex.break_block == 0
    assert "cache salt differs" in ex.reasons[0]
    ex = compare(Prompt(list(range(12)), adapter_id="x"), Prompt(list(range(12))), BS)
    assert ex.radix_reuse == 0 and "adapter id differs" in ex.reasons[0]


def test_against_a_replayed_cache_matches_the_backends():
    earlier = [Prompt(list(range(30))), Prompt(list(range(100, 113))), Prompt(list(range(30)), cache_salt="s")]
    cache = replay(earlier, BS)
    q = Prompt(list(range(14)) + [7, 7, 7])
    res = against_cache(cache, q)
    assert (res.hash_reuse, res.radix_reuse) == (12, 14)
    assert res.closest is earlier[0] and res.explanation.first_diff == 14
    salted = against_cache(cache, Prompt(list(range(30)) + [1], cache_salt="s"))
    assert salted.radix_reuse == 30 and salted.hash_reuse == 28


def test_cli_finds_a_trailing_space_with_the_real_tokenizer(capsys, tmp_path):
    from kvmosaic.cli import main

    system = "You are Mosaic, the support assistant of a tile shop. Answer in one short sentence."
    a = tmp_path / "a.txt"
    a.write_text(system + " When is the showroom open?")
    b = system + "  When is the showroom open?"  # a doubled space
    assert main(["explain", str(a), b, "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "first difference at token" in out and "hash chain breaks at block" in out
    assert "reused for b: hash" in out
    earlier = tmp_path / "earlier.txt"
    earlier.write_text(system + " Where are you?\n" + "Something else entirely.\n")
    assert main(["explain", system + " How much is delivery?", "--against", str(earlier)]) == 0
    out = capsys.readouterr().out
    assert "against 2 cached prompts" in out and "closest earlier prompt: #0" in out


def test_explain_says_from_which_tier_each_block_would_load(tmp_path):
    from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn, make_seed
    from kvmosaic.explain import Prompt, format_tier_sources, tier_sources
    from kvmosaic.tiers import DiskTier, HostTier, TierStack

    seed = make_seed("fp", "float32", 4, "sha256")
    prompt = Prompt(list(range(20)), "tenant", None, "q")
    chain = BlockHasher(CacheNamespace(seed, "tenant"), 4, get_hash_fn("sha256")).update(prompt.tokens)
    host, disk = HostTier(1 << 20, name="host"), DiskTier(tmp_path, 1 << 20, name="disk")
    host.put(chain[0], b"x")
    for h in chain[:3]:
        disk.put(h, b"x")
    disk.put(chain[4], b"x")  # after a gap: never reached
    stack = TierStack([host, disk])
    assert tier_sources(prompt, stack, seed, 4, "sha256") == ["host", "disk", "disk", None, None]
    other = Prompt(prompt.tokens, "another tenant", None, "q")  # the salt is in the chain
    assert tier_sources(other, stack, seed, 4, "sha256") == [None] * 5
    text = format_tier_sources(["host", "disk", "disk", None, None], 4, 20)
    assert "blocks 1-2 (tokens 4-11): from the disk tier" in text and "blocks 3-4" in text
