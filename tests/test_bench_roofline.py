"""``kvmosaic bench roofline`` and "at X% of the machine": the model's counts read from its own
files (checked against the Llama formula and the GGUF block sizes), the FLOP and byte counts,
the measured roofline, and the shares ``kvmosaic bench serve`` reports."""

from __future__ import annotations

import json

import pytest
import torch

from kvmosaic.bench.machine_share import shares, table
from kvmosaic.bench.model_size import folder_size, model_size
from kvmosaic.bench.roofline import Roofline, measure, model_shapes, read_bandwidth
from kvmosaic.bench.serve_report import LevelResult
from kvmosaic.model import decode_tiles

# The shipped SmolLM2-135M (DESIGN: 30 layers, hidden 576, FFN 1536, 9 heads, 3 KV heads, head
# dim 64, vocabulary 49152, tied embeddings; 2-D tensors Q4_1, the embedding Q8_0, norms F32).
L, H, F, KV, V = 30, 576, 1536, 192, 49152
PER_LAYER = 2 * H * H + 2 * H * KV + 3 * H * F  # q, o, k, v, gate, up, down
NORMS = 2 * L * H + H


def test_shipped_model_counts_follow_from_its_shape_and_formats():
    s = model_size(None)
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size, s.intermediate_size) == (L, 9, 3, 64, H, F)
    assert s.non_embedding_params == L * PER_LAYER + NORMS
    assert s.lm_head_params == V * H  # tied: the embedding is the head
    # Q4_1: 20 bytes per 32 weights; Q8_0: 34 per 32; F32 norms: 4 each.
    assert s.stored_non_embedding_bytes == L * PER_LAYER * 20 // 32 + NORMS * 4
    assert s.stored_lm_head_bytes == V * H * 34 // 32
    assert s.file_format == "GGUF Q4_1"
    assert s.decode_weight_bytes(2.0) == 2.0 * (L * PER_LAYER + NORMS + V * H)  # bfloat16: ~270 MB
    assert model_shapes(None) == [(H, H + 2 * KV), (H, H), (H, 2 * F), (F, H)]


def test_a_safetensors_folder_is_counted_from_its_headers(tmp_path):
    from safetensors.torch import save_file

    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8,
           "intermediate_size": 12, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 8, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(10, 8, dtype=torch.bfloat16),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 12, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    s = folder_size(tmp_path)
    assert (s.non_embedding_params, s.lm_head_params) == (64 + 96 + 8, 80)
    assert (s.stored_non_embedding_bytes, s.stored_lm_head_bytes) == (2 * 168, 160)
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (1, 2, 1, 4)
    assert s.file_format == "safetensors BF16"


def test_prefill_flops_are_dense_plus_causal_attention_and_split_at_a_cached_prefix():
    s = model_size(None)
    attn_per_pair = 4 * L * 9 * 64
    assert s.prefill_flops(1) == 2 * s.non_embedding_params + attn_per_pair
    assert s.prefill_flops(3) == 3 * 2 * s.non_embedding_params + attn_per_pair * (1 + 2 + 3)
    # Computing 700 tokens behind 50 cached ones costs what 750 cost, minus the 50.
    assert s.prefill_flops(700, 50) == pytest.approx(s.prefill_flops(750) - s.prefill_flops(50))


def test_roofline_is_measured_at_the_threads_asked_and_restores_them():
    before = torch.get_num_threads()
    r = measure(1, quick=True)
    assert torch.get_num_threads() == before and r.threads == 1
    for d in ("float32", "bfloat16"):
        readings = (r.gemm_square_gflops[d], r.gemm_model_gflops[d], r.gemm_tile_gflops.get(d, 0.0))
        assert r.gemm_gflops[d] == max(readings) > 0
    # kvmosaic's own tile GEMM is read where it serves (bfloat16 on an AMX CPU), so no share flatters it
    assert set(r.gemm_tile_gflops) == ({"bfloat16"} if decode_tiles.amx_blocks() else set())
    assert ("kvmosaic's tile GEMM" in r.lines()[0]) == bool(r.gemm_tile_gflops)
    assert r.read_gbs > 0 and r.copy_gbs > 0
    assert "GEMM peak at 1 thread(s)" in r.lines()[0] and "GB/s" in r.lines()[1]


def test_roofline_without_readable_model_shapes_keeps_the_square_peak(tmp_path):
    r = measure(1, model=str(tmp_path), quick=True)  # a folder with no config.json
    assert r.gemm_model_gflops == {} and r.gemm_gflops == r.gemm_square_gflops
    assert "model shapes – (not read)" in r.lines()[0]


