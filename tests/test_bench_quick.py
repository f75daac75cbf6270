"""Smoke tests of ``kvmosaic bench --quick``: it runs, and writes the table, the JSON and the
plots. They assert no speed (CI machines are too noisy for that)."""

from __future__ import annotations

import json

import pytest

from kvmosaic.cli import main


def _run_quick(tmp_path, workload: str, peers: str) -> tuple[str, dict]:
    rc = main(["bench", workload, "--quick", "--peers", peers, "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    for png in ("ttft_vs_prefix.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return (tmp_path / "bench.md").read_text(), json.loads((tmp_path / "bench.json").read_text())


def test_bench_quick_writes_table_and_plots(tmp_path, capsys):
    table, data = _run_quick(tmp_path, "multi-turn", "kvmosaic-hash,no-such-peer")
    assert "| multi-turn | kvmosaic-hash |" in table
    assert "unknown peer 'no-such-peer'" in table  # skipped with a message, not a crash
    turns = [r for r in data["records"] if r["peer"] == "kvmosaic-hash"]
    assert len(turns) >= 2 and all(r["generated_tokens"] > 0 for r in turns)
    # the second turn's prompt holds the first turn's prompt and answer, so most of it is reusable
    assert turns[1]["reusable_tokens"] >= turns[0]["prompt_tokens"]
    assert turns[1]["cached_tokens"] > 0
    assert "| multi-turn |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_quick_every_peer_kind(tmp_path):
    peers = "kvmosaic-none,kvmosaic-hash,transformers,transformers-prompt-cache,llama-cpp-ramcache"
    table, data = _run_quick(tmp_path, "all", peers)
    for workload in ("shared-system-prompt", "multi-tenant", "multi-turn", "few-shot", "rag-reorder", "no-reuse"):
        assert f"| {workload} | kvmosaic-hash |" in table
        assert f"| {workload} | transformers-prompt-cache |" in table
    assert "## Targets (issue 5)" in table
