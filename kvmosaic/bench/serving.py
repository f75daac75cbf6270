"""``kvmosaic bench serve``: a serving benchmark in the manner of vLLM's ``benchmark_serving``.

Each peer's HTTP server is started here (one at a time, on a free loopback port), warmed with one
request, then driven by the official ``openai`` ``AsyncOpenAI`` client, streaming:

- closed loop at each ``--concurrency`` level (N clients, each sends its next request when its
  previous one has finished), and, with ``--rate``, open loop with Poisson arrivals;
- workloads: ``shared-prefix`` (chat requests sharing one ~800-token system prompt, distinct short
  questions) and ``no-reuse`` (chat requests of about the same length with nothing in common).

Every (workload, load level) pair uses prompts of its own (a fresh system prompt per level), so a
level never hits blocks cached by an earlier level, on any peer, without a cache reset.

Measured per (peer, workload, level): TTFT p50/p99 (request sent to the first content chunk),
inter-token latency p50/p99 (gaps between content chunks after the first), output tok/s and total
(prompt + output) tok/s over the level's wall time, cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``), and for kvmosaic its KV pool, sampled from
``/health`` during the level (see :data:`POOL_NOTE`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import text

SERVE_PEERS = ("kvmosaic-hash", "kvmosaic-radix", "kvmosaic-none", "transformers-serve", "llama-cpp-server")
DEFAULT_SERVE_PEERS = ("kvmosaic-hash", "kvmosaic-radix", "kvmosaic-none", "transformers-serve", "llama-cpp-server")
SERVE_WORKLOADS = ("shared-prefix", "no-reuse")

POOL_NOTE = (
    "KV pool: *blocks used* is the peak of kvmosaic's /health kv.num_used_blocks during the level, and *pool "
    "util.* the median over samples with requests running of kv.num_used_slots / kv.num_allocated_slots: slots "
    "holding a computed token among the slots of the blocks running requests hold (a shared block counts "
    "once). Servers without those fields get an estimate from client-side token counts, which can exceed 100% when "
    "requests share blocks."
)


@dataclass(frozen=True)
class ServeSizes:
    system_words: int  # shared-prefix system prompt (750 words ~ 800 tokens with the chat template)
    max_tokens: int
    requests: int  # per closed-loop level: max(requests, 2 x concurrency)
    concurrency: tuple[int, ...]


FULL = ServeSizes(system_words=600, max_tokens=32, requests=32, concurrency=(1, 4, 16, 32))
QUICK = ServeSizes(system_words=120, max_tokens=8, requests=4, concurrency=(1, 4))


# ---- workloads ---------------------------------------------------------------------------------

def serve_requests(workload: str, n: int, sizes: ServeSizes, seed: int, level: str) -> list[list[dict]]:
    """``n`` chat message lists for ``workload`` at load level ``level`` (its own prompts)."""
    rng = random.Random(f"{seed}:serve:{workload}:{level}")
    if workload == "shared-prefix":
        system = f"[{level}] " + text.system_prompt(rng, sizes.system_words)
        return [[{"role": "system", "content": system}, {"role": "user", "content": text.question(rng)}]
                for _ in range(n)]
    if workload == "no-reuse":
        out = []
        for i in range(n):
            opener = f"{rng.choice(text.NAMES)} {rng.randint(1000, 9999)} {level} {i}:"
            out.append([{"role": "system", "content": f"{opener} {text.paragraph(rng, sizes.system_words)}"},
                        {"role": "user", "content": text.question(rng)}])
        return out
    raise ValueError(f"unknown serving workload {workload!r}; choose from {', '.join(SERVE_WORKLOADS)}")


# ---- statistics --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def inter_token_gaps(chunk_times: list[float]) -> list[float]:
    """Gaps between consecutive content chunks (the first chunk's arrival is TTFT, not a gap)."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since start, content chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    peer: str
    workload: str
    mode: str  # "closed" or "poisson"
    level: float  # concurrency, or request rate (req/s) for poisson
    requests: int
    failed: int
    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    output_tps: float
    total_tps: float
    blocks_used_peak: int | None = None
    num_blocks: int | None = None
    pool_util: float | None = None
    errors: list[str] = field(default_factory=list)


def summarize_level(peer: str, workload: str, mode: str, level: float, results: list[RequestResult],
                    wall_s: float, pool: dict | None = None) -> LevelResult:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in inter_token_gaps(r.chunk_times)]
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    pool = pool or {}
    return LevelResult(
        peer=peer, workload=workload, mode=mode, level=level, requests=len(ok), failed=len(results) - len(ok),
        wall_s=wall_s, prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens for r in ok),
        ttft_p50=percentile([r.ttft for r in ok if r.ttft is not None], 50),
        ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None], 99),
        itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99),
        output_tps=completion / wall_s if wall_s else 0.0, total_tps=(prompt + completion) / wall_s if wall_s else 0.0,
        blocks_used_peak=pool.get("blocks_used_peak"), num_blocks=pool.get("num_blocks"), pool_util=pool.get("pool_util"),
        errors=sorted({r.error for r in results if r.error})[:3],
    )


