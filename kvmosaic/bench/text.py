"""Deterministic English-like text, written by the project itself (no downloaded data).

Every function takes a :class:`random.Random`, so a seed fixes every prompt of a workload.
"""

from __future__ import annotations

import random

SUBJECTS = ["the warehouse", "our support team", "the showroom", "each courier", "the billing office",
            "every customer", "the night shift", "a new account", "the returns desk", "the catalogue",
            "the tile cutter", "each invoice", "the loyalty scheme", "the web shop", "a bulk order"]
VERBS = ["checks", "records", "ships", "refunds", "confirms", "replaces", "schedules", "reviews",
         "prices", "packs", "delivers", "tracks", "approves", "labels", "archives"]
OBJECTS = ["damaged boxes", "sample tiles", "grout orders", "delivery slots", "large parcels",
           "kitchen panels", "custom mosaics", "trade discounts", "spare adhesive", "gift cards",
           "floor tiles", "wall tiles", "tool rentals", "paint samples", "glass splashbacks"]
WHENS = ["within two working days", "before noon", "on the first Monday of the month",
         "after a photo is sent", "once payment clears", "every Friday", "at no extra cost",
         "only on request", "for thirty days", "within one hour", "during the winter sale",
         "when stock allows"]
TOPICS = ["delivery", "returns", "pricing", "stock", "installation", "warranty", "payments", "samples",
          "opening hours", "trade accounts", "cleaning", "colours"]
NAMES = ["Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kemal", "Lina"]


def sentence(rng: random.Random) -> str:
    return (f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(WHENS)}.")


def paragraph(rng: random.Random, num_words: int) -> str:
    """Sentences until about ``num_words`` words."""
    out: list[str] = []
    words = 0
    while words < num_words:
        s = sentence(rng)
        out.append(s)
        words += len(s.split())
    return " ".join(out)


def system_prompt(rng: random.Random, num_words: int) -> str:
    company = f"{rng.choice(NAMES)}'s {rng.choice(['Tiles', 'Mosaics', 'Ceramics', 'Stoneworks'])}"
    return (f"You are the assistant of {company}. Answer in one or two short sentences. "
            f"Policies you know by heart: {paragraph(rng, num_words)}")


def question(rng: random.Random) -> str:
    return (f"{rng.choice(NAMES)} asks about {rng.choice(TOPICS)}: does {rng.choice(SUBJECTS)} "
            f"handle {rng.choice(OBJECTS)} {rng.choice(WHENS)}?")


def document(rng: random.Random, index: int, num_words: int) -> str:
    return f"Document {index} ({rng.choice(TOPICS)}): {paragraph(rng, num_words)}"


def qa_example(rng: random.Random) -> str:
    obj, when = rng.choice(OBJECTS), rng.choice(WHENS)
    return (f"Q: When does {rng.choice(SUBJECTS)} handle {obj}?\n"
            f"A: It {rng.choice(VERBS)} {obj} {when}.")
