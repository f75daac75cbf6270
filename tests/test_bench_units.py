"""Fast checks of the benchmark's pieces (no model is loaded)."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.bench.benchmarks_md import SECTION, replace_section
from kvmosaic.bench.hf_prompt_cache import PromptCacheStore
from kvmosaic.bench.peers import unavailable_reason
from kvmosaic.bench.summary import pick_reference
from kvmosaic.bench.workloads import BUILDERS, build
from kvmosaic.cache.radix_tree import common_prefix_len


def test_workloads_are_deterministic_and_seeded():
    for name in BUILDERS:
        assert build(name, 7) == build(name, 7)
        assert build(name, 7) != build(name, 8)
        assert build(name, 7, quick=True).requests


def test_shared_prefix_workloads_share_their_system_prompt():
    wl = build("shared-system-prompt", 0)
    assert len({r.messages[0]["content"] for r in wl.requests}) == 1
    assert len({r.messages[1]["content"] for r in wl.requests}) == len(wl.requests)
    tenants = {r.messages[0]["content"] for r in build("multi-tenant", 0).requests}
    assert len(tenants) > 1


def test_no_reuse_prompts_start_differently():
    firsts = [r.text.split()[:3] for r in build("no-reuse", 0).requests]
    assert len({tuple(f) for f in firsts}) == len(firsts)


def test_multi_turn_later_turns_continue_a_conversation():
    reqs = build("multi-turn", 0).requests
    later = [r for r in reqs if len(r.messages) == 1]
    assert later and all(r.conversation for r in later)


class _FakeCache:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n

    def crop(self, k):
        assert k < 0
        self.n += k


def test_prompt_cache_store_finds_longest_prefix_and_crops():
    store = PromptCacheStore(bytes_per_token=1)
    store.insert([1, 2, 3, 4, 5], _FakeCache(5))
    store.insert([1, 2, 9, 9], _FakeCache(4))
    cache, n = store.lookup([1, 2, 3, 4, 7, 8])
    assert n == 4 and cache.n == 4
    cache, n = store.lookup([1, 2, 3])
    assert n == 2  # the last prompt token is always computed
    assert store.lookup([5, 6]) == (None, 0)
    store.insert([1, 2, 3, 4, 5, 6], _FakeCache(6))  # extends, so replaces, the first entry
    assert (1, 2, 3, 4, 5) not in store.entries


def test_prompt_cache_store_respects_its_budget():
    store = PromptCacheStore(bytes_per_token=10, capacity_bytes=100)
    store.insert(list(range(6)), _FakeCache(6))
    store.insert(list(range(100, 106)), _FakeCache(6))
    assert list(store.entries) == [tuple(range(100, 106))]


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len(torch.tensor([1]).tolist(), []) == 0


def test_replace_section_keeps_other_sections():
    doc = "# Benchmarks\n\n## Other\n\nkeep me\n"
    once = replace_section(doc, SECTION, "table v1")
    assert "keep me" in once and "table v1" in once
    twice = replace_section(once + "\n## Later\n\nalso kept\n", SECTION, "table v2")
    assert "table v1" not in twice and "table v2" in twice and "also kept" in twice and "keep me" in twice


def test_unknown_peer_and_reference():
    assert "unknown peer" in unavailable_reason("nope")
    assert unavailable_reason("kvmosaic-hash") is None
    assert pick_reference(["transformers", "kvmosaic-none", "kvmosaic-radix"], "kvmosaic-hash") == "kvmosaic-radix"


def test_rag_reorder_quality_workload():
    from benchmarks import blend_quality as bq

    reqs = bq.requests(20)
    for prompt, answer in reqs:
        assert sorted(prompt["segments"]) == sorted(bq.DOCS)
        assert sum(answer.lower() in d.lower() for d in prompt["segments"]) == 1  # one document states it
    assert len({tuple(p["segments"]) for p, _ in reqs}) > 15  # the orders differ
    assert bq.requests(5, seed=1) != bq.requests(5)
    ratios = {c.ratio for c in bq.configs() if c.kind == "blend"}
    assert {0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 1.0} <= ratios
    assert {"full", "prefix", "shift", "random", "threshold"} <= {c.kind for c in bq.configs()}


def test_auto_reuse_rag_workloads():
    """Short and long RAG prompts: five documents in random order, the answer stated in one (in two
    quarters of a long one, at times), plain text (no markup) after the prefix the cache holds."""
    import random

    from benchmarks import auto_reuse_workloads as ar

    for make, pool, size in ((ar.rag_requests, ar.POOL, 20), (ar.rag_long_requests, ar.DOCS, 5)):
        reqs = make(12, random.Random(0), None, False)  # text form: no tokenizer
        assert len(pool) == size
        for r in reqs:
            assert len(r.docs) == 5 == len(set(r.docs)) and set(r.docs) <= set(pool)
            assert any(r.answer in d for d in r.docs)
            assert r.prompt.startswith(r.warm) and all(d in r.prompt for d in r.docs)
            assert "<|" not in r.prompt  # a completion prompt: no chat template written out (that is rag-chat)
        assert len({tuple(r.docs) for r in reqs}) > 8  # the orders differ
    assert max(len(d.split()) for d in ar.POOL) < 100 < 200 < min(len(d.split()) for d in ar.DOCS)


def test_auto_reuse_counts_the_answers_behind_an_accuracy_difference():
    """The table's paired count: answers full prefill got that auto missed, and the reverse; none where the
    workload has no checkable answer (NaN)."""
    from benchmarks import auto_reuse as ar

    s = ar.Stats()
    for full, auto in ((1.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.0, 0.0)):
        s.add(acc_full=full, acc_auto=auto)
    assert ar.answers(s) == " (2, 1)"
    nan = ar.Stats()
    nan.add(acc_full=float("nan"), acc_auto=float("nan"))
    assert ar.answers(nan) == "" == ar.answers(ar.Stats())


def test_kernel_ab_builds_from_a_revisions_sources(tmp_path):
    """``benchmarks/kernel_ab.py``'s build A or B from a git revision: every kernel source and header as that
    revision holds it, beside each other (the headers are included by name), the .c files returned."""
    import subprocess

    from benchmarks import kernel_ab
    from kvmosaic.model import kernels

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=kernel_ab.ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    got = kernel_ab.sources_at("HEAD", tmp_path)
    assert [p.name for p in got] == [p.name for p in kernels.SOURCES] and all(p.parent == tmp_path for p in got)
    for path in kernels.SOURCES + kernels.HEADERS:
        rel = path.resolve().relative_to(kernel_ab.ROOT).as_posix()
        want = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=kernel_ab.ROOT, capture_output=True, check=True).stdout
        assert (tmp_path / path.name).read_bytes() == want
    assert kernel_ab.sources_at(None, tmp_path) == list(kernels.SOURCES)


def test_kl_of_log_probabilities():
    from benchmarks.blend_quality import kl

    p = torch.log_softmax(torch.randn(4, 50), -1)
    q = torch.log_softmax(torch.randn(4, 50), -1)
    assert torch.allclose(kl(p, p), torch.zeros(4), atol=1e-6)
    assert (kl(p, q) > 0).all()
    ref = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl(p, q), ref, atol=1e-5)


def test_scale_configs_fit_the_cores_and_ratios_add_up():
    from kvmosaic.bench.scale import CACHE_AWARE, FRONT, ROUND_ROBIN, SINGLE, configs, pooled_hit_rate, ratios
    from kvmosaic.bench.serve_report import LevelResult

    flags = configs(2, "float32", 100, [])
    assert flags[SINGLE][flags[SINGLE].index("--num-kv-blocks") + 1] == "200"  # as many blocks as both replicas
    for name in (CACHE_AWARE, ROUND_ROBIN):  # two replicas fit on 2 cores (the front reserves none)
        f = flags[name]
        assert 2 * float(f[f.index("--replica-cpus") + 1]) <= 2 and f[f.index("--num-threads") + 1] == "1"
    assert flags[FRONT][:len(flags[SINGLE])] == flags[SINGLE]  # the same engine flags as the single server

    def row(peer, wl, ttft, tps, cached, prompt=1000):
        return LevelResult(peer, wl, "closed", 1, 4, 0, 1.0, prompt, 64, cached, ttft, ttft, None, None, tps, tps)

    rows = [row(SINGLE, "shared-prefix", 0.100, 40, 800), row(FRONT, "shared-prefix", 0.112, 38, 800),
            row(CACHE_AWARE, "multi-tenant", 0.2, 20, 600), row(ROUND_ROBIN, "multi-tenant", 0.3, 10, 300),
            row(SINGLE, "multi-tenant", 0.2, 40, 700)]
    lines = ratios(rows)
    assert any("front overhead" in line and "+12.0 ms" in line for line in lines)
    assert any(f"{CACHE_AWARE} / {SINGLE} output tok/s = 0.50" in line for line in lines)
    assert any(line.startswith("multi-tenant, all levels") and line.endswith("= 2.00") for line in lines)
    assert pooled_hit_rate(rows + [row(CACHE_AWARE, "multi-tenant", 0.2, 20, 0)], CACHE_AWARE, "multi-tenant") == 0.3
    assert "n/a (round-robin 0)" in ratios([row(CACHE_AWARE, "multi-tenant", 0.2, 20, 5),
                                            row(ROUND_ROBIN, "multi-tenant", 0.2, 20, 0)])[-1]


def test_the_oracles_deviation_and_choice():
    from benchmarks.auto_reuse_oracle import oracle_picker, true_deviation

    g = torch.Generator().manual_seed(0)
    exact = torch.randn(3, 2, 5, 2, 4, generator=g)  # [layers, K/V, tokens, kv heads, head dim]
    assert torch.equal(true_deviation(exact, exact), torch.zeros(5))
    placed = exact.clone()
    placed[1, :, 2] *= 1.5  # token 2 off by half its norm at one layer of three
    placed[:, 0, 4] = 0  # token 4's K gone at every layer
    dev = true_deviation(exact, placed)
    assert dev[2] == pytest.approx(0.5 / 3, rel=1e-5)
    k_share = exact[:, 0, 4].flatten(1).norm(dim=-1) / exact[:, :, 4].flatten(1).norm(dim=-1)
    assert dev[4] == pytest.approx(float(k_share.mean()), rel=1e-5)
    assert dev[[0, 1, 3]].abs().max() == 0

    def engine(scores, attention):  # what the engine would choose: its count is what the oracle keeps
        return torch.tensor([0, 1])

    pick = oracle_picker(engine, dev)
    assert pick(torch.rand(5), torch.rand(5)).tolist() == [2, 4]  # the two truly furthest, in position order
