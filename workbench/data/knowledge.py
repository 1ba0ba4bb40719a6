"""Knowledge tasks: recall of an invented world (trainable from scratch) and a battery of real facts.

recall (depth 0 only). Invented countries, each with a capital, language, currency and longest river;
`recall_facts(n_entities, seed)` is the training text ("The capital of Zorbia is Plim.", one sentence
per fact) and the task queries it ("The capital of Zorbia is" -> " Plim"), drawn from the first
`n_entities` (default 100) countries of the same seed. The world is generated entity by entity, so
`recall_facts(m, seed)` is a prefix of `recall_facts(n, seed)` for m < n and queries are answerable from
any `recall_facts(N, seed)` with N >= n_entities.

The knowledge battery (`KNOWLEDGE_FACTS`, `knowledge_battery`) checks that a retrofitted pretrained model
(`workbench.experiments.retrofit`) keeps the base model's facts.
"""

from __future__ import annotations

import random

from ..config import check_int, fail
from .examples import KNOWLEDGE, Example, invented_word

_RECALL_RELATIONS = (  # (prompt template, value style)
    ("The capital of {} is", "name"),
    ("The language of {} is", "language"),
    ("The currency of {} is the", "lower"),
    ("The longest river of {} is the", "name"),
)


def _recall_world(n_entities: int, seed: int) -> list[tuple[str, list[str]]]:
    """Return [(country, [value per relation])] for the first n_entities countries of `seed`."""
    rng = random.Random(f"recall-world/{seed}")
    taken: set[str] = set()
    world = []
    for _ in range(n_entities):
        while True:
            country = invented_word(rng).capitalize() + rng.choice(("ia", "land", "stan", "ora"))
            if country not in taken:
                taken.add(country)
                break
        values = []
        for _, style in _RECALL_RELATIONS:
            w = invented_word(rng)
            values.append(w.capitalize() + rng.choice(("ish", "ese", "ic", "an")) if style == "language"
                          else w if style == "lower" else w.capitalize())
        world.append((country, values))
    return world


def recall_facts(n_entities: int, seed: int = 0) -> list[str]:
    """Return the training sentences stating every fact of the first n_entities countries of `seed`."""
    n_entities = check_int("n_entities", n_entities, 1)
    check_int("seed", seed)
    return [f"{tmpl.format(country)} {value}."
            for country, values in _recall_world(n_entities, seed)
            for (tmpl, _), value in zip(_RECALL_RELATIONS, values)]


def recall_task(rng: random.Random, n: int, depth: int, seed: int, *, n_entities: int) -> list[Example]:
    """Return n recall queries about the first n_entities countries of `seed`, in an order drawn from rng."""
    n_entities = check_int("n_entities", n_entities, 1)
    world = _recall_world(n_entities, seed)
    pairs = [(i, j) for i in range(n_entities) for j in range(len(_RECALL_RELATIONS))]
    out: list[Example] = []
    while len(out) < n:  # every fact once per pass, in a fresh order each pass
        rng.shuffle(pairs)
        for i, j in pairs[:n - len(out)]:
            country, values = world[i]
            out.append(Example(_RECALL_RELATIONS[j][0].format(country), " " + values[j], 0, "recall",
                               KNOWLEDGE))
    return out


# Short factual cloze prompts written for this project. Every answer is one token of the SmolLM2 tokenizer,
# and each fact was kept only if SmolLM2-135M-Instruct itself ranks the answer first (tests/test_retrofit.py
# checks both), so the battery measures how much of the base model's knowledge a retrofit keeps.
# Categories become the `task` of each Example.
KNOWLEDGE_FACTS: tuple[tuple[str, str, str], ...] = (
    ("capital", "The capital of France is", " Paris"),
    ("capital", "The capital of Germany is", " Berlin"),
    ("capital", "The capital of Italy is", " Rome"),
    ("capital", "The capital of Spain is", " Madrid"),
    ("capital", "The capital of Japan is", " Tokyo"),
    ("capital", "The capital of Russia is", " Moscow"),
    ("capital", "The capital of England is", " London"),
    ("capital", "The capital of China is", " Beijing"),
    ("capital", "The capital of Greece is", " Athens"),
    ("capital", "The capital of Canada is", " Ottawa"),
    ("capital", "The capital of Ireland is", " Dublin"),
    ("capital", "The capital of Portugal is", " Lisbon"),
    ("capital", "The capital of Austria is", " Vienna"),
    ("capital", "The capital of Norway is", " Oslo"),
    ("language", "In France, people speak", " French"),
    ("language", "In Spain, people speak", " Spanish"),
    ("language", "In Italy, people speak", " Italian"),
    ("language", "The official language of Germany is", " German"),
    ("language", "The official language of Russia is", " Russian"),
    ("language", "The official language of Mexico is", " Spanish"),
    ("science", "The largest planet in the solar system is", " Jupiter"),
    ("science", "The planet closest to the sun is", " Mercury"),
    ("science", "The chemical symbol for gold is", " Au"),
    ("science", "The chemical symbol for water is H", "2"),
    ("science", "The Earth moves around the", " Sun"),
    ("science", "The natural satellite of the Earth is the", " Moon"),
    ("science", "The force that pulls objects toward the Earth is", " gravity"),
    ("science", "Plants make their food by photosynthesis using energy from the", " sun"),
    ("opposite", "The opposite of hot is", " cold"),
    ("opposite", "The opposite of up is", " down"),
    ("opposite", "The opposite of big is", " small"),
    ("opposite", "The opposite of black is", " white"),
    ("opposite", "The opposite of yes is", " no"),
    ("opposite", "The opposite of night is", " day"),
    ("opposite", "The opposite of left is", " right"),
    ("opposite", "The opposite of fast is", " slow"),
    ("opposite", "The opposite of open is", " closed"),
    ("opposite", "The opposite of true is", " false"),
    ("people", "Romeo and Juliet was written by William", " Shakespeare"),
    ("people", "The theory of relativity was developed by Albert", " Einstein"),
    ("people", "The first president of the United States was George", " Washington"),
    ("people", "The Mona Lisa was painted by Leonardo da", " Vinci"),
    ("people", "The law of gravity was described by Isaac", " Newton"),
    ("everyday", "A baby cat is called a", " kitten"),
    ("everyday", "The largest animal on Earth is the blue", " whale"),
    ("everyday", "There are seven days in a", " week"),
    ("everyday", "One, two, three,", " four"),
)


def knowledge_battery(tokenizer=None) -> list[Example]:
    """Return the knowledge battery as Examples (task = category, group "knowledge", depth 0).

    With a tokenizer, every answer is checked to be exactly one token of it (ValueError naming those
    that are not).
    """
    examples = [Example(prompt, answer, 0, cat, KNOWLEDGE) for cat, prompt, answer in KNOWLEDGE_FACTS]
    if tokenizer is not None:
        bad = {ex.answer: tokenizer.encode(ex.answer) for ex in examples if len(tokenizer.encode(ex.answer)) != 1}
        if bad:
            fail("tokenizer", type(tokenizer).__name__, f"the battery needs one-token answers; these are not: {bad}")
    return examples
