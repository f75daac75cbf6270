"""The engine's options, declared once: :class:`EngineArgs` (vLLM's ``engine/arg_utils.py`` is
the pattern).

Each field is an :func:`option`: its default, its help and how the command line spells it.
From that one declaration come the ``kvmosaic serve`` flags (:meth:`EngineArgs.add_cli_args`),
the values a Ray replica receives (an ``EngineArgs`` is a plain picklable dataclass) and the
validated :class:`~kvmosaic.engine.config.EngineConfig`, which *is* an ``EngineArgs`` (a
subclass adding validation and the machine-dependent choices: ``dtype="auto"`` resolves where
the engine runs, not where the command was typed). So one server and every replica are built
from the same values by the same code; ``tests/test_args.py`` walks every field.
See docs/ARCHITECTURE.md ("One set of arguments").
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import EngineConfig

PREFIX_CACHES = ("hash", "radix", "none")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
SEGMENT_REUSE_MODES = ("off", "shift", "blend", "auto")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxh3_128")
QUANTIZATION_CHOICES = ("int8", "gguf")  # model.quant.QUANTIZATIONS
USAGE_CONTEXTS = ("llm", "server")
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority")  # cache.eviction.POLICIES

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


def memory_size(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``1.5GB`` -> bytes (powers of 1024)."""
    m = SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1G or 512M)")
    return int(float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower()))


def option(default: Any = None, help: str = "", *, factory: Callable[[], Any] | None = None,
           choices: tuple | None = None, type: Callable[[str], Any] | None = None, metavar: str | None = None,
           flag: str | None = None, append: bool = False, cli: bool = True, group: str | None = None,
           repr: bool = True) -> Any:
    """A dataclass field that knows its command-line flag: ``--field-name`` unless ``flag``;
    a bool becomes ``--x/--no-x``; ``append`` makes it repeatable (a list). ``cli=False``: set
    by code only (the server sets it from its own options); ``group``: the ``--help`` section."""
    meta = {"help": help, "choices": choices, "type": type, "metavar": metavar, "flag": flag,
            "append": append, "cli": cli, "group": group}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, section: str) -> None:
    """One flag per :func:`option` field of ``cls``, in ``--help`` section ``section`` unless the
    field names its own. Every flag defaults to None ("not given"), so :func:`values_given`
    keeps the dataclass's own default for what the user left out."""
    groups: dict[str, Any] = {}
    for f in fields(cls):
        m = f.metadata
        if not m.get("cli", False):
            continue
        title = m["group"] or section
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": m["help"] or None}
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update({k: m[k] for k in ("choices", "type", "metavar") if m[k] is not None})
            if m["append"]:
                kw["action"] = "append"
            elif m["type"] is None and f.default is not None and not callable(f.default):
                kw["type"] = type(f.default)
        if f.default not in (dataclasses.MISSING, None) and not isinstance(f.default, bool) and f.repr:
            kw["help"] = f"{kw['help'] or ''} (default: {f.default})".strip()
        group.add_argument(flag_of(f), **kw)