# ---- report ------------------------------------------------------------------------------------

COLUMNS = ("workload", "engine", "load", "reqs", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
           "output tok/s", "total tok/s", "cached tok", "blocks used (peak/pool)", "pool util.", "x best peer tok/s")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1e3:,.0f}" if v >= 0.01 else f"{v * 1e3:.1f}"


def _load(r: LevelResult) -> str:
    return f"c={int(r.level)}" if r.mode == "closed" else f"{r.level:g} req/s"


def best_peer_ratios(rows: list[LevelResult], reference: str) -> dict[tuple, float]:
    """Per (workload, mode, level): the reference's total tok/s / the best other peer's."""
    out = {}
    for r in rows:
        if r.peer != reference:
            continue
        others = [o.total_tps for o in rows if o.peer != reference and (o.workload, o.mode, o.level) == (r.workload, r.mode, r.level)
                  and o.total_tps]
        if others:
            out[(r.workload, r.mode, r.level)] = r.total_tps / max(others)
    return out


def table(rows: list[LevelResult], reference: str = "kvmosaic-hash") -> str:
    ratios = best_peer_ratios(rows, reference)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        share = f" ({r.cached_tokens / r.prompt_tokens:.0%})" if r.prompt_tokens else ""
        blocks = f"{r.blocks_used_peak}/{r.num_blocks}" if r.blocks_used_peak is not None else "–"
        util = f"{r.pool_util:.0%}" if r.pool_util is not None else "–"
        ratio = ratios.get((r.workload, r.mode, r.level)) if r.peer == reference else None
        reqs = f"{r.requests}" + (f" ({r.failed} failed)" if r.failed else "")
        cells = (r.workload, r.peer, _load(r), reqs, _ms(r.ttft_p50), _ms(r.ttft_p99), _ms(r.itl_p50), _ms(r.itl_p99),
                 f"{r.output_tps:.0f}", f"{r.total_tps:.0f}", f"{r.cached_tokens}{share}", blocks, util,
                 "–" if ratio is None else f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


DEFINITIONS = """\
- *load*: c=N is a closed loop of N clients (each sends its next request when its last one ended);
  "R req/s" is an open loop with Poisson arrivals at R requests per second.
- *TTFT*: from sending the request to the first streamed chunk with content, at the client.
- *ITL*: gaps between consecutive content chunks of a request (all requests of the level pooled).
- *output / total tok/s*: completion tokens / (prompt + completion tokens) of the level over its
  wall time (first request sent to last response ended), token counts from each response's usage.
- *cached tok*: sum of usage.prompt_tokens_details.cached_tokens (share of prompt tokens).
- *x best peer tok/s*: the reference kvmosaic peer's total tok/s / the best other peer's at that load.
"""


def render(rows: list[LevelResult], header: dict[str, str], skipped: list[str], plots: list[str],
           reference: str = "kvmosaic-hash") -> str:
    parts = ["# kvmosaic bench serve", ""]
    parts += [f"- {k}: {v}" for k, v in header.items()]
    parts += [f"- skipped: {s}" for s in skipped]
    parts += ["", table(rows, reference), "", "## Definitions", "", DEFINITIONS, POOL_NOTE, ""]
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def plot(rows: list[LevelResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [r for r in rows if r.mode == "closed"]
    workloads = list(dict.fromkeys(r.workload for r in closed))
    peers = list(dict.fromkeys(r.peer for r in closed))
    cmap = plt.get_cmap("tab10")
    paths = []
    for metric, label, fname in (("total_tps", "total tok/s (prompt + output)", "serve_throughput.png"),
                                 ("ttft_p50", "TTFT p50 (ms)", "serve_ttft.png")):
        fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(6 * max(1, len(workloads)), 4.5), dpi=110, squeeze=False)
        for ax, wl in zip(axes[0], workloads or ["(none)"]):
            for i, peer in enumerate(peers):
                pts = sorted((r.level, getattr(r, metric)) for r in closed if r.workload == wl and r.peer == peer
                             and getattr(r, metric) is not None)
                if pts:
                    ys = [y * 1e3 if metric == "ttft_p50" else y for _, y in pts]
                    ax.plot([x for x, _ in pts], ys, marker="osD^v"[i % 5], label=peer, color=cmap(i % 10))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients (closed loop)")
            ax.set_ylabel(label)
            if metric == "ttft_p50":
                ax.set_yscale("log")
            ax.set_title(f"{wl}: {label.split(' (')[0]} against concurrency")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)
        paths.append(out / fname)
    return paths


# ---- peers -------------------------------------------------------------------------------------

KVMOSAIC_SERVE = {"kvmosaic-hash": "hash", "kvmosaic-radix": "radix", "kvmosaic-none": "none"}


def unavailable_reason(name: str) -> str | None:
    if name not in SERVE_PEERS:
        return f"unknown serving peer {name!r}; choose from {', '.join(SERVE_PEERS)}"
    if name == "kvmosaic-radix" and importlib.util.find_spec("kvmosaic.cache.radix") is None:
        return "kvmosaic-radix skipped: the radix backend is not there"
    if name == "llama-cpp-server" and importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-server skipped: llama-cpp-python is not installed "
                "(run scripts/install_llama_cpp.sh, about 4 minutes to compile)")
    if name == "transformers-serve" and importlib.util.find_spec("transformers") is None:
        return "transformers-serve skipped: transformers is not installed"
    return None


