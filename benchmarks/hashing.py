"""Chain hashing of one long prompt: kvmosaic's hash functions against vLLM's own, side by side.

``python -m benchmarks.hashing [--vllm-wheel PATH] [--tokens 32768]``

vLLM's code is run as it ships, never copied: ``vllm/utils/hashing.py`` (its ``sha256_cbor``
and pickle ``sha256``) and ``hash_block_tokens`` from ``vllm/v1/core/kv_cache_utils.py`` are
read from an installed vLLM or from a wheel (``pip download vllm --no-deps``), the function
compiled on its own (importing ``kv_cache_utils`` would pull in vLLM's whole engine). Each
contender hashes the same prompt's full blocks into a chain, best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import random
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn, make_seed

VLLM_FILES = ("vllm/utils/hashing.py", "vllm/v1/core/kv_cache_utils.py")


def vllm_sources(wheel: str | None) -> tuple[Path, str] | None:
    """A folder holding vLLM's two files, and the version; None when there is no vLLM."""
    if wheel:
        out = Path(tempfile.mkdtemp(prefix="vllm-src-"))
        with zipfile.ZipFile(wheel) as z:
            for name in VLLM_FILES:
                z.extract(name, out)
        return out, Path(wheel).name.split("-")[1]
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    from importlib.metadata import version

    return Path(next(iter(spec.submodule_search_locations))).parent, version("vllm")


def load_vllm(root: Path) -> tuple[dict[str, Callable], Callable]:
    """vLLM's hash functions (by its names) and its ``hash_block_tokens``."""
    spec = importlib.util.spec_from_file_location("vllm_hashing", root / VLLM_FILES[0])
    hashing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hashing)
    tree = ast.parse((root / VLLM_FILES[1]).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "hash_block_tokens")
    namespace = {"BlockHash": bytes, "NONE_HASH": b"\0" * 32, "Any": object, "Callable": Callable,
                 "Sequence": list}
    exec(compile(ast.Module([fn], []), str(root / VLLM_FILES[1]), "exec"), namespace)  # noqa: S102
    return {"sha256_cbor": hashing.sha256_cbor, "sha256": hashing.sha256}, namespace["hash_block_tokens"]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hashing", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--vllm-wheel", default=None, help="a vLLM wheel to read vLLM's hashing from")
    args = p.parse_args(argv)
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.tokens)]
    bs, n_blocks = args.block_size, args.tokens // args.block_size
    rows: list[tuple[str, float]] = []
    for algo in ("sha256", "sha256_cbor", "xxh3_128"):
        ns = CacheNamespace(make_seed("bench", "bfloat16", bs, algo))
        hash_fn = get_hash_fn(algo)
        rows.append((f"kvmosaic {algo}", best_ms(lambda ns=ns, fn=hash_fn: BlockHasher(ns, bs, fn).update(tokens), args.repeats)))
    found = vllm_sources(args.vllm_wheel)
    version = None
    if found is not None:
        root, version = found
        fns, hash_block_tokens = load_vllm(root)

        def vllm_chain(hash_fn: Callable) -> None:
            parent = None
            for i in range(n_blocks):
                parent = hash_block_tokens(hash_fn, parent, tokens[i * bs : (i + 1) * bs], None)

        for name, fn in fns.items():
            rows.append((f"vLLM {version} {name}", best_ms(lambda fn=fn: vllm_chain(fn), args.repeats)))
    print(f"Chain hashing of a {args.tokens}-token prompt ({n_blocks} blocks of {bs}), best of {args.repeats}, "
          f"Python {sys.version.split()[0]}")
    print("\n| hash | ms | speed vs vLLM sha256_cbor |\n|---|---|---|")
    ref = dict(rows).get(f"vLLM {version} sha256_cbor")
    for name, ms in rows:
        ratio = f"{ref / ms:.2f}x" if ref else "no vLLM found (pass --vllm-wheel)"
        print(f"| {name} | {ms:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
