"""The iterated task (depth d >= 0, no upper bound): a start state and a rule applied d times.

"x=4; f(x)=x+3 mod 10; f^5(x)=" -> " 9". Rules: "add" (x+c mod m), "affine" (a*x+b mod m with a coprime
to m, a != 1), "rotate" (a string of distinct letters rotated left by r) and "permute"
("f(s)=s[2]s[0]s[4]s[1]s[3]": the letters re-ordered by a fixed non-identity permutation); one is drawn
per example unless `rule=` fixes it. `steps` holds the state after every application (len d); the
answer is the final state (the start when d = 0).

The scratchpad helpers serve the retrofit experiment (`workbench.experiments.retrofit`), which trains
one iterated step per loop and compares against a scratchpad that writes the steps as tokens.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Sequence
from typing import Any

from ..config import check_int, fail
from .examples import REASONING, Example

ITERATED_RULES = ("add", "affine", "rotate", "permute")
SCRATCHPAD_STOP = "."  # a scratchpad ends with this character


def _iterated_one(rng: random.Random, depth: int, rule: str | None, modulus: int, length: int) -> Example:
    """Return one iterated example: a start state, a rule (drawn unless given) and its depth-fold result."""
    kind = rule if rule is not None else rng.choice(ITERATED_RULES)
    f: Callable[[Any], Any]
    if kind in ("add", "affine"):
        var, start = "x", rng.randrange(modulus)
        if kind == "add":
            c = rng.randrange(1, modulus)
            f, desc = (lambda x: (x + c) % modulus), f"x+{c} mod {modulus}"
        else:
            a = rng.choice([a for a in range(2, modulus) if math.gcd(a, modulus) == 1])
            b = rng.randrange(modulus)
            f, desc = (lambda x: (a * x + b) % modulus), f"{a}*x+{b} mod {modulus}"
    else:
        var, start = "s", "".join(rng.sample(string.ascii_lowercase, length))
        if kind == "rotate":
            r = rng.randrange(1, length)
            f, desc = (lambda s: s[r:] + s[:r]), f"rotate left by {r}"
        else:
            perm = list(range(length))
            while perm == sorted(perm):
                rng.shuffle(perm)
            f, desc = (lambda s: "".join(s[i] for i in perm)), "".join(f"s[{i}]" for i in perm)
    state, steps = start, []
    for _ in range(depth):
        state = f(state)
        steps.append(str(state))
    prompt = f"{var}={start}; f({var})={desc}; f^{depth}({var})="
    return Example(prompt, f" {state}", depth, "iterated", REASONING, tuple(steps))


def iterated_task(rng: random.Random, n: int, depth: int, seed: int, *, rule: str | None, modulus: int,
                  length: int) -> list[Example]:
    """Return n iterated examples of `depth` applications drawn from rng (make_task's builder; seed unused)."""
    if rule is not None and rule not in ITERATED_RULES:
        fail("rule", rule, f"must be None (one drawn per example) or one of {', '.join(ITERATED_RULES)}")
    modulus = check_int("modulus", modulus, 3, 10**6)
    length = check_int("length", length, 2, 26)
    return [_iterated_one(rng, depth, rule, modulus, length) for _ in range(n)]


def scratchpad_examples(examples: Sequence[Example]) -> list[Example]:
    """Return the examples with the answer replaced by the scratchpad ' s1 s2 ... sd.' (steps as tokens)."""
    out = []
    for ex in examples:
        if not ex.steps:
            fail("examples", ex.prompt, "need intermediate steps (Example.steps) to write a scratchpad")
        out.append(Example(ex.prompt, " " + " ".join(ex.steps) + SCRATCHPAD_STOP, ex.depth, ex.task, ex.group,
                           ex.steps))
    return out


def parse_scratchpad(text: str) -> str:
    """Return the final answer of a generated scratchpad: the last step before the stop character."""
    words = text.split(SCRATCHPAD_STOP, 1)[0].split()
    return " " + words[-1] if words else ""