class ServerPeer:
    """One peer's HTTP server as a child process (``server.launch.ServerProcess``): ``argv`` with
    ``{port}`` filled in. transformers serve is ready at /health (its /v1/models scans the Hub
    cache and fails offline); the others at /v1/models, which also names the model."""

    def __init__(self, name: str, argv: list[str], extra_body: dict, usage_option: bool, kvmosaic: bool,
                 model: str | None = None) -> None:
        from kvmosaic.server.launch import ServerProcess

        self.name, self.extra_body, self.usage_option, self.kvmosaic = name, extra_body, usage_option, kvmosaic
        self.model = model
        self.server = ServerProcess(command=argv, ready_path="/health" if model else "/v1/models")
        self.url = self.server.url

    def start(self, timeout: float = 600.0) -> ServerPeer:
        import httpx

        try:
            self.server.start(timeout)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{self.name}: {e}") from None
        if not self.model:
            self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        return self

    def tail(self, n: int = 6) -> str:
        return " | ".join(self.server.output().strip().splitlines()[-n:])

    def stop(self) -> None:
        self.server.stop()


def export_gguf(gguf: Path) -> Path:
    """A safetensors folder (config with ``architectures``, tokenizer, chat template) holding the
    GGUF's weights as transformers loads them; made once, in ``~/.cache/kvmosaic/bench/``."""
    folder = Path(os.environ.get("KVMOSAIC_BENCH_CACHE", Path.home() / ".cache" / "kvmosaic" / "bench")) / f"hf-{gguf.stem}"
    if (folder / "model.safetensors").exists():
        return folder
    print(f"exporting {gguf.name} to {folder} for transformers serve (once) ...", flush=True)
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained({str(gguf.parent)!r}, gguf_file={gguf.name!r}, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained({str(gguf.parent)!r}, gguf_file={gguf.name!r})
cfg = m.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
cfg.architectures = [type(m).__name__]
plain = type(m)(cfg)
plain.load_state_dict(m.state_dict())
plain.save_pretrained({str(folder)!r})
tok.save_pretrained({str(folder)!r})
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"exporting {gguf.name} for transformers serve failed: {done.stderr.strip().splitlines()[-1:]}")
    return folder


