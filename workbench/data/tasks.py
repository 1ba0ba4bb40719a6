"""Depth-controlled synthetic tasks: the registry, seeded generation, exact scoring and mixing into text.

`make_task(name, n, depth, seed)` returns `n` `Example`s. Each example is a `prompt` the model reads and
a short `answer` it must produce (always beginning with a space), a `depth` (the difficulty axis), the
`task` name, its `group` ("reasoning" or "knowledge") and, where meaningful, `steps`: the intermediate
answer after every reasoning step, for per-loop supervision. All randomness comes from one
`random.Random(f"{task}/{depth}/{seed}")` per call: the same arguments give the same examples on
every run and machine, different seeds give different ones, and the first m of n examples equal
`make_task(..., n=m)`.

Tasks, one module each (its docstring says exactly what it generates and how depth is defined):

- deduction (`workbench.data.deduction`, depth 0..8): ProofWriter-like facts and rules, "Is Bix big?"
  -> " true" / " false" under the closed-world assumption.
- kinship (`workbench.data.kinship`, depth 2..10): CLUTRR-like chains of family links, "How is pk
  related to p0?" -> " great-aunt".
- iterated (`workbench.data.iterated`, depth >= 0): a rule applied d times, "x=4; f(x)=x+3 mod 10;
  f^5(x)=" -> " 9".
- recall (`workbench.data.knowledge`, depth 0): facts about invented countries, trained from
  `recall_facts(n_entities, seed)`.

Options (`task_options(name)` lists them with defaults): deduction n_entities=3, distractor_facts=3,
distractor_rules=3, p_true=0.5, p_generic=0.5 (share of rules about "something"); kinship max_up=4,
max_down=4, compound=True, shuffle=True; iterated rule=None, modulus=10, length=5; recall
n_entities=100. `depth_range(name)` gives each task's depths.

Steps are bare strings (no leading space); for kinship and iterated `answer == " " + steps[-1]` when
there are steps. `score` compares after stripping surrounding whitespace only. `mix_texts` inserts task
texts among corpus chunks at seeded random positions, cycling through the examples if it needs more
than are given. Bad arguments raise ValueError naming the field, the value and what is allowed.

The retrofit experiment's task data (`iterated_examples`, `scratchpad_examples`, `parse_scratchpad`,
`KNOWLEDGE_FACTS`, `knowledge_battery`) is re-exported here too, so every task name imports from this module.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import check_float, check_int, fail
from .deduction import ATTRIBUTES, DEDUCTION_MAX_DEPTH, deduction_task
from .examples import KNOWLEDGE, REASONING, Example
from .iterated import ITERATED_RULES, SCRATCHPAD_STOP, iterated_task, parse_scratchpad, scratchpad_examples
from .kinship import KINSHIP_MAX_DEPTH, KINSHIP_MIN_DEPTH, kinship_task
from .knowledge import KNOWLEDGE_FACTS, knowledge_battery, recall_facts, recall_task

__all__ = ["REASONING", "KNOWLEDGE", "Example", "TASKS", "DEDUCTION_MAX_DEPTH", "KINSHIP_MIN_DEPTH",
           "KINSHIP_MAX_DEPTH", "ITERATED_RULES", "ATTRIBUTES", "make_task", "depth_range", "task_options",
           "task_group", "chance_rate", "score", "render_stream", "mix_texts", "recall_facts", "SCRATCHPAD_STOP",
           "iterated_examples", "scratchpad_examples", "parse_scratchpad", "KNOWLEDGE_FACTS", "knowledge_battery"]


# ----------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class _Task:
    """A registry entry: the builder, the group, the (lowest, highest) depths and the option defaults."""

    build: Callable[..., list[Example]]
    group: str
    depths: tuple[int, int | None]
    defaults: dict[str, Any]


_TASKS: dict[str, _Task] = {
    "deduction": _Task(deduction_task, REASONING, (0, DEDUCTION_MAX_DEPTH),
                       {"n_entities": 3, "distractor_facts": 3, "distractor_rules": 3, "p_true": 0.5,
                        "p_generic": 0.5}),
    "kinship": _Task(kinship_task, REASONING, (KINSHIP_MIN_DEPTH, KINSHIP_MAX_DEPTH),
                     {"max_up": 4, "max_down": 4, "compound": True, "shuffle": True}),
    "iterated": _Task(iterated_task, REASONING, (0, None), {"rule": None, "modulus": 10, "length": 5}),
    "recall": _Task(recall_task, KNOWLEDGE, (0, 0), {"n_entities": 100}),
}
TASKS = tuple(_TASKS)


def _task(name: Any) -> _Task:
    """Return the registry entry of task `name` (ValueError naming the known tasks otherwise)."""
    if not isinstance(name, str) or name not in _TASKS:
        fail("name", name, f"must be one of {', '.join(TASKS)}")
    return _TASKS[name]


def depth_range(name: str) -> tuple[int, int | None]:
    """Return (lowest, highest) depth task `name` supports; highest is None when unbounded."""
    return _task(name).depths


def task_options(name: str) -> dict[str, Any]:
    """Return the options task `name` accepts, with their defaults."""
    return dict(_task(name).defaults)


def make_task(name: str, n: int, depth: int, seed: int = 0, **options: Any) -> list[Example]:
    """Return n seeded examples of task `name` at difficulty `depth` (see the module docstring)."""
    task = _task(name)
    n = check_int("n", n, 0)
    lo, hi = task.depths
    span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    depth = check_int("depth", depth, lo, hi, allowed=f"task {name!r} supports integer depths {span}")
    seed = check_int("seed", seed)
    for key in options:
        if key not in task.defaults:
            fail(key, options[key], f"is not an option of task {name!r}; options are "
                                    f"{', '.join(task.defaults) or 'none'}")
    rng = random.Random(f"{name}/{depth}/{seed}")
    return task.build(rng, n, depth, seed, **{**task.defaults, **options})


def task_group(name: str) -> str:
    """Return the group ("reasoning" or "knowledge") of task `name`."""
    return _task(name).group


def chance_rate(name: str, depth: int, n: int = 1000, seed: int = 0, **options: Any) -> float:
    """Return the majority-class chance of task `name` at `depth`: what the best constant answer scores.

    That is the share of n examples whose answer is the most common one (0.5 for balanced true/false deduction).
    """
    from collections import Counter

    examples = make_task(name, n, depth, seed, **options)
    if not examples:
        fail("n", n, "must be >= 1 to estimate a chance rate")
    return max(Counter(ex.answer for ex in examples).values()) / len(examples)


# ----------------------------------------------------------------------------- scoring and mixing

def score(example: Example, prediction: str) -> bool:
    """Return True when prediction equals the example's answer up to surrounding whitespace."""
    if not isinstance(prediction, str):
        fail("prediction", prediction, "must be a string")
    return prediction.strip() == example.answer.strip()


