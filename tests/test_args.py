"""One set of arguments: every engine option is a flag, and a Ray replica runs exactly the
engine config one server runs from the same command line (issue 20)."""

from __future__ import annotations

import argparse
import pickle
from dataclasses import asdict, fields

import pytest

from kvmosaic.engine.arg_utils import EngineArgs
from kvmosaic.engine.config import EngineConfig
from kvmosaic.server.args import ServerArgs
from kvmosaic.server.cli import add_arguments

# A value other than the default for every engine field, as a user would type it.
ENGINE_FLAGS = {
    "model": ["--model", "{gguf}"], "chat_template": ["--chat-template", "{tmp}/template.jinja"],
    "dtype": ["--dtype", "float32"], "device": ["--device", "cpu"],
    "quantization": ["--quantization", "int8"], "block_size": ["--block-size", "32"],
    "num_kv_blocks": ["--num-kv-blocks", "77"], "kv_cache_memory": ["--kv-cache-memory", "2G"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "1024"], "max_num_seqs": ["--max-num-seqs", "9"],
    "max_decode_stall_ms": ["--max-decode-stall-ms", "250"],
    "fair_share_chunk_tokens": ["--fair-share-chunk-tokens", "64"],
    "fair_share_decode_rows": ["--fair-share-decode-rows", "16"],
    "fair_share_anticipation_ms": ["--fair-share-anticipation-ms", "2.5"],
    "cascade_attention": ["--no-cascade-attention"], "batch_invariant": ["--batch-invariant"],
    "max_model_len": ["--max-model-len", "512"],
    "enable_prefix_caching": ["--no-enable-prefix-caching"], "prefix_cache": ["--prefix-cache", "radix"],
    "kv_layout": ["--kv-layout", "full"],
    "hash_algo": ["--hash-algo", "xxh3_128"], "verify_tokens": ["--verify-tokens"],
    "scheduling_policy": ["--scheduling-policy", "lpm"], "eviction_policy": ["--eviction-policy", "priority"],
    "num_threads": ["--num-threads", "3"], "adaptive_threads": ["--no-adaptive-threads"],
    "segment_reuse": ["--segment-reuse", "auto"], "auto_reuse_max_drift": ["--auto-reuse-max-drift", "0.07"],
    "auto_reuse_contexts": ["--auto-reuse-contexts", "2"],
    "auto_reuse_audit_rate": ["--auto-reuse-audit-rate", "0.25"],
    "auto_reuse_audit_tokens": ["--auto-reuse-audit-tokens", "16"],
    "auto_reuse_audit_bound": ["--auto-reuse-audit-bound", "0.05"],
    "auto_reuse_audit_trip": ["--auto-reuse-audit-trip", "0.3"],
    "blend_ratio": ["--blend-ratio", "0.3"], "blend_threshold": ["--blend-threshold", "0.7"],
    "blend_check_layer": ["--blend-check-layer", "3"], "blend_head_tokens": ["--blend-head-tokens", "4"],
    "blend_selection": ["--blend-selection", "deviation"],
    "segment_cache_memory": ["--segment-cache-memory", "64M"],
    "scored_prefix_cache_memory": ["--scored-prefix-cache-memory", "32M"],
    "segment_separator": ["--segment-separator", "<|doc|>"],
    "kv_tiers": ["--kv-tier", "host:1GiB", "--kv-tier", "disk:{tmp}:1GiB"],
    "kv_tier_load_timeout": ["--kv-tier-load-timeout", "0.5"],
    "kv_tier_secret": ["--kv-tier-secret", "s3cret"], "kv_tier_secret_file": ["--kv-tier-secret-file", "{tmp}/secret"],
    "kv_cache_metrics_sample": ["--kv-cache-metrics-sample", "0.5"],
    "enable_kv_events": [],  # not a flag: the server turns it on (events endpoint, replicas)
    "miss_reasons": ["--no-miss-reasons"],
    "keep_block_tokens": [],  # not a flag: the server turns it on (--dashboard-show-text)
    "usage_context": [],  # not a flag: the server sets it ("server": its defaults)
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def argv(shipped_gguf, tmp_path) -> list[str]:
    (tmp_path / "template.jinja").write_text("{{ messages[0].content }}")
    return [a.format(gguf=shipped_gguf, tmp=tmp_path) for flags in ENGINE_FLAGS.values() for a in flags]


def test_every_engine_field_is_declared_once_and_is_a_flag():
    assert [f.name for f in fields(EngineConfig)] == [f.name for f in fields(EngineArgs)]
    assert set(ENGINE_FLAGS) == {f.name for f in fields(EngineArgs)}, "a new field needs a row above"
    code_only = [f.name for f in fields(EngineArgs) if not f.metadata["cli"]]
    assert code_only == ["enable_kv_events", "keep_block_tokens", "usage_context"]


def test_a_replica_gets_the_config_one_server_gets(argv):
    from kvmosaic.serve.replica import replica_engine_config

    ns = parse([*argv, "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--api-key", "A", "--dashboard-show-text"])
    engine_args, server_args = EngineArgs.from_cli_args(ns), ServerArgs.from_cli_args(ns)
    single = asdict(engine_args.create_engine_config(**server_args.engine_overrides()))  # server/cli.py's run
    # what Ray hands a replica is a pickled copy of the same two objects
    replica = asdict(replica_engine_config(*pickle.loads(pickle.dumps((engine_args, server_args)))))
    assert replica == single
    defaults = asdict(EngineArgs())
    same = [k for k, v in single.items() if v == defaults[k]]
    # every option travelled: each differs from its default, but enable_prefix_caching (the
    # explicit --prefix-cache radix wins over it)
    assert same == ["enable_prefix_caching"], same


def test_replicas_without_events_flag_still_publish_for_the_router(argv):
    from kvmosaic.serve.replica import replica_engine_config

    ns = parse([*argv, "--replicas", "2"])
    assert replica_engine_config(EngineArgs.from_cli_args(ns), ServerArgs.from_cli_args(ns)).enable_kv_events


def test_the_serve_config_dict_builds_the_same_args(argv):
    from kvmosaic.serve.app import split_args

    ns = parse([*argv, "--api-key", "A", "--api-key", "B", "--admin-key", "X", "--replicas", "3"])
    engine_args, server_args = EngineArgs.from_cli_args(ns), ServerArgs.from_cli_args(ns)
    given = {k: v for k, v in vars(ns).items() if v is not None and v != []}
    got_engine, got_server = split_args({k.replace("_", "-") if k == "kv_tiers" else k: v for k, v in given.items()})
    assert got_engine == engine_args
    assert {**asdict(got_server), "api_key_salt": None} == {**asdict(server_args), "api_key_salt": None}
    with pytest.raises(ValueError, match="unknown kvmosaic options"):
        split_args({"replicas": 2, "dtpye": "float32"})


def test_the_tenant_secret_is_fixed_once_and_travels():
    args = ServerArgs(api_key=["A", "B"])
    assert args.api_key_salt  # generated: the tenancy is isolated
    copy = pickle.loads(pickle.dumps(args))  # a replica's
    assert copy.tenant_policy().cache_salt("A", None) == args.tenant_policy().cache_salt("A", None)
    assert args.tenant_policy().cache_salt("A", None) != args.tenant_policy().cache_salt("B", None)
    assert ServerArgs().api_key_salt is None and ServerArgs().tenancy_mode == "shared"
    assert "api_key" not in repr(args) and args.api_key_salt not in repr(args)


def test_events_carry_no_token_ids_where_tenants_exist_unless_opted_in():
    assert ServerArgs().events_carry_token_ids, "one trusted user: token ids, as vLLM publishes them"
    assert not ServerArgs(api_key=["A"]).events_carry_token_ids
    assert ServerArgs(api_key=["A"], kv_events_token_ids=True).events_carry_token_ids
    assert ServerArgs(api_key=["A"], kv_events_curve_secret_key="k" * 40).events_carry_token_ids
    assert not ServerArgs(kv_events_no_token_ids=True).events_carry_token_ids


def test_the_policy_choices_are_the_engines():
    from kvmosaic.cache.eviction import POLICIES
    from kvmosaic.engine.arg_utils import EVICTION_POLICIES

    assert EVICTION_POLICIES == POLICIES