def make_server_peer(name: str, dtype: str, threads: int | None, model_path: str | None) -> ServerPeer:
    from kvmosaic.model.loader import shipped_model_path

    gguf = Path(model_path or shipped_model_path())
    if name in KVMOSAIC_SERVE:
        argv = [sys.executable, "-m", "kvmosaic.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
                "--log-level", "warning", "--prefix-cache", KVMOSAIC_SERVE[name], "--dtype", dtype]
        argv += ["--num-threads", str(threads)] if threads else []
        argv += ["--model", str(gguf)] if model_path else []
        return ServerPeer(name, argv, {"ignore_eos": True}, usage_option=True, kvmosaic=True)
    if name == "transformers-serve":
        exe = str(Path(sys.executable).with_name("transformers"))
        # `transformers serve <dir>:<file>.gguf` fails in transformers 5.23 (model_manager._load_model:
        # `getattr(transformers, config.architectures[0])` -> TypeError: 'NoneType' object is not
        # subscriptable, a GGUF config has no architectures), so it serves the same weights exported once
        # (dequantized by transformers' GGUF loader, as it computes them) to a safetensors folder.
        folder = export_gguf(gguf)
        argv = [exe, "serve", str(folder), "--continuous-batching", "--dtype", dtype,
                "--device", "cpu", "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"]
        # transformers serve refuses stream_options (it always sends usage on the last chunk) and
        # has no ignore_eos: its requests may stop before max_tokens; completion tokens are counted.
        return ServerPeer(name, argv, {}, usage_option=False, kvmosaic=False, model=str(folder))
    if name == "llama-cpp-server":
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", "{port}", "--n_ctx", "4096", "--cache", "true"]
        argv += ["--n_threads", str(threads)] if threads else []
        return ServerPeer(name, argv, {"ignore_eos": True}, usage_option=True, kvmosaic=False)
    raise ValueError(unavailable_reason(name) or name)


# ---- the load generator ------------------------------------------------------------------------

async def one_request(client, peer: ServerPeer, messages: list[dict], max_tokens: int) -> RequestResult:
    kwargs = {"stream_options": {"include_usage": True}} if peer.usage_option else {}
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start)
    try:
        stream = await client.chat.completions.create(
            model=peer.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            extra_body=peer.extra_body or None, **kwargs)
        chunks = 0
        async for chunk in stream:
            now = time.perf_counter() - start
            if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                res.chunk_times.append(now)
                chunks += 1
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens or 0
                res.completion_tokens = chunk.usage.completion_tokens or 0
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                res.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
        res.e2e = time.perf_counter() - start
        res.ttft = res.chunk_times[0] if res.chunk_times else None
        res.completion_tokens = res.completion_tokens or chunks
        res.ok = True
    except Exception as err:  # noqa: BLE001 - counted as a failed request and reported
        res.error = f"{type(err).__name__}: {str(err)[:200]}"
    return res


