"""The workloads of ``benchmarks.auto_reuse`` (issue 24): plain prompts nobody marked, as that module's
docstring describes them: RAG prompts of 5 of 20 documents in random order (text and chat form, and
with whole ~280-token documents), a ~2,000-token system prompt whose first line is a timestamp, and
multi-turn chats whose first user message is edited."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvmosaic.bench.text import paragraph

from .blend_quality import DOCS, QUESTIONS

SYSTEM = "You answer questions using only the documents the user gives you."


def document_pool() -> list[str]:
    """20 documents: each of blend_quality's 5 long documents cut into 4 parts."""
    pool = []
    for d, doc in enumerate(DOCS):
        sentences = doc.split(". ")
        step = -(-len(sentences) // 4)
        for p in range(4):
            part = ". ".join(sentences[p * step : (p + 1) * step]).rstrip(".") + "."
            pool.append(f"Document {d * 4 + p + 1}. {part.split('. ', 1)[1] if p == 0 else part}")
    return pool


POOL = document_pool()


def doc_with(answer: str) -> int:
    return next(i for i, d in enumerate(POOL) if answer in d)


@dataclass
class Req:
    prompt: str
    warm: str  # what the prefix cache holds before it (the system part, or an earlier prompt)
    answer: str | None
    docs: list[str] = field(default_factory=list)


def rag_requests(n: int, rng: random.Random, tok, chat: bool) -> list[Req]:
    out = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        must = doc_with(answer)
        picks = [must] + rng.sample([j for j in range(len(POOL)) if j != must], 4)
        rng.shuffle(picks)
        docs = [POOL[j] for j in picks]
        prompt, warm = rag_prompt(docs, question, tok, chat)
        out.append(Req(prompt, warm, answer, docs))
    return out


def rag_long_requests(n: int, rng: random.Random, tok, chat: bool) -> list[Req]:
    """The five whole documents (~280 tokens each, the length a retriever's chunks usually have) in
    random order, then one of the questions."""
    out = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        docs = rng.sample(DOCS, len(DOCS))
        prompt, warm = rag_prompt(docs, question, tok, chat)
        out.append(Req(prompt, warm, answer, docs))
    return out


def rag_prompt(docs: list[str], question: str, tok, chat: bool) -> tuple[str, str]:
    """(prompt, its system part) with plain documents: no markup, blank lines between them. In chat
    form through the model's template; as text, a completion prompt with no template at all (before the
    twenty-second session the text form wrote the template out by hand: the chat form's very strings)."""
    body = "\n\n".join(docs) + f"\n\nQuestion: {question}"
    if chat:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]
        return (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                tok.apply_chat_template(msgs[:1], tokenize=False))
    warm = f"{SYSTEM}\n\n"
    return warm + body + "\nAnswer:", warm


def sys_prompt(stamp: str, rng_seed: int = 7) -> str:
    rng = random.Random(rng_seed)  # the same policy text every time; only the stamp changes
    paras = "\n\n".join(paragraph(rng, 95) for _ in range(16))
    return f"<|im_start|>system\nCurrent time: {stamp}. You are the assistant of a tile shop.\n\n{paras}<|im_end|>\n"


def sys_requests(n: int, rng: random.Random) -> tuple[str, list[Req]]:
    def stamp() -> str:
        return f"2026-11-{rng.randrange(1, 29):02d} {rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"

    def user(q: str) -> str:
        return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"

    first = sys_prompt(stamp()) + user("Hello.")
    qs = ["Do you deliver large parcels?", "How do refunds work?", "When are gift cards confirmed?",
          "Can I rent tools?", "Who approves trade discounts?", "Do you pack sample tiles?"]
    out = []
    for i in range(n):
        system = sys_prompt(stamp())
        out.append(Req(system + user(qs[i % len(qs)]), first, None, [system]))  # "docs": the system prompt
    return first, out


def edit_requests(n: int, rng: random.Random, tok) -> tuple[list[str], list[Req]]:
    """Multi-turn chats (3 user turns, 2 answers) whose first user message is edited (the name in
    it changes): (the originals, the edited requests, each warmed by its original)."""
    names = ["Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana"]
    originals, out = [], []
    for _ in range(n):
        turns = [paragraph(rng, 60), paragraph(rng, 90), paragraph(rng, 60), paragraph(rng, 90)]
        a, b = rng.sample(names, 2)

        def chat(name: str, turns: list[str] = turns) -> str:
            msgs = [{"role": "system", "content": "You are the assistant of a tile shop."},
                    {"role": "user", "content": f"Hello, my name is {name}. {turns[0]}"},
                    {"role": "assistant", "content": turns[1]}, {"role": "user", "content": turns[2]},
                    {"role": "assistant", "content": turns[3]},
                    {"role": "user", "content": "Which of this applies to my order?"}]
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        originals.append(chat(a))
        out.append(Req(chat(b), chat(a), None, [turns[1], turns[2], turns[3]]))
    return originals, out