def test_bench_roofline_writes_bench_json_and_keeps_its_other_entries(tmp_path, capsys):
    from kvmosaic.cli import main

    (tmp_path / "bench.json").write_text(json.dumps({"rows": [1]}))
    assert main(["bench", "roofline", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"] == [1] and data["roofline"]["threads"] == 1 and data["roofline"]["read_gbs"] > 0
    out = capsys.readouterr().out
    assert "machine:" in out and "cores" in out and "GEMM peak" in out


def _row(peer: str, workload: str = "no-reuse", level: float = 1, ttft: float = 0.5, itl: float | None = 0.02,
         prompt: int = 1500, cached: int = 0, requests: int = 2) -> LevelResult:
    return LevelResult(peer, workload, "closed", level, requests, 0, 1.0, prompt, 64, cached, ttft, ttft, itl, itl, 1.0, 1.0)


def test_shares_are_each_peers_c1_no_reuse_against_the_same_roofline():
    s = model_size(None)
    peak = {"float32": 100.0, "bfloat16": 400.0}
    roof = Roofline(2, peak, peak, {"float32": 50.0, "bfloat16": 200.0}, 10.0, 8.0, 2048, 512, 512)
    rows = [_row("kvmosaic-hash"), _row("llama-server", itl=0.01), _row("kvmosaic-hash-int8", cached=100),
            _row("kvmosaic-hash", level=4), _row("kvmosaic-hash", workload="shared-prefix"), _row("vllm-cpu", itl=None)]
    got = {e.peer: e for e in shares(rows, roof, s, "bfloat16")}
    assert set(got) == {"kvmosaic-hash", "llama-server", "kvmosaic-hash-int8", "vllm-cpu"}  # c=1 no-reuse only
    k = got["kvmosaic-hash"]
    assert k.weights == "bfloat16" and k.new_tokens == 750
    assert k.prefill_gflops == pytest.approx(s.prefill_flops(750) / 0.5 / 1e9)
    assert k.prefill_share == pytest.approx(k.prefill_gflops / 400.0)
    assert k.decode_gbs == pytest.approx(s.decode_weight_bytes(2.0) / 0.02 / 1e9)
    assert k.decode_share == pytest.approx(k.decode_gbs / 10.0)
    q = got["llama-server"]  # reads the file's own 4-bit blocks
    assert q.weights == "GGUF Q4_1" and q.decode_gbs == pytest.approx(s.decode_weight_bytes(None) / 0.01 / 1e9)
    i8 = got["kvmosaic-hash-int8"]  # one byte a weight; 50 of each 750-token prompt were cached
    assert i8.weights == "int8" and i8.new_tokens == 700
    assert i8.prefill_gflops == pytest.approx(s.prefill_flops(700, 50) / 0.5 / 1e9)
    assert got["vllm-cpu"].decode_gbs is None
    md = table(list(got.values()), roof, "bfloat16")
    assert "At X% of the machine" in md and "| kvmosaic-hash | bfloat16 | 750 |" in md
    assert f"| {k.prefill_share:.0%} |" in md and "| vllm-cpu |" in md
    assert "| 10.0 (run start) |" in md  # no readings around these levels: the run's first


def test_the_decode_share_is_of_the_bandwidth_read_around_its_level():
    """The readings taken right before and after a peer's c=1 level (a JSON round trip makes the
    pair a list) are what its decode share divides by, not the run's first reading."""
    s = model_size(None)
    peak = {"float32": 100.0, "bfloat16": 400.0}
    roof = Roofline(2, peak, peak, peak, 60.0, 50.0, 2048, 512, 512)
    row = _row("kvmosaic-hash")
    row.read_gbs_around = [30.0, 40.0]
    (k,) = shares([row], roof, s, "bfloat16")
    assert k.read_gbs == 35.0 and k.read_around == (30.0, 40.0)
    assert k.decode_share == pytest.approx(k.decode_gbs / 35.0)
    md = table([k], roof, "bfloat16")
    assert f"| 30.0 / 40.0 | {k.decode_share:.0%} |" in md


def test_the_paired_decode_share_is_each_requests_own_reading():
    """Each paired request's ITL is divided by the reading taken right before it: a request in a slow
    minute beside a slow reading counts at its own share, whatever the level's readings were; the
    median and range of those shares are reported (a JSON round trip makes each pair a list)."""
    s = model_size(None)
    peak = {"float32": 100.0, "bfloat16": 400.0}
    roof = Roofline(2, peak, peak, peak, 60.0, 50.0, 2048, 512, 512)
    step = s.decode_weight_bytes(2.0) / 1e9  # GB a step
    row = _row("kvmosaic-hash", itl=step / 40.0)  # the level: 40 GB/s ...
    row.read_gbs_around = [80.0, 80.0]  # ... between two fast readings: 50%
    row.decode_pairs = [[80.0, step / 60.0], [50.0, step / 40.0], [80.0, step / 56.0]]  # 75%, 80%, 70%
    (k,) = shares([row], roof, s, "bfloat16")
    assert k.decode_share == pytest.approx(0.5)
    assert k.paired_share == pytest.approx(0.75) and k.paired_range == pytest.approx((0.70, 0.80))
    md = table([k], roof, "bfloat16")
    assert "| 50% | 75% (70%–80%) |" in md
    (none,) = shares([_row("vllm-cpu")], roof, s, "bfloat16")  # no pairs taken: no paired share
    assert none.paired_share is None and none.paired_range is None and md.count("|") > 0
    assert table([none], roof, "bfloat16").rstrip().endswith("| – |")


def test_one_read_bandwidth_reading_at_the_threads_asked_for():
    import torch

    before = torch.get_num_threads()
    assert read_bandwidth(1, quick=True) > 0
    assert torch.get_num_threads() == before


def test_a_read_probe_reads_its_one_buffer_at_the_threads_asked_for(monkeypatch):
    """Readings over the buffer made with the probe (no allocation per reading: one before a request
    slowed that request's decode), within the range read_bandwidth gives, torch's threads as before."""
    import torch

    from kvmosaic.bench.roofline import ReadProbe

    monkeypatch.setattr(ReadProbe, "SETTLE_S", 0.0)
    before = torch.get_num_threads()
    probe = ReadProbe(1, quick=True)
    buffer = probe.buffer.data_ptr()
    readings = [probe.read() for _ in range(3)]
    assert all(r > 0 for r in readings) and probe.buffer.data_ptr() == buffer
    assert probe.buffer.numel() * 4 == 128 * 2**20  # --quick's buffer, as read_bandwidth's
    assert torch.get_num_threads() == before
