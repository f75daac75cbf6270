"""``kvmosaic bench serve``: its statistics and report (fast), and one tiny run against a real
``kvmosaic serve`` (slow: it starts a server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmosaic.bench import serving
from kvmosaic.bench.serving import LevelResult, RequestResult, inter_token_gaps, percentile, summarize_level


def test_percentiles_and_inter_token_gaps():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    # the first chunk is TTFT, not a gap
    assert inter_token_gaps([0.5, 0.6, 0.8, 1.1]) == pytest.approx([0.1, 0.2, 0.3])
    assert inter_token_gaps([0.5]) == []
    assert inter_token_gaps([]) == []


def _result(ttft: float, gaps: list[float], prompt=100, completion=4, cached=64) -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(ok=True, start=0.0, ttft=ttft, e2e=times[-1], chunk_times=times, prompt_tokens=prompt,
                         completion_tokens=completion, cached_tokens=cached, usage_reported=True)


def test_summarize_level_pools_gaps_and_counts_tokens():
    res = [_result(0.1, [0.01, 0.02, 0.03]), _result(0.3, [0.05, 0.05, 0.05], cached=0),
           RequestResult(ok=False, start=0.0, error="APIConnectionError: refused")]
    row = summarize_level("kvmosaic-hash", "shared-prefix", "closed", 4, res, wall_s=2.0,
                          pool={"blocks_used_peak": 12, "num_blocks": 100, "pool_util": 0.8})
    assert (row.requests, row.failed) == (2, 1)
    assert row.ttft_p50 == pytest.approx(0.2)
    assert row.itl_p50 == pytest.approx(0.04)  # median of 0.01 0.02 0.03 0.05 0.05 0.05
    assert row.itl_p99 == pytest.approx(0.05)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (200, 8, 64)
    assert row.output_tps == pytest.approx(4.0) and row.total_tps == pytest.approx(104.0)
    assert row.errors == ["APIConnectionError: refused"] and row.blocks_used_peak == 12
    assert row.usage_reported
    res[1].usage_reported = False  # a server that sends no usage: cached tokens unknown, shown n/a
    row = summarize_level("llama-cpp-server", "shared-prefix", "closed", 4, res, wall_s=2.0)
    assert not row.usage_reported and "| n/a |" in serving.table([row])
    assert row.server_cpu_s is None and "| – | – |" in serving.table([row])  # no CPU figures: –


def test_server_cpu_seconds_are_reported_with_cores_and_processes():
    row = summarize_level("vllm-cpu", "shared-prefix", "closed", 4, [_result(0.1, [0.01])], wall_s=2.0, cpu=(3.0, 2))
    assert (row.server_cpu_s, row.server_procs) == (3.0, 2)
    assert serving.format_cpu(row) == "3.0 (1.5, 2)"  # 3 CPU s over 2 s of wall time: 1.5 cores, 2 processes
    assert "| 3.0 (1.5, 2) |" in serving.table([row])


def _row(peer: str, level: int, tps: float) -> LevelResult:
    return LevelResult(peer=peer, workload="shared-prefix", mode="closed", level=level, requests=4, failed=0, wall_s=1.0,
                       prompt_tokens=400, completion_tokens=32, cached_tokens=300, ttft_p50=0.25, ttft_p99=1.5,
                       itl_p50=0.02, itl_p99=0.1, output_tps=32.0, total_tps=tps)


def test_report_table_has_every_row_and_the_ratio_to_the_best_peer():
    rows = [_row("kvmosaic-hash", 1, 300.0), _row("kvmosaic-none", 1, 100.0), _row("transformers-serve", 1, 150.0),
            _row("kvmosaic-hash-int8", 1, 900.0), _row("kvmosaic-hash", 4, 600.0)]  # kvmosaic rows are not peers
    md = serving.render(rows, {"command": "`kvmosaic bench serve`"}, ["llama-cpp-server skipped: not installed"], ["a.png"])
    lines = [ln for ln in md.splitlines() if ln.startswith("| shared-prefix")]
    assert len(lines) == 5
    hash1 = next(ln for ln in lines if "kvmosaic-hash | c=1 |" in ln)
    assert "| 250 | 1,500 | 20 | 100 |" in hash1  # TTFT p50/p99, ITL p50/p99 in ms
    assert hash1.rstrip().endswith("| 2.00x |")  # 300 / the best other peer's 150
    assert "| 300 (75%) |" in hash1  # cached tokens and their share
    assert next(ln for ln in lines if "c=4" in ln).rstrip().endswith("| – |")  # no peer at that level
    assert "- skipped: llama-cpp-server skipped" in md and "![a.png](a.png)" in md
    assert "kv.num_used_slots" in md  # the /health field the exact pool utilisation needs


def test_workloads_share_a_prefix_only_within_one_level():
    sizes = serving.QUICK
    a = serving.serve_requests("shared-prefix", 3, sizes, 0, "closed-1")
    b = serving.serve_requests("shared-prefix", 3, sizes, 0, "closed-4")
    assert a[0][0] == a[1][0] == a[2][0] and a[0][1] != a[1][1]
    assert a[0][0] != b[0][0]  # a fresh system prompt per level: no hits carried over
    n = serving.serve_requests("no-reuse", 3, sizes, 0, "closed-1")
    assert len({m[0]["content"][:30] for m in n}) == 3
    with pytest.raises(ValueError):
        serving.serve_requests("nope", 1, sizes, 0, "x")


@pytest.mark.slow
def test_bench_serve_tiny_run_against_one_kvmosaic_server(tmp_path):
    from kvmosaic.cli import main

    rc = main(["bench", "serve", "--quick", "--peers", "kvmosaic-hash", "--serve-workloads", "shared-prefix,no-reuse",
               "--concurrency", "2,1", "--requests", "2", "--max-tokens", "24", "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    row = next(r for r in data["rows"] if r["workload"] == "shared-prefix" and r["level"] == 2)
    assert row["peer"] == "kvmosaic-hash" and row["requests"] == 2 and row["failed"] == 0
    assert row["completion_tokens"] == 48 and row["ttft_p50"] > 0 and row["total_tps"] > 0
    # /health is sampled every 0.25 s: 24 tokens keep the level running through several samples (at 3 the
    # level could end before the first one that saw a request, and the peak read 0)
    assert row["num_blocks"] and row["blocks_used_peak"] >= 1
    assert "| shared-prefix | kvmosaic-hash | c=2 |" in (tmp_path / "serve.md").read_text()
    # The roofline is measured at the start of every run; the shares come from the c=1 no-reuse level, its
    # requests sent again one at a time after it, each after a bandwidth reading of its own.
    assert data["roofline"]["read_gbs"] > 0
    (share,) = data["machine_share"]
    level = next(r for r in data["rows"] if r["workload"] == "no-reuse" and r["level"] == 1)
    assert len(level["read_gbs_around"]) == 2 and len(level["decode_pairs"]) == 2
    assert share["decode_share"] > 0 and share["paired_share"] > 0 and share["paired_range"][0] <= share["paired_share"]
    for png in ("serve_throughput.png", "serve_ttft.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_kvmosaic_peer_can_be_served_from_another_checkout(tmp_path):
    """kvmosaic-hash@PATH runs `kvmosaic serve` on the code at PATH (an earlier revision, to
    compare against in one run); anything else after @ is refused with the reason."""
    from pathlib import Path

    from kvmosaic.bench.serving import make_server_peer, unavailable_reason

    checkout = Path(__file__).resolve().parents[1]
    assert unavailable_reason(f"kvmosaic-hash@{checkout}") is None
    assert "not a kvmosaic checkout" in unavailable_reason(f"kvmosaic-hash@{tmp_path}")
    assert "only kvmosaic peers" in unavailable_reason(f"llama-cpp-server@{checkout}")
    peer = make_server_peer(f"kvmosaic-radix@{checkout}", "float32", None, None)
    argv = peer.server.args
    assert argv[argv.index("--prefix-cache") + 1] == "radix"
    # the server imports the code at PATH, even started from this checkout's root (where `python -m`
    # would put this checkout's kvmosaic first on sys.path)
    other = tmp_path / "other"
    (other / "kvmosaic").mkdir(parents=True)
    (other / "kvmosaic" / "__init__.py").write_text("")
    prefix = make_server_peer(f"kvmosaic-hash@{other}", "float32", None, None).server.args
    prefix = prefix[: prefix.index(sys.executable)]
    imported = subprocess.run([*prefix, sys.executable, "-c", "import kvmosaic; print(kvmosaic.__file__)"],
                              cwd=checkout, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported) == other / "kvmosaic" / "__init__.py"


@pytest.mark.parametrize("amx", [True, False])
def test_llama_server_runs_without_its_amx_repacking_where_the_cpu_has_amx(amx, monkeypatch, tmp_path):
    """llama.cpp's AMX path dies of SIGILL on the AMX Xeon it was measured on: there the peer is
    started with ``--no-repack``; elsewhere with its defaults."""
    import torch

    from kvmosaic.bench import serve_peers

    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("KVMOSAIC_LLAMA_SERVER", str(exe))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    argv = serve_peers.llama_server_argv(tmp_path / "model.gguf", threads=2)
    assert argv[0] == str(exe) and argv[argv.index("-t") + 1] == "2"
    assert ("--no-repack" in argv) is amx


def test_both_clients_time_the_same_streams_and_report_a_refusal():
    """``--client aiohttp`` (event lines, as vLLM's bench reads them) and ``--client openai`` send
    the same body and count the same tokens from a real server's streams; a request the server
    refuses is a failed result with the server's status, not an exception. The paired decode
    share's requests go one at a time through either, each after its own bandwidth reading."""
    import asyncio

    from kvmosaic.bench.roofline import ReadProbe
    from kvmosaic.bench.serve_client import CLIENTS, paired_decode, run_level
    from kvmosaic.bench.serve_peers import make_server_peer

    peer = make_server_peer("kvmosaic-hash", "float32", None, None, "--num-kv-blocks 64 --max-model-len 256")
    try:
        peer.start()
        convs = [[{"role": "user", "content": f"Count to ten, then say {w}."}] for w in ("red", "blue")]
        seen = {}
        for n, kind in enumerate((*CLIENTS, CLIENTS[0])):  # after the first pass the prompts are cached
            results, wall, _ = asyncio.run(run_level(peer, convs, 6, 2, None, 0, [0, 0], kind))
            assert wall > 0 and all(r.ok for r in results), [r.error for r in results]
            # (a server behind on its stream sends two tokens' text in one chunk: chunks are at most the tokens)
            seen[kind] = [(r.prompt_tokens, r.completion_tokens, r.usage_reported) for r in results]
            assert all(r.completion_tokens == 6 and r.prompt_tokens > 16 and 0 < r.ttft <= r.e2e
                       and 1 <= len(r.chunk_times) <= 6 for r in results)
            assert all(r.chunk_times == sorted(r.chunk_times) for r in results)
            cached = [r.cached_tokens for r in results]
            assert (min(cached) == 0) if n == 0 else min(cached) >= 16, cached  # a fresh server: one prompt is new
        assert seen["aiohttp"] == seen["openai"]
        # the paired decode share's requests: one at a time, each right after a reading of its own
        readings, probe = [], ReadProbe(1, quick=True)

        def read() -> float:
            readings.append(probe.read())
            return readings[-1]

        for kind in CLIENTS:
            readings.clear()
            pairs = asyncio.run(paired_decode(peer, convs, 12, kind, read))
            assert len(readings) == 2 and pairs and all(itl > 0 for _, itl in pairs)
            assert [gbs for gbs, _ in pairs] == [g for g in readings if g in dict(pairs)]  # each its own, in order
        # 300 new tokens do not fit a 256-token context: the server answers 400, the client reports it
        for kind in CLIENTS:
            (refused,), _, _ = asyncio.run(run_level(peer, convs[:1], 300, 1, None, 0, [0], kind))
            assert not refused.ok and "400" in refused.error, refused.error
        assert asyncio.run(paired_decode(peer, convs[:1], 300, CLIENTS[0], read)) == []  # a refusal: no pair
    finally:
        peer.stop()
