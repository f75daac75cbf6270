"""The benchmark workloads (docs/ARCHITECTURE.md), each generated deterministically from a seed.

A workload is a list of :class:`Request`: a chat (rendered with the model's chat template), a
raw completion prompt, or the next user turn of a conversation (``conversation`` set, only the
new user message given): the runner then builds the prompt from that conversation's earlier
prompt and the tokens the peer generated, so generated tokens are part of the next prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import text


@dataclass(frozen=True)
class Request:
    messages: tuple[dict, ...] = ()  # chat messages, rendered with the chat template
    text: str | None = None  # or a raw completion prompt
    conversation: str | None = None  # multi-turn: continue this conversation
    max_tokens: int = 16


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Sizes:
    """Knobs shared by the workloads; ``QUICK`` is a smoke test, ``FULL`` finishes in minutes
    on a 2-core machine."""

    requests: int
    system_words: int
    max_tokens: int
    tenants: int
    conversations: int
    turns: int
    answer_tokens: int
    examples: int
    pool_docs: int
    docs_per_prompt: int
    doc_words: int
    noise_words: int


FULL = Sizes(requests=6, system_words=750, max_tokens=8, tenants=3, conversations=2, turns=3,
             answer_tokens=16, examples=14, pool_docs=6, docs_per_prompt=3, doc_words=80,
             noise_words=240)
QUICK = Sizes(requests=2, system_words=40, max_tokens=2, tenants=2, conversations=1, turns=2,
              answer_tokens=3, examples=3, pool_docs=3, docs_per_prompt=2, doc_words=15,
              noise_words=30)


def _chat(system: str, user: str, max_tokens: int, conversation: str | None = None) -> Request:
    msgs = ({"role": "system", "content": system}, {"role": "user", "content": user})
    return Request(messages=msgs, conversation=conversation, max_tokens=max_tokens)


def shared_system_prompt(rng: random.Random, s: Sizes) -> Workload:
    system = text.system_prompt(rng, s.system_words)
    reqs = tuple(_chat(system, text.question(rng), s.max_tokens) for _ in range(s.requests))
    return Workload("shared-system-prompt", "one long system prompt, short distinct questions", reqs)


def multi_tenant(rng: random.Random, s: Sizes) -> Workload:
    systems = [text.system_prompt(rng, s.system_words) for _ in range(s.tenants)]
    n = s.tenants * max(2, s.requests // 2)
    reqs = tuple(_chat(systems[i % s.tenants], text.question(rng), s.max_tokens) for i in range(n))
    return Workload("multi-tenant", f"{s.tenants} system prompts, requests interleaved round robin", reqs)


def multi_turn(rng: random.Random, s: Sizes) -> Workload:
    systems = [text.system_prompt(rng, s.system_words // 2) for _ in range(s.conversations)]
    reqs = []
    for turn in range(s.turns):
        for c in range(s.conversations):
            conv = f"conversation-{c}"
            if turn == 0:
                reqs.append(_chat(systems[c], text.question(rng), s.answer_tokens, conv))
            else:
                user = {"role": "user", "content": text.question(rng)}
                reqs.append(Request(messages=(user,), conversation=conv, max_tokens=s.answer_tokens))
    return Workload("multi-turn", f"{s.conversations} conversations x {s.turns} turns, answers fed back",
                    tuple(reqs))


def few_shot(rng: random.Random, s: Sizes) -> Workload:
    examples = "\n\n".join(text.qa_example(rng) for _ in range(s.examples))
    header = "Answer each question in the style of the examples.\n\n" + examples
    reqs = []
    for _ in range(s.requests):
        q = text.qa_example(rng).split("\nA:")[0]
        reqs.append(Request(text=f"{header}\n\n{q}\nA:", max_tokens=s.max_tokens))
    return Workload("few-shot", f"{s.examples} shared examples, varying query (raw completion)", tuple(reqs))


def rag_reorder(rng: random.Random, s: Sizes) -> Workload:
    system = "Answer from the documents below only; cite the document number."
    pool = [text.document(rng, i, s.doc_words) for i in range(s.pool_docs)]
    reqs = []
    for _ in range(s.requests):
        docs = rng.sample(pool, s.docs_per_prompt)
        reqs.append(_chat(system + "\n\n" + "\n\n".join(docs), text.question(rng), s.max_tokens))
    return Workload("rag-reorder", f"{s.docs_per_prompt} of {s.pool_docs} documents in varying order",
                    tuple(reqs))


def no_reuse(rng: random.Random, s: Sizes) -> Workload:
    reqs = []
    for i in range(2 * s.requests):  # twice as many: its target is a 3% difference
        opener = f"{rng.choice(text.NAMES)} {rng.randint(1000, 9999)} {i}:"
        reqs.append(Request(text=f"{opener} {text.paragraph(rng, s.noise_words)}", max_tokens=s.max_tokens))
    return Workload("no-reuse", "random distinct raw prompts: the cost of caching when nothing hits",
                    tuple(reqs))


BUILDERS = {
    "shared-system-prompt": shared_system_prompt,
    "multi-tenant": multi_tenant,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "rag-reorder": rag_reorder,
    "no-reuse": no_reuse,
}


def build(name: str, seed: int, quick: bool = False) -> Workload:
    """The workload ``name``, the same for the same seed (each workload has its own stream)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(BUILDERS)} or 'all'")
    rng = random.Random(f"{seed}:{name}")
    return BUILDERS[name](rng, QUICK if quick else FULL)
