"""Facts planted in real text, and the questions that ask for them later.

Retrieval (``vlm_kv.eval.retrieval``) plants one code per prompt and asks for it; gate training
(``vlm_kv.train.data``, ``--facts-share``) turns text samples into chats that hold several facts
of mixed kinds (codes, names, dates, lists) and ask for each one in a later turn, so that the
distillation loss covers answers the cache could only give if it kept the fact.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

COLORS = ("blue", "red", "green", "yellow", "silver", "black", "white", "purple", "orange", "golden")
OBJECTS = ("door", "box", "lamp", "gate", "chest", "window", "bottle", "clock", "cabinet", "bridge")
_FIRST = ("Alice", "Edmund", "Clara", "Victor", "Henry", "Justine", "Ernest", "Agatha", "Felix", "Safie")
_LAST = ("Morgan", "Whitfield", "Lacey", "Harrow", "Penrose", "Darby", "Quill", "Ashdown", "Fenwick", "Marlow")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_THINGS = ("a map", "a key", "a coin", "a feather", "a letter", "a compass", "a ring", "a candle", "a knife", "a bell")
FACT_KINDS = ("code", "name", "date", "list")
#: the assistant's reply that closes a document turn before the questions come
READ_REPLY = "I have read it."
READ_REQUEST = "Read the text above; I will ask about it."


@dataclass(frozen=True)
class Fact:
    """A sentence to plant, the question that asks for it and the answer (a short phrase)."""

    kind: str
    subject: str
    statement: str
    question: str
    answer: str


def draw_fact(rng: random.Random, kind: str) -> Fact:
    """One fact of ``kind`` about a random coloured object."""
    key = f"{rng.choice(COLORS)} {rng.choice(OBJECTS)}"
    if kind == "code":
        code = str(rng.randint(1000, 9999))
        return Fact(kind, key, f"The secret code of the {key} is {code}.", f"What is the secret code of the {key}?", code)
    if kind == "name":
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        return Fact(kind, key, f"The keeper of the {key} is named {name}.", f"Who is the keeper of the {key}?", name)
    if kind == "date":
        date = f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(1700, 1899)}"
        return Fact(kind, key, f"The {key} was made on {date}.", f"When was the {key} made?", date)
    if kind == "list":
        things = rng.sample(_THINGS, 3)
        held = f"{things[0]}, {things[1]} and {things[2]}"
        return Fact(kind, key, f"The {key} holds {held}.", f"What does the {key} hold?", held)
    raise ValueError(f"fact kind must be one of {FACT_KINDS}, got {kind!r}")


def insert_at_depth(doc: str, sentence: str, depth: float) -> str:
    """``sentence`` after the first sentence end at or after ``depth`` of ``doc`` (0 = start, 1 = end)."""
    pos = int(round(depth * len(doc)))
    if pos <= 0:
        return f"{sentence} {doc.lstrip()}"
    if pos >= len(doc):
        return f"{doc.rstrip()} {sentence}"
    m = re.compile(r"[.!?][\"')\]]?\s|\n").search(doc, pos, min(len(doc), pos + 400))
    if m is None:
        space = doc.find(" ", pos)
        cut = space if space != -1 else pos
    else:
        cut = m.end()
    head, tail = doc[:cut].rstrip(), doc[cut:].lstrip()
    return f"{head} {sentence} {tail}"


def facts_chat(doc: str, rng: random.Random, count: int, kinds: tuple[str, ...] = FACT_KINDS) -> list[dict]:
    """Chat messages: ``doc`` with ``count`` facts planted at random depths, an acknowledgement,
    then one question per fact in its own turn, each answered."""
    facts = []
    used: set[str] = set()
    while len(facts) < count:
        fact = draw_fact(rng, rng.choice(kinds))
        if fact.subject in used:  # one fact per object, or the question is ambiguous
            continue
        used.add(fact.subject)
        facts.append(fact)
    for fact in facts:
        doc = insert_at_depth(doc, fact.statement, rng.random())
    messages = [{"role": "user", "content": f"{doc}\n\n{READ_REQUEST}"}, {"role": "assistant", "content": READ_REPLY}]
    for fact in rng.sample(facts, len(facts)):  # asked in another order than planted
        messages += [{"role": "user", "content": fact.question}, {"role": "assistant", "content": fact.answer}]
    return messages