def values_given(cls, ns: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` the command line set (not None)."""
    return {f.name: getattr(ns, f.name) for f in fields(cls) if getattr(ns, f.name, None) is not None}


class CliArgs:
    """A dataclass of :func:`option` fields as a command line: its flags (in ``--help`` section
    ``SECTION``), made from a parsed namespace, and its values as a dict."""

    SECTION = "options"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls, cls.SECTION)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace):
        return cls(**values_given(cls, ns))

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class EngineArgs(CliArgs):
    """Every engine option as given, unresolved (see the module docstring). Names follow
    vLLM's engine arguments."""

    SECTION = "engine"

    model: str | None = option(None, "GGUF file, safetensors folder, or org/name in the local Hugging Face "
                                     "cache (default: the shipped model)")
    chat_template: str | None = option(None, "a Jinja chat template file, instead of the model's own "
                                             "(tokenizer_config.json / chat_template.jinja / GGUF), or a shipped "
                                             "one by name: chatml-tools (ChatML with Hermes tool calls)",
                                        metavar="FILE")
    dtype: str = option("auto", "auto: bfloat16 where the hardware computes it natively "
                                "(CUDA, AVX512-BF16, AMX), else float32", choices=DTYPE_CHOICES)
    device: str = option("auto", "auto: CUDA when there is one")
    quantization: str | None = option(None, "int8: weight-only int8 projections and LM head (faster CPU "
                                            "decode); gguf: compute on a GGUF file's own Q4_1 blocks (4-bit, "
                                            "no re-quantization); quality of both measured in BENCHMARKS.md",
                                      choices=QUANTIZATION_CHOICES)
    block_size: int = option(16, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (overrides --kv-cache-memory)", type=int)
    kv_cache_memory: int = option(1 << 30, "KV pool size, e.g. 1G", type=memory_size)
    max_num_batched_tokens: int = option(2048, "tokens computed per step at most (chunked prefill)")
    max_num_seqs: int = option(64, "requests running at once at most")
    max_decode_stall_ms: float | None = option(None, "while requests are decoding, a step computes only the prompt "
                                                     "tokens this engine computes in this long (measured as it runs: "
                                                     "engine/pace.py), so that no prompt holds their next tokens "
                                                     "longer; 0: the token budget alone (default: 500 when serving, "
                                                     "0 in LLM())", type=float)
    fair_share_chunk_tokens: int = option(32, "while several tenants are active, the prefill tokens a step "
                                               "gives the most-served tenant at most, so another tenant's "
                                               "newcomer waits for a short step (0: no limit)")
    fair_share_decode_rows: int = option(8, "while several tenants are active, the decodes a step gives the "
                                             "most-served tenant at most, in turn (each skipped one goes first "
                                             "next step), so the step a newcomer waits for is short (0: no limit)")
    fair_share_anticipation_ms: float = option(10.0, "while another tenant has work, hold the next step up to this "
                                                     "long for a tenant that sends one request at a time and has "
                                                     "been sending its next within it (engine/anticipation.py; "
                                                     "0: never)")
    cascade_attention: bool = option(True, "decodes sharing a cached prefix attend it once for all, where that "
                                           "is faster: not with the CPU decode kernel, which reads it per row "
                                           "faster (--no-cascade-attention: never)")
    batch_invariant: bool = option(False, "a step that also computes prompt tokens runs its decode rows through "
                                          "the fused decode step as a step of decodes alone does, and on an AMX "
                                          "CPU in bfloat16 every prompt span takes the tile GEMM (each row on its "
                                          "own), so a stream's logits do not depend on what else the batch holds, "
                                          "bit for bit where every row is then computed on its own (AVX-512 "
                                          "CPUs, AMX ones too); such steps read the weights twice "
                                          "(engine/model_runner.py)")
    max_model_len: int | None = option(None, "context length (default: the model's)", type=int)
    enable_prefix_caching: bool = option(True, "--no-enable-prefix-caching is --prefix-cache none")
    prefix_cache: str | None = option(None, "hash (vLLM's block hash chain), radix (SGLang's tree) or none "
                                            "(default: hash)", choices=PREFIX_CACHES)
    kv_layout: str = option("auto", "auto: sliding-window layers (Mistral, Gemma 2/3, ...) keep only their "
                                    "window's KV and give older blocks back (hash or no prefix cache, no "
                                    "tiers; docs/ARCHITECTURE.md); full: every layer keeps the whole context",
                            choices=("auto", "full"))
    hash_algo: str = option("sha256", "the block hash: sha256 (fixed-width ids), sha256_cbor (vLLM's) or "
                                      "xxh3_128", choices=HASH_ALGOS)
    verify_tokens: bool = option(False, "compare tokens on every hash hit (guards against collisions)")
    scheduling_policy: str = option("fcfs", "fcfs; lpm (longest cached prefix first); or priority: the more "
                                            "important request first, preempting a less important one "
                                            "(engine/priority.py; the server reads vLLM's request field "
                                            "priority, lower first)", choices=SCHEDULING_POLICIES)
    eviction_policy: str = option("lru", "which cached block to evict first: lru, lfu, slru, or priority (the "
                                         "blocks of the least important requests; cache/eviction.py)",
                                  choices=EVICTION_POLICIES)
    enable_kv_events: bool = option(False, cli=False)  # the server sets it: --kv-events-endpoint, replicas
    num_threads: int | None = option(None, "torch threads (default: torch's; a replica: its CPUs)", type=int)
    adaptive_threads: bool = option(True, "CPU: run each step on the cores other processes leave free, at most "
                                          "--num-threads (--no-adaptive-threads: always all of them)")
    segment_reuse: str = option("off", "reuse the KV of marked segments at any position (completions' "
                                       "`segments` field); auto: blend, and also find shared chunks of any "
                                       "prompt without markup (kvmosaic/blend/auto.py)", choices=SEGMENT_REUSE_MODES)
    auto_reuse_max_drift: float = option(0.03, "auto: the guard's bound on a request's drift estimate (mean "
                                               "check-layer deviation of the reused tokens kept; about the mean KL "
                                               "to full prefill, BENCHMARKS.md): the most deviating reused tokens "
                                               "are recomputed until it holds", type=float)
    auto_reuse_contexts: int = option(1, "auto: contexts a chunk is computed in, in full, before its KV is "
                                         "reused; its stored KV is their mean (and that of every later context "
                                         "that recomputes its tokens), which drifts less when moved", type=int)
    auto_reuse_audit_rate: float = option(0.0, "auto: share of the requests answered from reused KV whose answer's "
                                               "distributions (--auto-reuse-audit-tokens) are measured, once they are "
                                               "out, against a full prefill (KL; metrics auto_reuse_audit*; "
                                               "kvmosaic/blend/shadow.py): each costs a prefill", type=float)
    auto_reuse_audit_tokens: int = option(1, "auto: answer tokens an audit covers: its drift is the mean KL to "
                                             "the full prefill over the first this many (1: the first token's; "
                                             "16: the benchmarks' KL mean); the rows are kept until then "
                                             "(at most 64)", type=int)
    auto_reuse_audit_bound: float | None = option(None, "auto: the KL above which an audited answer counts as over "
                                                        "the bound (default: --auto-reuse-max-drift)", type=float)
    auto_reuse_audit_trip: float | None = option(None, "auto: turn automatic reuse off for 10 minutes for a namespace "
                                                       "(cache salt) once more than this share of its last 20 audited "
                                                       "answers (at least 10) were over the bound "
                                                       "(kvmosaic/blend/breaker.py); default: never", type=float)
    blend_ratio: float = option(0.15, "blend: fraction of reused segment tokens recomputed")
    blend_threshold: float | None = option(None, "blend: recompute tokens deviating more (overrides the ratio)",
                                           type=float)
    blend_check_layer: int = option(2, "blend: the early layer whose KV deviation picks tokens (>= 1)")
    blend_selection: str | None = option(None, "blend: which reused tokens the ratio recomputes: those whose "
                                                "check-layer KV deviates most (deviation, CacheBlend's), the same "
                                                "weighted by the answer's attention to them there (attention), or "
                                                "random (the baseline); default: attention with --segment-reuse "
                                                "auto, deviation for marked segments (each the better on its "
                                                "benchmark, BENCHMARKS.md)", choices=("attention", "deviation", "random"))
    blend_head_tokens: int = option(12, "blend: the first tokens of every reused segment that no longer follows "
                                        "the tokens it was computed after are recomputed too (EPIC's LegoLink)")
    segment_cache_memory: int = option(256 << 20, "bytes for stored segment KV (LRU), e.g. 256M", type=memory_size)
    scored_prefix_cache_memory: int = option(0, "bytes for the last-layer hidden states of scored prompts' blocks "
                                                "(LRU; 0: off): a request with prompt_logprobs then starts after a "
                                                "prefix another scored prompt computed (engine/scored_prefix.py)",
                                             type=memory_size)
    segment_separator: str | None = option(None, "mark segments in any text prompt (chat messages too): "
                                                 "head TEXT doc TEXT ... TEXT tail", metavar="TEXT")
    kv_tiers: list[str] | None = option(None, "a storage tier below the pool, fastest first (repeatable): "
                                              "host:4GiB, disk:/var/cache/kvmosaic:20GiB, "
                                              "redis://127.0.0.1:6379 (kvmosaic/tiers/spec.py)",
                                        flag="--kv-tier", metavar="SPEC", append=True)
    kv_tier_load_timeout: float = option(2.0, "a tier load slower than this many seconds is a miss "
                                              "(those tokens are computed)", metavar="S")
    kv_tier_secret: str | None = option(None, "a secret every replica sharing a disk or Redis tier is given: each "
                                              "entry carries a MAC under it, checked on every load (without one, "
                                              "shared tiers trust every writer)", metavar="SECRET", repr=False)
    kv_tier_secret_file: str | None = option(None, "read --kv-tier-secret from this file at engine start",
                                             metavar="PATH")
    miss_reasons: bool = option(True, "count why prompt tokens miss the cache, by reason and by tenant "
                                      "(kvmosaic/cache/lens.py)")
    keep_block_tokens: bool = option(False, cli=False)  # the server sets it: --dashboard-show-text
    # Who runs the engine: "llm" (LLM(), offline) or "server" (the server sets it, every replica too);
    # the defaults that differ between them follow it, as vLLM's UsageContext (max_decode_stall_ms).
    usage_context: str = option("llm", cli=False, choices=USAGE_CONTEXTS)
    kv_cache_metrics_sample: float = option(0.01, "fraction of KV blocks whose lifetime, idle time before "
                                                  "eviction and reuse gaps are observed (vLLM's kv_block_* "
                                                  "histograms; 0: off)", metavar="F")

    def create_engine_config(self, **overrides: Any) -> EngineConfig:
        """The validated config on this machine (``dtype="auto"`` resolved here)."""
        from .config import EngineConfig

        return EngineConfig(**{**self.values(), **overrides})
