"""``kvmosaic explain``: where and why a prompt stops reusing cached KV.

Two modes:

* ``kvmosaic explain A B`` compares two prompts (text, or paths of files holding them):
  the first differing token, the block where the hash chain breaks (with both block hashes),
  the text around the break, and how many tokens of B the hash and the radix backends would
  reuse after A, with the reasons (namespace differs, a token differs, a partial block, the
  last prompt token is always recomputed);
* ``kvmosaic explain B --against earlier.txt`` replays earlier prompts (one per line, or a
  JSON list, or a JSONL file of ``{"prompt": ..., "cache_salt": ...}``) into both cache
  backends in process (bookkeeping only: no model runs) and explains B against that cache.

Tokens come from the real tokenizer of the model (the shipped one unless ``--model``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from .cache.block_pool import BlockPool
from .cache.hash_manager import HashCacheManager
from .cache.hashing import DEFAULT_HASH_ALGO, BlockHasher, CacheNamespace, get_hash_fn, make_seed
from .cache.manager import KVCacheManager, PlainRequest
from .cache.radix import RadixCacheManager
from .cache.radix_tree import common_prefix_len
from .engine.arg_utils import QUANTIZATION_CHOICES
from .tiers import TierStack

CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    cache_salt: str | None = None
    adapter_id: str | None = None
    label: str = ""


@dataclass
class Explanation:
    """How much of ``b`` is reusable after ``a`` was cached, and why not more."""

    len_a: int
    len_b: int
    block_size: int
    first_diff: int | None  # token index of the first difference (None: one is a prefix)
    common_tokens: int  # tokens before the break (0 when the namespaces differ)
    break_block: int | None  # the first block of b whose chained hash is not a's
    hash_reuse: int
    radix_reuse: int
    reasons: list[str] = field(default_factory=list)
    hash_a: str | None = None  # the two block hashes at the break, hex prefixes
    hash_b: str | None = None


def _request(rid: str, p: Prompt) -> PlainRequest:
    return PlainRequest(rid, list(p.tokens), p.cache_salt, p.adapter_id)


def compare(a: Prompt, b: Prompt, block_size: int = 16, hash_algo: str = "sha256_cbor") -> Explanation:
    """Explain reusing ``a``'s cached KV (its whole prompt computed) for ``b``."""
    bs = block_size
    limit = len(b.tokens) - 1  # the last prompt token is always recomputed
    ex = Explanation(len(a.tokens), len(b.tokens), bs, None, 0, None, 0, 0)
    if (a.cache_salt, a.adapter_id) != (b.cache_salt, b.adapter_id):
        what = "cache salt" if a.cache_salt != b.cache_salt else "adapter id"
        ex.reasons.append(f"the {what} differs ({_show(a, what)} vs {_show(b, what)}): different "
                          "namespaces never share KV, so nothing is reused")
        ex.break_block = 0
        ex.first_diff = 0
    else:
        common = common_prefix_len(a.tokens, b.tokens)
        ex.common_tokens = common
        if common < min(len(a.tokens), len(b.tokens)):
            ex.first_diff = common
            ex.reasons.append(f"token {common} differs: {a.tokens[common]} vs {b.tokens[common]}")
        usable = min(common, limit)
        ex.radix_reuse = usable
        ex.hash_reuse = usable // bs * bs
        ex.break_block = usable // bs
        if usable == limit and common > limit:
            ex.reasons.append(f"b is covered up to its last token ({limit}), which is always "
                              "recomputed (its logits are needed)")
        if usable % bs:
            ex.reasons.append(f"the match ends inside block {usable // bs} ({usable % bs} of {bs} "
                              f"tokens): hash caches only full blocks and reuses {ex.hash_reuse}; "
                              f"radix copies the {usable % bs} tokens (copy-on-write) and reuses {usable}")
        if common == len(a.tokens) and common < limit:
            ex.reasons.append(f"a ends at token {common}: the rest of b was never computed")
    seed = make_seed("explain", "any", bs, hash_algo)
    ha = BlockHasher(CacheNamespace(seed, a.cache_salt, a.adapter_id), bs, get_hash_fn(hash_algo)).update(a.tokens)
    hb = BlockHasher(CacheNamespace(seed, b.cache_salt, b.adapter_id), bs, get_hash_fn(hash_algo)).update(b.tokens)
    if ex.break_block is not None:
        i = ex.break_block
        ex.hash_a = ha[i].hex()[:12] if i < len(ha) else "(partial block: no hash)"
        ex.hash_b = hb[i].hex()[:12] if i < len(hb) else "(partial block: no hash)"
    return ex


