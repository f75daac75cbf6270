"""Storage tiers below the KV pool: host RAM, a persistent disk directory, a shared Redis.

Torch-free (stdlib + xxhash; redis-py only when a Redis tier is built), so a router, a tier
server or a benchmark can use it alone (tests/test_tiers_format.py::test_import_is_light).

- format.py  the self-checking, authenticated value format (BlockMeta, encode_block, decode_block,
             CorruptEntry, TierKeys / load_secret: the replicas' shared secret)
- base.py    the Tier interface, write policies and triggers
- host.py, disk.py, redis_tier.py   the stores
- stack.py   TierStack: lookup / load (the only place values are verified) / store
- loader.py  TierLoader: loads on a background thread with deadlines
- spec.py    parse_tier_spec("host:4GiB" | "disk:PATH:SIZE" | "redis://...")
- redis_server.py  start a real redis-server (tests, benchmarks)

See docs/ARCHITECTURE.md (storage tiers).
"""

from .base import DEFAULT_POLICY, Policy, Tier, Trigger, should_store
from .disk import DiskTier
from .format import (
    FORMAT_VERSION,
    BlockMeta,
    CorruptEntry,
    TierKeys,
    decode_block,
    encode_block,
    load_secret,
    read_meta,
    tokens_digest,
)
from .host import HostTier
from .loader import TierLoader
from .spec import TierSpec, build_tiers, parse_size, parse_tier_spec
from .stack import Loaded, TierStack
from .stats import TierStats

__all__ = [
    "DEFAULT_POLICY", "FORMAT_VERSION", "BlockMeta", "CorruptEntry", "DiskTier", "HostTier",
    "Loaded", "Policy", "RedisTier", "Tier", "TierKeys", "TierLoader", "TierSpec", "TierStack", "TierStats",
    "Trigger", "build_tiers", "decode_block", "encode_block", "load_secret", "parse_size", "parse_tier_spec",
    "read_meta", "should_store", "tokens_digest",
]


def __getattr__(name: str):
    if name == "RedisTier":  # imports redis-py lazily only when the class is built
        from .redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
