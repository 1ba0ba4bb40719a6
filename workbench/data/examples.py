"""What every synthetic task shares: the ``Example`` record, the two groups and invented names.

The task generators (``deduction``, ``kinship``, ``iterated``, ``knowledge``) build on this module;
``workbench.data.tasks`` is the public face that names, checks and mixes them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

REASONING = "reasoning"
KNOWLEDGE = "knowledge"

MAX_TRIES = 10_000  # redraws before a generator gives up; acceptance is frequent, this only bounds the loop

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_FINALS = "kmnrstx"


@dataclass(frozen=True)
class Example:
    """One task instance: the model reads `prompt` and must produce `answer` (which begins with a space)."""

    prompt: str
    answer: str
    depth: int
    task: str
    group: str
    steps: tuple[str, ...] = field(default=())

    @property
    def text(self) -> str:
        """Return prompt + answer, the string a training stream holds."""
        return self.prompt + self.answer


def invented_word(rng: random.Random) -> str:
    """Return a pronounceable lower-case invented word of one or two syllables."""
    syllables = rng.choice((1, 2))
    w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
    if syllables == 1 or rng.random() < 0.5:
        w += rng.choice(_FINALS)
    return w


def invented_names(rng: random.Random, k: int, taken: set[str] | None = None) -> list[str]:
    """Return k distinct capitalised invented names not in `taken` (which is updated)."""
    seen = taken if taken is not None else set()
    out = []
    while len(out) < k:
        w = invented_word(rng).capitalize()
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out