class PoolSampler:
    """Samples kvmosaic's /health while a level runs (blocks in use) beside the client's view of
    the tokens in flight, for the pool utilisation estimate of :data:`POOL_NOTE`."""

    def __init__(self, url: str, block_size: int = 16, period: float = 0.25) -> None:
        self.url, self.block_size, self.period = url, block_size, period
        self.in_flight: dict[int, int] = {}  # request number -> prompt estimate + chunks so far
        self.peak, self.num_blocks, self.utils = 0, None, []

    async def run(self, stop: asyncio.Event) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=5) as http:
            while not stop.is_set():
                try:
                    kv = (await http.get(self.url + "/health")).json()["kv"]
                    used, self.num_blocks = kv["num_used_blocks"], kv["num_blocks"]
                    self.peak = max(self.peak, used)
                    if kv.get("num_allocated_slots"):  # exact, from the engine
                        self.utils.append(kv["num_used_slots"] / kv["num_allocated_slots"])
                    elif used and sum(self.in_flight.values()):  # an estimate (see POOL_NOTE)
                        self.utils.append(sum(self.in_flight.values()) / (used * self.block_size))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), self.period)
                except asyncio.TimeoutError:
                    pass

    def summary(self) -> dict:
        return {"blocks_used_peak": self.peak, "num_blocks": self.num_blocks,
                "pool_util": float(np.median(self.utils)) if self.utils else None}


async def run_level(peer: ServerPeer, convs: list[list[dict]], max_tokens: int, concurrency: int | None,
                    rate: float | None, seed: int, prompt_len: list[int]) -> tuple[list[RequestResult], float, dict | None]:
    """Closed loop at ``concurrency`` clients, or Poisson arrivals at ``rate`` req/s."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=peer.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    sampler = PoolSampler(peer.url) if peer.kvmosaic else None
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    results: list[RequestResult | None] = [None] * len(convs)

    async def tracked(i: int) -> None:
        if sampler:
            sampler.in_flight[i] = prompt_len[i]
        results[i] = await one_request(client, peer, convs[i], max_tokens)
        if sampler:
            sampler.in_flight.pop(i, None)

    start = time.perf_counter()
    if rate is None:
        queue = list(range(len(convs)))[::-1]

        async def worker() -> None:
            while queue:
                await tracked(queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        rng = random.Random(f"{seed}:poisson")
        tasks = []
        for i in range(len(convs)):
            tasks.append(asyncio.create_task(tracked(i)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    stop.set()
    if sampling:
        await sampling
    await client.close()
    return [r for r in results if r is not None], wall, sampler.summary() if sampler else None


# ---- command line ------------------------------------------------------------------------------

def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """The chat prompt's length in tokens (the server renders the same template)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(rendered, add_special_tokens=False))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench serve (workload 'serve')")
    g.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4,16,32 (quick: 1,4)")
    g.add_argument("--rate", type=float, action="append", default=[],
                   help="also run open-loop Poisson arrivals at this many requests/s (repeatable)")
    g.add_argument("--requests", type=int, default=None, help="requests per level (default 32, quick 4; at least the concurrency)")
    g.add_argument("--serve-workloads", default=",".join(SERVE_WORKLOADS), help=f"from: {', '.join(SERVE_WORKLOADS)}")
    g.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 32, quick 8)")


