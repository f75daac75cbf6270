"""``kvmosaic serve``: load the model, then serve the OpenAI API until interrupted.

Once the socket is listening it prints how to send a request (a curl line and an openai
client snippet), so the first thing a user sees is something to paste.
"""

from __future__ import annotations

import argparse
import logging
import re

from ..engine.config import PREFIX_CACHES, QUANTIZATIONS, EngineConfig

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


def memory_size(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``1.5GB`` -> bytes (powers of 1024)."""
    m = SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1G or 512M)")
    return int(float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None, help="GGUF file or safetensors folder (default: the shipped model)")
    e.add_argument("--served-model-name", default=None, help="name clients use (default: the model's)")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the hardware computes it natively, else float32")
    e.add_argument("--device", default="auto")
    e.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="int8: weight-only int8 projections and LM head (faster CPU decode; outputs "
                        "within a measured tolerance of the unquantized model, see BENCHMARKS.md)")
    e.add_argument("--prefix-cache", default="hash", choices=PREFIX_CACHES)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--kv-cache-memory", type=memory_size, default=memory_size("1G"), help="KV pool size, e.g. 1G")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-memory")
    e.add_argument("--kv-tier", action="append", default=None, metavar="SPEC", dest="kv_tiers",
                   help="a storage tier below the pool, fastest first (repeatable): host:4GiB, "
                        "disk:/var/cache/kvmosaic:20GiB, redis://127.0.0.1:6379 (see kvmosaic/tiers/spec.py)")
    e.add_argument("--kv-tier-load-timeout", type=float, default=2.0, metavar="S",
                   help="a tier load slower than S seconds is a miss (those tokens are computed)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-cascade-attention", dest="cascade_attention", action="store_false",
                   help="decodes sharing a cached prefix each read it (default: attended once for all)")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"])
    e.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    e.add_argument("--segment-reuse", default="off", choices=["off", "shift", "blend"],
                   help="reuse the KV of marked segments at any position (completions' `segments` field)")
    e.add_argument("--blend-ratio", type=float, default=0.15, help="blend: fraction of reused tokens recomputed")
    e.add_argument("--blend-threshold", type=float, default=None, help="blend: recompute tokens deviating more")
    e.add_argument("--blend-check-layer", type=int, default=2, help="blend: the layer whose KV deviation picks")
    e.add_argument("--segment-separator", default=None, metavar="TEXT",
                   help="mark segments in any text prompt (chat messages too): head TEXT doc TEXT ... TEXT tail")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=[], help="require this bearer token (repeatable)")
    s.add_argument("--api-key-salt", default=None, metavar="SECRET",
                   help="derive each request's cache salt from its API key: HMAC-SHA256(SECRET, key)")
    s.add_argument("--max-body-bytes", type=memory_size, default=memory_size("1M"))
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: stop admitting (503), let running requests finish for up to S seconds, "
                        "then end the rest with an error")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request head has not arrived in S seconds (408)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="answer 408 when a request body stalls for S seconds")
    s.add_argument("--timeout-keep-alive", type=int, default=5, metavar="S", help="close idle connections after S s")
    s.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ",
                   help="publish cache events on this ZeroMQ PUB endpoint, e.g. tcp://*:5557")
    s.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ", help="e.g. tcp://*:5558")
    s.add_argument("--kv-events-topic", default="")
    s.add_argument("--kv-events-no-token-ids", action="store_true",
                   help="publish block hashes without their token ids (what a hash-based router needs)")
    s.add_argument("--kv-events-allow-remote", action="store_true",
                   help="allow event/replay endpoints beyond loopback (subscribers learn every tenant's blocks)")
    s.add_argument("--kv-events-curve-secret-key", default=None, metavar="Z85",
                   help="authenticate event subscribers with ZeroMQ CURVE: this server's secret key")
    s.add_argument("--kv-events-curve-client-key", action="append", default=None, metavar="Z85",
                   help="a subscriber public key let in (repeatable; none: any client knowing the server key)")
    t = p.add_argument_group("tenancy")
    t.add_argument("--tenancy", default=None, choices=["isolated", "shared", "shared-public"],
                   help="cache sharing across tenants (default: isolated when API keys are set, else shared)")
    t.add_argument("--admin-key", action="append", default=[],
                   help="bearer token for /reset_prefix_cache, /metrics and detailed /health (repeatable)")
    t.add_argument("--public-prefix-file", default=None, metavar="PATH",
                   help="shared-public: texts (separated by '---' lines) or 'sha256:<hex>' chain hashes "
                        "whose blocks every tenant may share")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def banner(url: str, model: str, events: str | None) -> str:
    curl = (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Say hello in French.\"}}], "
            f"\"max_tokens\": 32}}'")
    client = (f"from openai import OpenAI\n"
              f"client = OpenAI(base_url=\"{url}/v1\", api_key=\"unused\")\n"
              f"r = client.chat.completions.create(model=\"{model}\", max_tokens=32,\n"
              f"    messages=[{{\"role\": \"user\", \"content\": \"Say hello in French.\"}}])\n"
              f"print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)")
    lines = [f"kvmosaic is serving {model} at {url} (OpenAI API under /v1)", "", "Send it a request:", "",
             "  " + curl.replace("\n", "\n  "), "", "or, in Python:", "", "  " + client.replace("\n", "\n  "), "",
             f"Metrics: {url}/metrics   health and KV pool: {url}/health"]
    if events:
        lines.append(f"Cache events: ZeroMQ PUB on {events}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.llm_engine import LLMEngine
    from .app import build_app
    from .async_engine import AsyncEngine
    from .events import ZmqEventPublisher
    from .metrics import ServerMetrics
    from .tenancy import TenantPolicy

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, prefix_cache=args.prefix_cache,
        cascade_attention=args.cascade_attention,
        scheduling_policy=args.scheduling_policy, num_threads=args.num_threads,
        quantization=args.quantization, enable_kv_events=args.kv_events_endpoint is not None, segment_reuse=args.segment_reuse,
        blend_ratio=args.blend_ratio, blend_threshold=args.blend_threshold,
        blend_check_layer=args.blend_check_layer, segment_separator=args.segment_separator,
        kv_tiers=args.kv_tiers, kv_tier_load_timeout=args.kv_tier_load_timeout)
    print(f"loading {args.model or 'the shipped model'} ({config.dtype}"
          f"{', chosen by --dtype auto' if args.dtype == 'auto' else ''}"
          f"{', int8 weight-only' if config.quantization == 'int8' else ''}) ...", flush=True)
    publisher = None
    if args.kv_events_endpoint:
        publisher = ZmqEventPublisher(
            args.kv_events_endpoint, args.kv_events_topic, args.kv_events_replay_endpoint,
            include_token_ids=not args.kv_events_no_token_ids, allow_remote=args.kv_events_allow_remote,
            curve_secret_key=args.kv_events_curve_secret_key.encode() if args.kv_events_curve_secret_key else None,
            curve_client_keys=[k.encode() for k in args.kv_events_curve_client_key]
            if args.kv_events_curve_client_key else None)
    async_engine = AsyncEngine.launch(lambda: LLMEngine(config), on_flush=publisher.publish if publisher else None)
    engine = async_engine.engine
    model_name = args.served_model_name or engine.model_name
    metrics = ServerMetrics(lambda: async_engine.stats, model_name)
    async_engine.on_finish = metrics.on_finish
    from .tenancy import build_public_prefixes, read_public_prefix_file

    tenants = TenantPolicy(frozenset(args.api_key), args.api_key_salt.encode() if args.api_key_salt else None,
                           args.tenancy, frozenset(args.admin_key))
    if tenants.mode == "shared-public":
        texts, hashes = read_public_prefix_file(args.public_prefix_file) if args.public_prefix_file else ([], [])
        tenants.public = build_public_prefixes(engine, texts, hashes)
    from .drain import Drain, DrainingServer
    from .limits import GuardedH11Protocol

    drain = Drain(args.shutdown_timeout)
    app = build_app(async_engine, model_name, metrics, tenants, args.max_body_bytes, drain=drain,
                    body_timeout=args.body_timeout)
    info = engine.model_info
    pool_tokens = info.num_kv_blocks * info.block_size
    capacity_warning = None
    if pool_tokens < engine.max_model_len:  # issue 14: admission by capacity
        capacity_warning = (f"WARNING: the KV pool holds {pool_tokens} tokens ({info.num_kv_blocks} blocks of "
                            f"{info.block_size}), less than one full-context request ({engine.max_model_len} "
                            f"tokens); requests needing more are refused with 400. Raise --kv-cache-memory "
                            f"or lower --max-model-len.")
        logging.getLogger("kvmosaic.server").warning(capacity_warning)

    class Protocol(GuardedH11Protocol):
        header_timeout = args.header_timeout

    class Server(DrainingServer):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
                print("\n" + banner(f"http://{host}:{port}", model_name, args.kv_events_endpoint) + "\n", flush=True)
                if capacity_warning:
                    print(capacity_warning + "\n", flush=True)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=5, http=Protocol,
                                   timeout_keep_alive=args.timeout_keep_alive,
                                   h11_max_incomplete_event_size=64 << 10), drain, async_engine)
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
    return 0 if server.started else 1