def _texts(examples: Sequence[Example | str]) -> list[str]:
    """Return the text of each item: an Example's prompt + answer, a str as it is."""
    out = []
    for ex in examples:
        if isinstance(ex, Example):
            out.append(ex.text)
        elif isinstance(ex, str):
            out.append(ex)
        else:
            fail("examples", ex, "items must be Example or str")
    return out


def render_stream(examples: Sequence[Example | str]) -> str:
    """Return the examples' texts joined by newlines, ready to mix into a training stream."""
    return "\n".join(_texts(examples))


def mix_texts(corpus_text_chunks: Sequence[str], examples: Sequence[Example | str], ratio: float,
              seed: int = 0) -> list[str]:
    """Return the corpus chunks (in order) with task texts inserted so they are about `ratio` of the items.

    Task texts keep their order and are cycled when more are needed than given; their positions are
    drawn by `random.Random(seed)`. With c chunks, round(ratio * c / (1 - ratio)) task texts are added.
    """
    ratio = check_float("ratio", ratio, 0, 1, hi_open=True, allowed="must be a number with 0 <= ratio < 1")
    seed = check_int("seed", seed)
    if isinstance(corpus_text_chunks, str) or not all(isinstance(c, str) for c in corpus_text_chunks):
        fail("corpus_text_chunks", corpus_text_chunks, "must be a list of strings")
    chunks = list(corpus_text_chunks)
    texts = _texts(examples)
    t = round(ratio * len(chunks) / (1.0 - ratio))
    if t and not texts:
        fail("examples", examples, "must be non-empty when ratio > 0")
    slots = set(random.Random(seed).sample(range(len(chunks) + t), t))
    out, ci, ti = [], 0, 0
    for i in range(len(chunks) + t):
        if i in slots:
            out.append(texts[ti % len(texts)])
            ti += 1
        else:
            out.append(chunks[ci])
            ci += 1
    return out


# ----------------------------------------------------------------------------- retrofit task data

def iterated_examples(n: int, depths: int | Sequence[int], seed: int = 0, rule: str = "add",
                      modulus: int = 10) -> list[Example]:
    """Return n iterated-task examples per depth (rule and modulus fixed), depths in the order given."""
    try:
        depths = list(depths)
    except TypeError:  # one depth
        depths = [depths]
    if not depths:
        fail("depths", depths, "must be a non-empty list of integers >= 1")
    out = []
    for d in depths:
        out += make_task("iterated", n, check_int("depth", d, 1), seed, rule=rule, modulus=modulus)
    return out
