""""At X% of the machine": each peer's prefill and decode at c=1 of ``kvmosaic bench serve``'s
no-reuse workload, as fractions of the roofline (:mod:`.roofline`) measured in the same run with
the same threads.

- prefill GFLOP/s = (2 x non-embedding params x new prompt tokens + causal attention FLOPs) /
  TTFT p50, against the GEMM peak in the run's dtype. TTFT also holds the request's HTTP round
  trip and the first token's sampling, so the fraction is a lower bound on the prefill's own.
- decode GB/s = weight bytes one step reads (every non-embedding weight and the LM head, in the
  peer's weight format) / ITL p50, against the read bandwidth measured right before and right after
  that peer's level (their mean; the run's first reading where a level has none): on the VMs this
  was measured on the reading moved between ~33 and ~60 GB/s from one minute to the next, so one
  reading at the run's start made the share a matter of timing. KV reads are not counted (at ~750
  tokens of context a few percent of the weights in bfloat16).
- paired decode share: the same bytes / each of a few requests' own ITL p50, sent one at a time after
  the level, each right after a reading of its own (``serving.PAIRED_REQUESTS``,
  ``serve_client.paired_decode``) — the median and range of those shares. The Zen 5 VM's bandwidth
  flips between two modes within seconds: a level can run in one mode between two readings in the
  other; a request and the reading right before it share their mode. The level's readings and the
  pairs' come from one buffer kept for the level (``roofline.ReadProbe``): a fresh allocation for
  each reading slowed the request after it.

Parameter counts and stored bytes come from the model's own files (:mod:`.model_size`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .model_size import ModelSize
from .roofline import Roofline
from .serve_report import LevelResult, format_ms

SHARE_WORKLOAD = "no-reuse"
BYTES = {"float32": 4.0, "bfloat16": 2.0}
# Peers that serve the GGUF's own format (its 4-bit blocks), whatever --dtype says, counted as the
# file stores them. kvmosaic's gguf path reads the blocks' scales widened to float32 (Q4_1: 24 bytes
# a block, not 20), and in bfloat16 its Q8_0 head as bfloat16: its bytes are undercounted by ~20%
# (float32) or ~28 MB a step more (bfloat16) for the shipped model.
FILE_FORMAT_PEERS = ("llama-server", "llama-cpp-server", "kvmosaic-hash-gguf")
INT8_PEERS = ("kvmosaic-hash-int8",)


@dataclass(frozen=True)
class MachineShare:
    peer: str
    weights: str
    new_tokens: float
    ttft_s: float
    prefill_gflops: float
    prefill_share: float  # of the GEMM peak in the run's dtype
    itl_s: float | None
    decode_gbs: float | None
    decode_share: float | None  # of read_gbs
    read_gbs: float = 0.0  # the read bandwidth the decode share is of
    read_around: tuple[float, float] | None = None  # the readings before and after the level, where taken
    paired_share: float | None = None  # median over the paired requests of their share of their own reading
    paired_range: tuple[float, float] | None = None  # the lowest and highest of those shares


def weight_format(peer: str, dtype: str, size: ModelSize) -> tuple[str, float | None]:
    """(label, bytes per weight; None: as the file stores them) of the weights ``peer`` reads."""
    base = peer.split("@", 1)[0]
    if base in FILE_FORMAT_PEERS:
        return size.file_format, None
    if base in INT8_PEERS:
        return "int8", 1.0
    return dtype, BYTES[dtype]


def shares(rows: list[LevelResult], roofline: Roofline, size: ModelSize, dtype: str) -> list[MachineShare]:
    """One entry per peer with a closed-loop c=1 level of the no-reuse workload and a TTFT."""
    out = []
    for r in rows:
        if (r.workload, r.mode, r.level) != (SHARE_WORKLOAD, "closed", 1) or not r.requests or not r.ttft_p50:
            continue
        new = (r.prompt_tokens - r.cached_tokens) / r.requests
        cached = r.cached_tokens / r.requests
        gflops = size.prefill_flops(new, cached) / r.ttft_p50 / 1e9
        label, per_weight = weight_format(r.peer, dtype, size)
        step_bytes = size.decode_weight_bytes(per_weight)
        gbs = step_bytes / r.itl_p50 / 1e9 if r.itl_p50 else None
        read = sum(r.read_gbs_around) / 2 if r.read_gbs_around else roofline.read_gbs
        paired = sorted(step_bytes / itl / 1e9 / gbs for gbs, itl in r.decode_pairs or [] if itl > 0 and gbs > 0)
        out.append(MachineShare(r.peer, label, new, r.ttft_p50, gflops, gflops / roofline.gemm_gflops[dtype],
                                r.itl_p50, gbs, gbs / read if gbs is not None else None, read,
                                tuple(r.read_gbs_around) if r.read_gbs_around else None,
                                statistics.median(paired) if paired else None,
                                (paired[0], paired[-1]) if paired else None))
    return out


def table(entries: list[MachineShare], roofline: Roofline, dtype: str) -> str:
    """The markdown section: the roofline, then one row per peer."""
    lines = [f"## At X% of the machine ({SHARE_WORKLOAD}, c=1)", "",
             *[f"- {line}" for line in roofline.lines()],
             f"- prefill share: of the {dtype} GEMM peak ({roofline.gemm_gflops[dtype]:,.0f} GFLOP/s); decode share: of "
             "the read bandwidth measured right before and after the peer's level (their mean); see "
             "kvmosaic/bench/machine_share.py for the counts; paired: requests sent one at a time after the level, "
             "each right after a reading of its own (median and range of their shares)", "",
             "| engine | weights | new prompt tok | TTFT p50 ms | prefill GFLOP/s | at % of GEMM peak | ITL p50 ms "
             "| decode weight GB/s | read GB/s before / after | at % of bandwidth | paired: at % of own reading |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        decode = ("–", "–") if e.decode_gbs is None else (f"{e.decode_gbs:,.1f}", f"{e.decode_share:.0%}")
        read = f"{e.read_around[0]:,.1f} / {e.read_around[1]:,.1f}" if e.read_around else f"{e.read_gbs:,.1f} (run start)"
        paired = "–" if e.paired_share is None else \
            f"{e.paired_share:.0%} ({e.paired_range[0]:.0%}–{e.paired_range[1]:.0%})"
        lines.append(f"| {e.peer} | {e.weights} | {e.new_tokens:,.0f} | {format_ms(e.ttft_s)} | {e.prefill_gflops:,.0f} "
                     f"| {e.prefill_share:.0%} | {format_ms(e.itl_s)} | {decode[0]} | {read} | {decode[1]} | {paired} |")
    return "\n".join(lines)
