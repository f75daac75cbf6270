"""What structured output costs (issue 21): ``python -m benchmarks.structured_cost``.

One ``kvmosaic serve``; the same chat request ("Describe a person as JSON.", sampled at
temperature 1.0, a seed per request) sent ``--requests`` times one at a time, streamed, without
and with ``response_format`` = a JSON schema (llguidance's token mask, engine/structured.py).
Prints, per mode, the inter-token latency p50 (first to last content chunk, per token), decode
tok/s over all requests, and — with the schema — how many outputs parse and validate against it
(target: all). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics

import httpx
import jsonschema

from kvmosaic.bench.machine import describe
from kvmosaic.bench.sse import content_deltas
from kvmosaic.server.launch import ServerProcess

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]}}}


def one(client: httpx.Client, seed: int, schema: bool, max_tokens: int) -> tuple[str, list[float]]:
    """The streamed text and the arrival time of each content chunk."""
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(content_deltas(client, "/v1/chat/completions", body))
    return "".join(text for _, text in chunks), [t for t, _ in chunks]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=80)
    args = p.parse_args(argv)
    print(f"machine: {describe()}\n")
    print("| mode | ITL p50 ms | decode tok/s | valid JSON for the schema |\n|---|---|---|---|")
    with ServerProcess("--dtype", args.dtype) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        one(client, 0, True, 8)  # warm up: the grammar compiler, the kernels
        itl = {}
        for schema in (False, True):
            gaps, tokens, busy, ok = [], 0, 0.0, 0
            for i in range(args.requests):
                text, times = one(client, i, schema, args.max_tokens)
                if len(times) > 1:
                    gaps.append((times[-1] - times[0]) / (len(times) - 1))
                    busy += times[-1] - times[0]
                    tokens += len(times) - 1
                ok += valid(text)
            itl[schema] = statistics.median(gaps)
            name = "json_schema" if schema else "free text"
            validity = f"{ok} of {args.requests}" if schema else "-"
            print(f"| {name} | {itl[schema] * 1e3:.1f} | {tokens / busy:.1f} | {validity} |", flush=True)
    print(f"\nITL with the schema / without: {itl[True] / itl[False]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
