"""``kvmosaic serve``: load the model, then serve the OpenAI API until interrupted.

Once the socket is listening it prints how to send a request (a curl line and an openai
client snippet), so the first thing a user sees is something to paste.
"""

from __future__ import annotations

import argparse
import logging

from ..engine.arg_utils import EngineArgs, memory_size
from .args import ServerArgs

__all__ = ["add_arguments", "banner", "memory_size", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    ServerArgs.add_cli_args(p)


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


def run(ns: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.llm_engine import LLMEngine
    from .app import build_server
    from .async_engine import AsyncEngine
    from .drain import Drain, DrainingServer
    from .limits import GuardedH11Protocol
    from .metrics import ServerMetrics

    try:
        args, engine_args = ServerArgs.from_cli_args(ns), EngineArgs.from_cli_args(ns)
        engine_args.create_engine_config(**args.engine_overrides())  # every option checked before loading
    except ValueError as e:
        raise SystemExit(f"kvmosaic serve: error: {e}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_args.create_engine_config(**args.engine_overrides())
    print(f"loading {config.model or 'the shipped model'} ({config.dtype}"
          f"{', chosen by --dtype auto' if engine_args.dtype == 'auto' else ''}"
          f"{f', {config.quantization} weight-only' if config.quantization else ''}) ...", flush=True)
    publisher = args.event_publisher()
    async_engine = AsyncEngine.launch(lambda: LLMEngine(config), on_flush=publisher.publish if publisher else None)
    engine = async_engine.engine
    model_name = args.served_model_name or engine.model_name
    metrics = ServerMetrics(lambda: async_engine.stats, model_name)
    async_engine.on_finish = metrics.on_finish
    drain = Drain(args.shutdown_timeout)
    app = build_server(async_engine, args, model_name, metrics, drain)
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
