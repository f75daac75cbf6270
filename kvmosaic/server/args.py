"""The server's options, declared once: :class:`ServerArgs`, the partner of
:class:`~kvmosaic.engine.arg_utils.EngineArgs`.

One process (``kvmosaic serve``) and every Ray replica (``kvmosaic serve --replicas N``) build
their HTTP app from the same ``ServerArgs`` (:func:`kvmosaic.server.app.build_server`); the Ray
front reads the same object for its own limits, drain and authentication. Invariant: the
tenant salt secret is fixed once, when the ``ServerArgs`` is made (generated then if the
tenancy needs one and none was given), and travels with the object, so every replica derives
the same salt from the same key and the router predicts the hashes the replicas publish. See
docs/ARCHITECTURE.md ("One set of arguments").
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from ..engine.arg_utils import CliArgs, memory_size, option
from .tenancy import TENANCY_MODES

REPLICAS = "replicas (Ray Serve)"
TENANCY = "tenancy"
EVENTS = "KV events (ZeroMQ, vLLM's format)"
DASHBOARD = "cache explorer (/dashboard) and per-tenant metrics"


@dataclass
class ServerArgs(CliArgs):
    SECTION = "server"

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    served_model_name: str | None = option(None, "the model name clients use (default: the model's)")
    log_level: str = option("info", choices=("debug", "info", "warning", "error"))
    max_body_bytes: int = option(1 << 20, "largest request body accepted (413 beyond), e.g. 1M", type=memory_size)
    shutdown_timeout: float = option(30.0, "on SIGTERM: stop admitting (503), let running requests finish for "
                                           "up to S seconds, then end the rest with an error", metavar="S")
    header_timeout: float = option(10.0, "close a connection whose request head has not arrived in S "
                                         "seconds (408)", metavar="S")
    body_timeout: float = option(30.0, "answer 408 when a request body stalls for S seconds", metavar="S")
    timeout_keep_alive: int = option(5, "close idle connections after S seconds", metavar="S")
    enable_auto_tool_choice: bool = option(False, "let the model call tools on its own (tool_choice 'auto'); "
                                                  "needs --tool-call-parser")
    tool_call_parser: str | None = option(None, "how tool calls are read from the output: hermes "
                                                "(<tool_call>{json}</tool_call>; the shipped template "
                                                "--chat-template chatml-tools writes them)", choices=("hermes",))
    metrics_prefix: str = option("kvmosaic:", "the prefix of every /metrics name; 'vllm:' lets a vLLM Grafana "
                                              "dashboard work unchanged", metavar="PREFIX")

    api_key: list[str] = option(help="require this bearer token (repeatable)", factory=list, append=True,
                                group=TENANCY, repr=False)
    api_key_salt: str | None = option(None, "derive each request's cache salt from its API key: "
                                            "HMAC-SHA256(SECRET, key) (default: a random secret per start)",
                                      metavar="SECRET", group=TENANCY, repr=False)
    tenancy: str | None = option(None, "cache sharing across tenants (default: isolated when API keys are "
                                       "set, else shared)", choices=TENANCY_MODES, group=TENANCY)
    admin_key: list[str] = option(help="bearer token for /reset_prefix_cache, /metrics and detailed /health "
                                       "(repeatable)", factory=list, append=True, group=TENANCY, repr=False)
    tenant_max_requests: int | None = option(None, "with API keys: requests one key may have in flight; more "
                                                   "get 429 with Retry-After", type=int, group=TENANCY)
    tenant_max_queued_tokens: int | None = option(None, "with API keys: prompt tokens one key may have in "
                                                        "flight; more get 429", type=int, group=TENANCY)
    public_prefix_file: str | None = option(None, "shared-public: texts (separated by '---' lines) or "
                                                  "'sha256:<hex>' chain hashes whose blocks every tenant "
                                                  "may share", metavar="PATH", group=TENANCY)

    kv_events_endpoint: str | None = option(None, "publish cache events on this ZeroMQ PUB endpoint, e.g. "
                                                  "tcp://127.0.0.1:5557", metavar="ZMQ", group=EVENTS)
    kv_events_replay_endpoint: str | None = option(None, "e.g. tcp://127.0.0.1:5558", metavar="ZMQ", group=EVENTS)
    kv_events_topic: str = option("", group=EVENTS)
    kv_events_format: str = option("vllm", "vllm: current vLLM's tagged maps (0.32+); array: its earlier "
                                           "array layout, for consumers built against it",
                                   choices=("vllm", "array"), group=EVENTS)
    kv_events_no_token_ids: bool = option(False, "publish block hashes without their token ids (what a "
                                                 "hash-based router needs)", group=EVENTS)
    kv_events_token_ids: bool = option(False, "with API keys, publish token ids too (by default they are left "
                                              "out unless subscribers authenticate with CURVE: a subscriber "
                                              "would read every tenant's prompts)", group=EVENTS)
    kv_events_allow_remote: bool = option(False, "allow event/replay endpoints beyond loopback (subscribers "
                                                 "learn every tenant's blocks)", group=EVENTS)
    kv_events_curve_secret_key: str | None = option(None, "authenticate event subscribers with ZeroMQ CURVE: "
                                                          "this server's secret key", metavar="Z85",
                                                    group=EVENTS, repr=False)
    kv_events_curve_client_key: list[str] | None = option(None, "a subscriber public key let in (repeatable; "
                                                                "none: any client knowing the server key)",
                                                          metavar="Z85", append=True, group=EVENTS)

    dashboard: bool = option(True, "serve the live cache explorer at /dashboard (admin key when keys are set)",
                             group=DASHBOARD)
    dashboard_show_text: bool = option(False, "let /dashboard show cached blocks' token text (every tenant's "
                                              "prompts, to whoever holds the admin key)", group=DASHBOARD)
    metrics_top_tenants: int = option(10, "per-tenant cache metrics: the N busiest tenants by label, the rest "
                                          "summed as 'other'", group=DASHBOARD)

    replicas: int | None = option(None, "run N engine replicas on Ray Serve behind one front", type=int,
                                  group=REPLICAS)
    router: str = option("cache-aware", "how requests pick a replica (kvmosaic/router/policies.py)",
                         group=REPLICAS)
    replica_cpus: float = option(0.5, "CPUs each replica reserves on its Ray node", group=REPLICAS)
    ray_address: str | None = option(None, "join this Ray cluster (e.g. 10.0.0.1:6379, or 'auto'); "
                                           "default: start a local one", group=REPLICAS)
    max_replicas_per_node: int | None = option(None, "spread replicas: at most this many on one Ray node",
                                               type=int, group=REPLICAS)
    direct_ingress: bool = option(True, "on a Ray this command starts, the front itself listens on --port "
                                        "(Ray Serve's direct ingress: one hop fewer per request and chunk); "
                                        "--no-direct-ingress, or --ray-address: through Ray Serve's HTTP proxy",
                                  group=REPLICAS)

    def __post_init__(self) -> None:
        if self.tenancy is not None and self.tenancy not in TENANCY_MODES:
            raise ValueError(f"unknown tenancy mode {self.tenancy!r}; choose one of {TENANCY_MODES}")
        from .metrics_vllm import check_prefix

        check_prefix(self.metrics_prefix)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        from .events import check_bind  # before any model loads: a bad endpoint is a one-line error

        for endpoint in filter(None, (self.kv_events_endpoint, self.kv_events_replay_endpoint)):
            check_bind(endpoint, self.kv_events_allow_remote, self.kv_events_curve_secret_key is not None)
        if self.api_key_salt is None and self.tenancy_mode != "shared":
            self.api_key_salt = secrets.token_hex(32)  # fixed here, once: replicas receive this object

    @property
    def tenancy_mode(self) -> str:
        return self.tenancy or ("isolated" if self.api_key or self.api_key_salt is not None else "shared")

    def engine_overrides(self) -> dict[str, Any]:
        """What the server sets in the engine's config: events on when published (always on a
        replica: the router follows them); the serving defaults (``usage_context``)."""
        return {"enable_kv_events": bool(self.kv_events_endpoint or self.replicas),
                "keep_block_tokens": self.dashboard_show_text, "usage_context": "server"}

    def tenant_policy(self):
        """The tenancy policy (its public prefixes, which need the engine's tokenizer, are added
        by :func:`kvmosaic.server.app.build_server`)."""
        from .tenancy import TenantPolicy

        return TenantPolicy(frozenset(self.api_key), self.api_key_salt.encode() if self.api_key_salt else None,
                            self.tenancy, frozenset(self.admin_key))

    @property
    def events_carry_token_ids(self) -> bool:
        """Private by default where tenants exist: with API keys, events (live and replayed) carry
        block hashes only, unless the admin opts in or subscribers authenticate (CURVE). Hashes
        are what a router needs; token ids would hand every tenant's prompts to any local
        subscriber."""
        if self.kv_events_no_token_ids:
            return False
        return not self.api_key or self.kv_events_token_ids or self.kv_events_curve_secret_key is not None

    def event_publisher(self):
        """The ZeroMQ publisher of ``--kv-events-endpoint`` (None without one)."""
        if not self.kv_events_endpoint:
            return None
        from .events import ZmqEventPublisher

        return ZmqEventPublisher(
            self.kv_events_endpoint, self.kv_events_topic, self.kv_events_replay_endpoint,
            include_token_ids=self.events_carry_token_ids, allow_remote=self.kv_events_allow_remote,
            curve_secret_key=self.kv_events_curve_secret_key.encode() if self.kv_events_curve_secret_key else None,
            curve_client_keys=[k.encode() for k in self.kv_events_curve_client_key]
            if self.kv_events_curve_client_key else None, wire_format=self.kv_events_format)
