"""Smoke test of ``kvmosaic bench --quick``: it runs, and writes the table, the JSON and the
plots. It asserts no speed (CI machines are too noisy for that)."""

from __future__ import annotations

import json

from kvmosaic.cli import main


def test_bench_quick_writes_table_and_plots(tmp_path, capsys):
    peers = "kvmosaic-hash,transformers-prompt-cache,no-such-peer"
    rc = main(["bench", "multi-turn", "--quick", "--peers", peers, "--dtype", "float32",
               "--out", str(tmp_path)])
    assert rc == 0
    table = (tmp_path / "bench.md").read_text()
    assert "| multi-turn | kvmosaic-hash |" in table
    assert "| multi-turn | transformers-prompt-cache |" in table
    assert "unknown peer 'no-such-peer'" in table  # skipped with a message, not a crash
    for png in ("ttft_vs_prefix.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "bench.json").read_text())
    turns = [r for r in data["records"] if r["peer"] == "kvmosaic-hash"]
    assert len(turns) >= 2 and all(r["generated_tokens"] > 0 for r in turns)
    # the second turn's prompt holds the first turn's prompt and answer, so most of it is reusable
    assert turns[1]["reusable_tokens"] >= turns[0]["prompt_tokens"]
    assert "| multi-turn |" in capsys.readouterr().out