def tier_sources(prompt: Prompt, tiers: TierStack, seed: bytes, block_size: int, hash_algo: str) -> list[str | None]:
    """Per full block of ``prompt``: the tier a load would take it from (the fastest holding
    it), None from the first block no tier holds. Presence only: a load still verifies it."""
    ns = CacheNamespace(seed, prompt.cache_salt, prompt.adapter_id)
    chain = BlockHasher(ns, block_size, get_hash_fn(hash_algo)).update(prompt.tokens)
    return [None if i is None else tiers[i].name for i in tiers.lookup(chain)]


def format_tier_sources(sources: list[str | None], block_size: int, num_tokens: int) -> str:
    runs: list[list] = []
    for i, name in enumerate(sources):
        if runs and runs[-1][0] == name:
            runs[-1][2] = i
        else:
            runs.append([name, i, i])
    lines = [f"{num_tokens} tokens, {len(sources)} full blocks of {block_size}:"]
    for name, lo, hi in runs:
        where = f"from the {name} tier" if name else "in no tier: computed (or from the pool, if it holds them)"
        lines.append(f"  blocks {lo}-{hi} (tokens {lo * block_size}-{(hi + 1) * block_size - 1}): {where}")
    return "\n".join(lines)


def _show(p: Prompt, what: str) -> str:
    return repr(p.cache_salt if what == "cache salt" else p.adapter_id)


@dataclass
class CacheReplay:
    """Both backends, fed with the same earlier prompts (bookkeeping only)."""

    hash: KVCacheManager
    radix: KVCacheManager
    earlier: list[Prompt]