def command_line(args: argparse.Namespace, peers: str) -> str:
    parts = ["kvmosaic bench serve", "--peers", peers, "--serve-workloads", args.serve_workloads, "--dtype", args.dtype]
    parts += ["--quick"] if args.quick else []
    parts += ["--concurrency", args.concurrency] if args.concurrency else []
    parts += [x for r in args.rate for x in ("--rate", f"{r:g}")]
    parts += ["--requests", str(args.requests)] if args.requests else []
    parts += ["--max-tokens", str(args.max_tokens)] if args.max_tokens else []
    parts += ["--threads", str(args.threads)] if args.threads else []
    parts += ["--seed", str(args.seed)] if args.seed else []
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    from .cli import load_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = QUICK if args.quick else FULL
    sizes = ServeSizes(system_words=base.system_words, max_tokens=args.max_tokens or base.max_tokens,
                       requests=args.requests or base.requests,
                       concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else base.concurrency)
    peers_arg = args.peers if args.peers_given else ",".join(DEFAULT_SERVE_PEERS)
    workloads = [w.strip() for w in args.serve_workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in SERVE_WORKLOADS:
            print(f"unknown serving workload {w!r}; choose from {', '.join(SERVE_WORKLOADS)}")
            return 2
    skipped: list[str] = []
    names = []
    for name in (n.strip() for n in peers_arg.split(",") if n.strip()):
        reason = unavailable_reason(name)
        if reason:
            print(reason)
            skipped.append(reason)
        else:
            names.append(name)
    tokenizer = load_tokenizer(args.model)
    levels: list[tuple[str, float]] = [("closed", c) for c in sizes.concurrency] + [("poisson", r) for r in args.rate]
    plan = []  # (workload, mode, level, messages, prompt token estimates)
    for wl in workloads:
        for mode, level in levels:
            n = max(sizes.requests, int(level)) if mode == "closed" else max(sizes.requests, 8)
            convs = serve_requests(wl, n, sizes, args.seed, f"{mode}-{level:g}")
            lens = [prompt_tokens(tokenizer, c) for c in convs]
            plan.append((wl, mode, level, convs, lens))
    started = time.time()
    rows: list[LevelResult] = []
    peer_times: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        peer = make_server_peer(name, args.dtype, args.threads, args.model)
        try:
            print(f"starting {name} ...", flush=True)
            peer.start()
            print(f"{name} ready at {peer.url} (model {peer.model}) after {time.perf_counter() - t0:.0f} s", flush=True)
            warm = asyncio.run(run_level(peer, [[{"role": "user", "content": "Warm-up: say hello."}]], 2, 1, None,
                                         args.seed, [8]))[0]
            if not warm or not warm[0].ok:
                raise RuntimeError(f"warm-up request failed: {warm[0].error if warm else 'no result'}")
            for wl, mode, level, convs, lens in plan:
                res, wall, pool = asyncio.run(run_level(peer, convs, sizes.max_tokens, int(level) if mode == "closed" else None,
                                                        level if mode == "poisson" else None, args.seed, lens))
                row = summarize_level(name, wl, mode, level, res, wall, pool)
                rows.append(row)
                # partial results survive an interrupted run
                (out / "serve.partial.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
                print(f"  {wl} {_load(row)}: {row.requests} ok, {row.failed} failed, TTFT p50 {_ms(row.ttft_p50)} ms, "
                      f"total {row.total_tps:.0f} tok/s, cached {row.cached_tokens}/{row.prompt_tokens}"
                      + (f"; errors: {row.errors}" if row.errors else ""), flush=True)
        except (RuntimeError, TimeoutError, OSError) as err:
            skipped.append(f"{name} could not run: {str(err)[:600]}")
            print(skipped[-1], flush=True)
        finally:
            peer.stop()
        peer_times[name] = time.perf_counter() - t0
    ran = {r.peer for r in rows}
    reference = next((n for n in (args.reference, "kvmosaic-hash", "kvmosaic-radix") if n in ran), "kvmosaic-hash")
    pngs = plot(rows, out) if rows else []
    prompt_example = plan[0][4][0] if plan else 0
    header = {
        "command": f"`{command_line(args, peers_arg)}`",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "requests": (f"chat, {sizes.max_tokens} output tokens (greedy; kvmosaic and llama.cpp ignore EOS), "
                     f"first workload's prompt {prompt_example} tokens, {sizes.requests} requests per level "
                     f"(at least the concurrency), a fresh system prompt per level"),
        "reference for ratios": reference,
        "wall time": f"{time.time() - started:.0f} s ("
                     + ", ".join(f"{n} {t:.0f} s" for n, t in peer_times.items()) + ", server start included)",
    }
    md = render(rows, header, skipped, [p.name for p in pngs], reference)
    (out / "serve.md").write_text(md)
    (out / "serve.json").write_text(json.dumps({"header": header, "skipped": skipped,
                                                "rows": [asdict(r) for r in rows]}, indent=1))
    print(md)
    print(f"wrote {out}/serve.md, serve.json" + "".join(f", {p.name}" for p in pngs))
    return 0 if rows else 1
