"""Tier specs: the strings users write (``LLM(kv_tiers=[...])``, ``kvmosaic serve --kv-tier ...``).

Grammar::

    spec    := host | disk | redis
    host    := "host:" SIZE [":" POLICY] ["?" OPTIONS]
    disk    := "disk:" PATH ":" SIZE [":" POLICY] ["?" OPTIONS]
    redis   := ("redis://" | "rediss://" | "unix://") ADDRESS ["?" OPTIONS]
    OPTIONS := KEY "=" VALUE ("&" KEY "=" VALUE)*
    SIZE    := NUMBER [UNIT]      UNIT: B, KB, MB, GB, TB (powers of 1000),
                                  KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024); case-insensitive
    POLICY  := write_back | write_through | write_through_selective

Options (any tier): ``policy=POLICY``, ``k=N`` (hit threshold of the selective policy, default 2),
``name=NAME``, ``capacity=SIZE``; disk: ``fsync=0|1``; redis: ``timeout=SECONDS`` (per call,
default 0.5), ``ttl=SECONDS``, ``prefix=STR``, ``backoff=SECONDS``. Other query keys of a Redis
URL (``db``, ``password``...) go to redis-py unchanged. PATH may contain ``:``; the size and the
policy are read from the right. Examples::

    host:4GiB                        host:4GiB:write_through
    disk:/var/cache/kvmosaic:20GiB   disk:/tmp/kv:1GB?policy=write_through_selective&k=3
    redis://127.0.0.1:6379           redis://cache:6379/0?ttl=3600&timeout=0.2&capacity=8GiB

Default policies: host ``write_back``, disk and redis ``write_through`` (see base.Policy).
Held by tests/test_tiers_stack.py::test_parse_*. See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import Policy, Tier

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_POLICIES = {p.value for p in Policy}


def parse_size(text: str) -> int:
    """``"4GiB"`` -> 4294967296; ``"20GB"`` -> 20000000000; ``"512"`` -> 512."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class TierSpec:
    """A parsed tier spec; ``build()`` makes the tier (a Redis tier connects lazily)."""

    medium: str
    capacity_bytes: int | None = None
    path: str | None = None
    url: str | None = None
    policy: Policy | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Tier:
        kw = dict(self.options)
        if self.medium == "host":
            from .host import HostTier

            return HostTier(self.capacity_bytes, policy=self.policy, **kw)
        if self.medium == "disk":
            from .disk import DiskTier

            return DiskTier(self.path, self.capacity_bytes, policy=self.policy, **kw)
        from .redis_tier import RedisTier

        return RedisTier(self.url, self.capacity_bytes, policy=self.policy, **kw)


def parse_tier_spec(spec: str) -> TierSpec:
    spec = spec.strip()
    if re.match(r"^(redis|rediss|unix)://", spec):
        return _parse_redis(spec)
    body, _, query = spec.partition("?")
    opts = _options(parse_qsl(query, keep_blank_values=True), spec)
    medium, _, rest = body.partition(":")
    parts = rest.split(":") if rest else []
    policy = None
    if parts and parts[-1] in _POLICIES:
        policy = Policy(parts.pop())
    if medium == "host":
        if len(parts) > 1:
            raise ValueError(f"bad host tier spec {spec!r}: expected host:SIZE[:POLICY]")
        size = parts[0] if parts else None
        path = None
    elif medium == "disk":
        if len(parts) < 2:
            raise ValueError(f"bad disk tier spec {spec!r}: expected disk:PATH:SIZE[:POLICY]")
        size, path = parts[-1], ":".join(parts[:-1])
    else:
        raise ValueError(f"unknown tier {medium!r} in {spec!r}: use host:, disk: or redis://")
    capacity = opts.pop("capacity", None)
    if size is not None:
        capacity = parse_size(size)
    if capacity is None:
        raise ValueError(f"tier spec {spec!r} needs a size, e.g. {medium}:4GiB")
    policy = opts.pop("policy", None) or policy
    _check_keys(medium, opts, spec)
    return TierSpec(medium, capacity, path=path, policy=policy, options=opts)


def _parse_redis(spec: str) -> TierSpec:
    u = urlsplit(spec)
    ours, theirs = [], []
    for k, v in parse_qsl(u.query, keep_blank_values=True):
        (ours if k in _REDIS_KEYS | _COMMON_KEYS else theirs).append((k, v))
    opts = _options(ours, spec)
    url = urlunsplit((u.scheme, u.netloc, u.path, urlencode(theirs), u.fragment))
    capacity, policy = opts.pop("capacity", None), opts.pop("policy", None)
    _check_keys("redis", opts, spec)
    return TierSpec("redis", capacity, url=url, policy=policy, options=opts)


_COMMON_KEYS = {"policy", "k", "name", "capacity"}
_REDIS_KEYS = {"timeout", "ttl", "prefix", "backoff"}
_DISK_KEYS = {"fsync"}


_ALLOWED = {
    "host": {"hit_threshold", "name"},
    "disk": {"hit_threshold", "name", "fsync"},
    "redis": {"hit_threshold", "name", "timeout", "ttl_s", "prefix", "backoff"},
}


def _check_keys(medium: str, opts: dict[str, Any], spec: str) -> None:
    extra = set(opts) - _ALLOWED[medium]
    if extra:
        raise ValueError(f"option(s) {sorted(extra)} do not apply to a {medium} tier ({spec!r})")


def _options(pairs, spec: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k == "policy":
            if v not in _POLICIES:
                raise ValueError(f"unknown policy {v!r} in {spec!r}: one of {sorted(_POLICIES)}")
            out["policy"] = Policy(v)
        elif k == "k":
            out["hit_threshold"] = int(v)
        elif k == "capacity":
            out["capacity"] = parse_size(v)
        elif k == "name":
            out["name"] = v
        elif k == "fsync":
            out["fsync"] = v not in ("0", "false", "no")
        elif k in ("timeout", "backoff"):
            out[k] = float(v)
        elif k == "ttl":
            out["ttl_s"] = float(v)
        elif k == "prefix":
            out["prefix"] = v
        else:
            raise ValueError(f"unknown tier option {k!r} in {spec!r}")
    return out


def build_tiers(specs: list[str]) -> list[Tier]:
    """Parse and build each spec, in the order given (which should be fastest first)."""
    return [parse_tier_spec(s).build() for s in specs]
