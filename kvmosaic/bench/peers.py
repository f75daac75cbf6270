"""The engines compared, behind one interface: ``generate(prompt_ids, max_tokens)``.

Every peer runs greedy decoding for exactly ``max_tokens`` tokens (EOS does not stop it), one
request at a time, and times the same two moments from the call: the first generated token
being available to Python (TTFT) and the last one (end to end).
"""

from __future__ import annotations

import importlib.util

from .peer_api import Generation, PeerSettings, clock

__all__ = ["ALL_PEERS", "DEFAULT_PEERS", "QUICK_PEERS", "Generation", "PeerSettings", "clock", "import_libraries", "make_peer",
           "unavailable_reason"]

KVMOSAIC_CACHES = {"kvmosaic-none": "none", "kvmosaic-hash": "hash", "kvmosaic-radix": "radix",
                   "kvmosaic-hash-int8": "hash"}
# Opt-in configurations: weight-only int8 (model/quant.py) is not kvmosaic's default numerics.
KVMOSAIC_QUANTIZATION = {"kvmosaic-hash-int8": "int8"}
ALL_PEERS = (*KVMOSAIC_CACHES, "transformers", "transformers-prompt-cache", "transformers-cb", "llama-cpp-ramcache")
DEFAULT_PEERS = tuple(p for p in ALL_PEERS if p not in KVMOSAIC_QUANTIZATION)
# --quick is a smoke test that must finish in a minute (measured: 55 s for `kvmosaic bench all
# --quick` on the 2-core machine; 69 s with kvmosaic-radix too): each peer is a process that loads
# the model, so it runs the cache on and off, and transformers, the peer every user has.
QUICK_PEERS = ("kvmosaic-none", "kvmosaic-hash", "transformers")


def unavailable_reason(name: str) -> str | None:
    """Why peer ``name`` cannot run here, or None when it can."""
    if name not in ALL_PEERS:
        return f"unknown peer {name!r}; choose from {', '.join(ALL_PEERS)}"
    if name == "kvmosaic-radix" and importlib.util.find_spec("kvmosaic.cache.radix") is None:
        return "kvmosaic-radix skipped: kvmosaic/cache/radix.py does not exist yet (radix backend not landed)"
    if name == "transformers-cb" and importlib.util.find_spec("transformers.generation.continuous_batching") is None:
        return "transformers-cb skipped: this transformers has no continuous batching (generate_batch, 5.x)"
    if name == "llama-cpp-ramcache" and importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-ramcache skipped: llama-cpp-python is not installed "
                "(run scripts/install_llama_cpp.sh, about 4 minutes to compile)")
    return None


def import_libraries(name: str) -> None:
    """Import what peer ``name`` needs, so a worker's memory baseline includes the libraries
    (and only the model and its caches count as the peer's memory)."""
    import torch  # noqa: F401 - every peer finds the model through kvmosaic, which uses torch

    if name.startswith("transformers"):
        import transformers  # noqa: F401
    if name == "llama-cpp-ramcache":
        import llama_cpp  # noqa: F401
    if name in KVMOSAIC_CACHES:
        import kvmosaic.engine.llm  # noqa: F401 - the engine and what it imports (the package is lazy)


def make_peer(name: str, settings: PeerSettings):
    if name in KVMOSAIC_CACHES:
        from .peer_kvmosaic import KvmosaicPeer

        return KvmosaicPeer(KVMOSAIC_CACHES[name], settings, KVMOSAIC_QUANTIZATION.get(name))
    if name == "transformers-cb":
        from .peer_transformers_cb import TransformersCBPeer

        return TransformersCBPeer(settings)
    if name.startswith("transformers"):
        from .peer_transformers import TransformersPeer

        return TransformersPeer(settings, reuse_prompts=name == "transformers-prompt-cache")
    if name == "llama-cpp-ramcache":
        from .peer_llama_cpp import LlamaCppPeer

        return LlamaCppPeer(settings)
    raise ValueError(unavailable_reason(name) or name)