def replay(earlier: list[Prompt], block_size: int = 16, num_blocks: int | None = None) -> CacheReplay:
    """Cache every earlier prompt in both backends, as if each had been prefilled."""
    total = sum(len(p.tokens) // block_size + 2 for p in earlier) + 8
    seed = make_seed("explain", "any", block_size, "sha256_cbor")
    hashm = HashCacheManager(BlockPool(num_blocks or total, block_size), seed, get_hash_fn("sha256_cbor"))
    radix = RadixCacheManager(BlockPool(num_blocks or total, block_size), seed)
    for i, p in enumerate(earlier):
        for mgr in (hashm, radix):
            req = _request(f"earlier-{i}", p)
            match = mgr.match_prefix(req)
            if mgr.allocate_slots(req, len(p.tokens), match) is None:
                continue
            mgr.take_pending_copies()
            mgr.commit(req, len(p.tokens))
            mgr.free(req)
    return CacheReplay(hashm, radix, earlier)


@dataclass
class AgainstCache:
    hash_reuse: int
    radix_reuse: int
    closest: Prompt | None
    explanation: Explanation | None


def against_cache(cache: CacheReplay, prompt: Prompt) -> AgainstCache:
    """What each backend reuses for ``prompt``, explained against the closest earlier prompt."""
    req = _request("query", prompt)
    hash_hit = cache.hash.match_prefix(req).num_tokens
    radix_hit = cache.radix.match_prefix(req).num_tokens
    cache.hash.free(req)  # drops the per-request hash chain the lookup built
    cache.radix.free(req)
    same_ns = [p for p in cache.earlier if (p.cache_salt, p.adapter_id) == (prompt.cache_salt, prompt.adapter_id)]
    pool = same_ns or cache.earlier
    closest = max(pool, key=lambda p: common_prefix_len(p.tokens, prompt.tokens), default=None)
    ex = compare(closest, prompt, cache.hash.block_size) if closest is not None else None
    return AgainstCache(hash_hit, radix_hit, closest, ex)


# ---- text and the command line -----------------------------------------------------------

def _around(tokenizer, tokens: list[int], pos: int) -> str:
    lo, hi = max(0, pos - CONTEXT_TOKENS), min(len(tokens), pos + CONTEXT_TOKENS)
    before = tokenizer.decode(tokens[lo:pos])
    after = tokenizer.decode(tokens[pos:hi])
    return f"{'...' if lo else ''}{before!r} >>> {after!r}{'...' if hi < len(tokens) else ''}"


def format_explanation(ex: Explanation, a: Prompt, b: Prompt, tokenizer) -> str:
    bs = ex.block_size
    lines = [f"a: {ex.len_a} tokens ({-(-ex.len_a // bs)} blocks of {bs}); "
             f"b: {ex.len_b} tokens ({-(-ex.len_b // bs)} blocks)"]
    if ex.first_diff is not None and (a.cache_salt, a.adapter_id) == (b.cache_salt, b.adapter_id):
        p = ex.first_diff
        ta = repr(tokenizer.decode(a.tokens[p : p + 1])) if p < ex.len_a else "(end)"
        tb = repr(tokenizer.decode(b.tokens[p : p + 1])) if p < ex.len_b else "(end)"
        lines.append(f"first difference at token {p} (block {p // bs}, offset {p % bs}): {ta} vs {tb}")
        lines.append(f"  a: {_around(tokenizer, a.tokens, p)}")
        lines.append(f"  b: {_around(tokenizer, b.tokens, p)}")
    elif ex.first_diff is None:
        shorter = "a" if ex.len_a <= ex.len_b else "b"
        lines.append(f"no token differs: {shorter} is a prefix of the other")
    if ex.break_block is not None:
        lines.append(f"hash chain breaks at block {ex.break_block} (tokens {ex.break_block * bs}-"
                     f"{ex.break_block * bs + bs - 1}): a {ex.hash_a} vs b {ex.hash_b}")
    lines.append(f"reused for b: hash {ex.hash_reuse} tokens, radix {ex.radix_reuse} tokens "
                 f"(of {ex.len_b}; {ex.len_b - ex.radix_reuse} recomputed with radix)")
    lines += [f"  why: {r}" for r in ex.reasons]
    return "\n".join(lines)


def load_prompt_arg(value: str) -> str:
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text()
    except OSError:
        pass
    return value


def load_earlier(path: str) -> list[dict]:
    """One prompt per line; or a JSON list of strings/objects; or JSONL objects."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        items = json.loads(text)
    elif text.lstrip().startswith("{"):
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    return [{"prompt": it} if isinstance(it, str) else it for it in items]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", help="one or two prompts: text, or paths of files holding them")
    p.add_argument("--against", help="earlier prompts to cache first (lines, JSON list or JSONL)")
    p.add_argument("--salt", nargs="*", default=[], help="cache salt of a and b (one or two values; '-' for none)")
    p.add_argument("--adapter", nargs="*", default=[], help="adapter id of a and b ('-' for none)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", default=None, help="GGUF file or folder whose tokenizer to use (default: shipped)")
    p.add_argument("--kv-tier", action="append", default=None, metavar="SPEC", dest="kv_tiers",
                   help="with one prompt: say from which of these storage tiers each block would load "
                        "(as `kvmosaic serve --kv-tier`; repeatable)")
    p.add_argument("--dtype", default="auto", help="the serving engine's dtype (names its blocks, with --kv-tier)")
    p.add_argument("--hash-algo", default=DEFAULT_HASH_ALGO, help="the serving engine's hash_algo (with --kv-tier)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="the serving engine's --quantization (names its blocks, with --kv-tier)")


def _opt(values: list[str], i: int) -> str | None:
    v = values[min(i, len(values) - 1)] if values else None
    return None if v in (None, "-") else v


def run(args: argparse.Namespace) -> int:
    tiers_only = len(args.prompts) == 1 and args.against is None and args.kv_tiers
    if not tiers_only and (len(args.prompts) > 2 or (len(args.prompts) == 1) == (args.against is None)):
        print("give two prompts, one prompt and --against FILE, or one prompt and --kv-tier SPEC")
        return 2
    from .server.tokenizer import tokenizer_for

    tok = tokenizer_for(args.model)

    def encode(text: str, i: int, salt: str | None = None, adapter: str | None = None) -> Prompt:
        ids = tok.encode(text, add_special_tokens=False)
        return Prompt(list(ids), salt if salt is not None else _opt(args.salt, i),
                      adapter if adapter is not None else _opt(args.adapter, i), f"prompt {i}")

    if tiers_only:
        import torch

        from .engine.config import auto_dtype
        from .model.loader import weights_fingerprint
        from .model.quant import quantized_fingerprint
        from .tiers import build_tiers

        dtype = auto_dtype(torch.device("cpu")) if args.dtype == "auto" else args.dtype
        fingerprint = quantized_fingerprint(weights_fingerprint(args.model), args.quantization)
        seed = make_seed(fingerprint, dtype, args.block_size, args.hash_algo)
        query = encode(load_prompt_arg(args.prompts[0]), 0)
        stack = TierStack(build_tiers(args.kv_tiers))
        try:
            sources = tier_sources(query, stack, seed, args.block_size, args.hash_algo)
        finally:
            stack.close()
        print(format_tier_sources(sources, args.block_size, len(query.tokens)))
        return 0
    if args.against is None:
        a = encode(load_prompt_arg(args.prompts[0]), 0)
        b = encode(load_prompt_arg(args.prompts[1]), 1)
        print(format_explanation(compare(a, b, args.block_size), a, b, tok))
        return 0
    earlier = [encode(e["prompt"], 0, e.get("cache_salt"), e.get("adapter_id")) for e in load_earlier(args.against)]
    query = encode(load_prompt_arg(args.prompts[0]), 1)
    res = against_cache(replay(earlier, args.block_size), query)
    print(f"against {len(earlier)} cached prompts: hash reuses {res.hash_reuse} tokens, "
          f"radix {res.radix_reuse} (of {len(query.tokens)})")
    if res.closest is not None and res.explanation is not None:
        print(f"closest earlier prompt: #{earlier.index(res.closest)}")
        print(format_explanation(res.explanation, res.closest, query, tok))
    return 0
