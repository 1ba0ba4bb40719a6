"""The kinship task (CLUTRR-like, depth k = 2..10): a chain of family links, then "How is pk related to p0?".

A chain of k people p0..pk with one sentence "p(i+1) is the R of p(i)." per link, R among father/mother,
son/daughter, brother/sister and (with `compound=True`) grandfather/grandmother, grandson/granddaughter,
uncle/aunt, nephew/niece; then "Question: How is pk related to p0? Answer:" -> " great-aunt". Relations
are blood relations in a family of full siblings where differently named people are different people
(as in CLUTRR), tracked as a generational offset (u, v): from p0 go up u generations to the nearest
common ancestors, then down v. Links whose composition would still be ambiguous (the mother of one's son
may be one's wife; the brother of one's aunt may be one's father; the son of one's grandfather may be
one's father; the grandson of one's father may be one's son), and parent links that would name an
already named person again (the father of one's brother, once one's father is named) are never drawn,
so every story has one reading. Chains stay inside the named set: u <= max_up, v <= max_down, no cousins
(u >= 2 and v >= 2). Answers: parent, grand- and great-...-grandparent, child, grand-/great-grandchild,
sibling, uncle/aunt with great- prefixes, nephew/niece with great- prefixes; the gender is that of the
last link. The final offset is drawn uniformly from those reachable in exactly k links, so answers are
spread, not dominated by "brother". `steps` is the relation of p1..pk to p0 after each link (len k).
Sentences are shuffled unless `shuffle=False`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..config import check_bool, check_int
from .examples import MAX_TRIES, REASONING, Example, invented_names

KINSHIP_MIN_DEPTH = 2
KINSHIP_MAX_DEPTH = 10

# primitive moves: P = a parent of, C = a child of, S = a sibling of
_KIN_RELATIONS = {  # relation word -> (moves, gender)
    "father": ("P", "m"), "mother": ("P", "f"),
    "son": ("C", "m"), "daughter": ("C", "f"),
    "brother": ("S", "m"), "sister": ("S", "f"),
    "grandfather": ("PP", "m"), "grandmother": ("PP", "f"),
    "grandson": ("CC", "m"), "granddaughter": ("CC", "f"),
    "uncle": ("PS", "m"), "aunt": ("PS", "f"),
    "nephew": ("SC", "m"), "niece": ("SC", "f"),
}
_KIN_WORD = {v: k for k, v in _KIN_RELATIONS.items()}
_BASIC_MOVES = ("P", "C", "S")
_COMPOUND_MOVES = ("PP", "CC", "PS", "SC")

Offset = tuple[int, int]  # (u, v): up u generations from p0 to the common ancestors, then down v


def _kin_move(state: Offset, moves: str, max_up: int, max_down: int) -> Offset | None:
    """Return the offset after `moves`, or None where the result would be ambiguous or out of range."""
    u, v = state
    for i, m in enumerate(moves):
        named = i == len(moves) - 1  # only the person a link names is known to differ from p0
        if m == "P":
            if v == 0:
                u += 1  # a parent of an ancestor (or of p0) is an ancestor
            elif v == 1 and u >= 1:
                v = 0  # a parent of a sibling / aunt is the common ancestor (full siblings)
            else:
                return None  # parent of a child / nephew: may be an in-law or p0
        elif m == "C":
            if v >= 1 or u == 0 or (u == 1 and named):
                v += 1  # a named child of p0's parent is a sibling, not p0
            else:
                return None  # child of a grandparent: may be p0's parent or an aunt
        else:
            if v == 0:
                u, v = u + 1, 1
            elif v >= 2 or u == 0 or (u == 1 and named):
                pass  # sibling of a descendant / nephew, or a named sibling of a sibling: same place
            else:
                return None  # sibling of an aunt: may be p0's parent
        if u > max_up or v > max_down or (u >= 2 and v >= 2):
            return None
    return u, v


def _kin_word(u: int, v: int, gender: str) -> str:
    """Return the English word for offset (u, v) and gender "m" / "f"."""
    i = 0 if gender == "m" else 1
    if v == 0:
        return ("father", "mother")[i] if u == 1 else "great-" * (u - 2) + ("grandfather", "grandmother")[i]
    if u == 0:
        return ("son", "daughter")[i] if v == 1 else "great-" * (v - 2) + ("grandson", "granddaughter")[i]
    if u == 1 and v == 1:
        return ("brother", "sister")[i]
    if v == 1:
        return "great-" * (u - 2) + ("uncle", "aunt")[i]
    if u == 1:
        return "great-" * (v - 2) + ("nephew", "niece")[i]
    raise ValueError(f"offset (u={u}, v={v}) is outside the named relations (no cousins)")


class _Family:
    """A family tree grown lazily: a witness that a story's named people can all be different people."""

    def __init__(self) -> None:
        self.gender = ["m"]  # person 0 is p0; its gender never matters for the links drawn
        self.parents: dict[int, tuple[int, int]] = {}  # person -> (father, mother)
        self.couple: dict[int, tuple[int, int]] = {}  # person -> (husband, wife): their children's parents

    def _new(self, gender: str) -> int:
        """Return a new person of `gender`."""
        self.gender.append(gender)
        return len(self.gender) - 1

    def parent(self, x: int, gender: str) -> int:
        """Return a parent of x with `gender` (the couple is created on first use)."""
        if x not in self.parents:
            pair = (self._new("m"), self._new("f"))
            self.parents[x] = self.couple[pair[0]] = self.couple[pair[1]] = pair
        return self.parents[x][0 if gender == "m" else 1]

    def child(self, x: int, gender: str) -> int:
        """Return a new child of x with `gender` (x's spouse is created on first use)."""
        if x not in self.couple:
            spouse = self._new("f" if self.gender[x] == "m" else "m")
            pair = (x, spouse) if self.gender[x] == "m" else (spouse, x)
            self.couple[x] = self.couple[spouse] = pair
        c = self._new(gender)
        self.parents[c] = self.couple[x]
        return c

    def sibling(self, x: int, gender: str) -> int:
        """Return a new full sibling of x with `gender`."""
        self.parent(x, "m")
        c = self._new(gender)
        self.parents[c] = self.parents[x]
        return c

    def apply(self, x: int, moves: str, gender: str, middle: str) -> int:
        """Return the person reached from x by `moves`; the last has `gender`, any in between `middle`."""
        for i, m in enumerate(moves):
            g = gender if i == len(moves) - 1 else middle
            x = self.parent(x, g) if m == "P" else self.child(x, g) if m == "C" else self.sibling(x, g)
        return x


def _kinship_one(rng: random.Random, depth: int, max_up: int, max_down: int, compound: bool,
                 shuffle: bool) -> Example:
    """Return one kinship example of `depth` links drawn from rng."""
    moves = _BASIC_MOVES + (_COMPOUND_MOVES if compound else ())

    def step(s: Offset, m: str) -> Offset | None:
        """Return the offset after moves m within this task's bounds (None where refused)."""
        return _kin_move(s, m, max_up, max_down)

    can = _paths_to_a_target(rng, depth, moves, step, max_up, max_down)
    for _ in range(MAX_TRIES):
        walk = _walk(rng, depth, moves, step, can)
        if walk is not None:
            break
    else:  # pragma: no cover - a fresh walk almost always succeeds
        raise RuntimeError(f"could not draw a kinship chain of depth {depth} in {MAX_TRIES} tries")
    links, steps = walk
    names = invented_names(rng, depth + 1)
    sentences = [f"{names[i + 1]} is the {link} of {names[i]}." for i, link in enumerate(links)]
    if shuffle:
        rng.shuffle(sentences)
    prompt = " ".join(sentences) + f" Question: How is {names[-1]} related to {names[0]}? Answer:"
    return Example(prompt, " " + steps[-1], depth, "kinship", REASONING, tuple(steps))


def _paths_to_a_target(rng: random.Random, depth: int, moves: tuple[str, ...],
                       step: Callable[[Offset, str], Offset | None], max_up: int, max_down: int) -> list[set[Offset]]:
    """Return can[m]: the offsets from which a drawn target is reachable in exactly m links (can[0] = {target}).

    The target is drawn uniformly from the offsets reachable from p0 in exactly `depth` links.
    """
    reach = {(0, 0)}
    for _ in range(depth):
        reach = {t for s in reach for m in moves if (t := step(s, m)) is not None}
    target = rng.choice(sorted(reach))
    states = [(u, v) for u in range(max_up + 1) for v in range(max_down + 1) if not (u >= 2 and v >= 2)]
    can = [{target}]
    for _ in range(depth - 1):
        can.append({s for s in states if any(step(s, m) in can[-1] for m in moves)})
    return can


def _walk(rng: random.Random, depth: int, moves: tuple[str, ...], step: Callable[[Offset, str], Offset | None],
          can: list[set[Offset]]) -> tuple[list[str], list[str]] | None:
    """Return (link words, relation to p0 after each link) of one walk to the target; None if it got stuck.

    A parent link that lands on someone already named (the father of one's brother is one's own, already
    named father) is refused, so named people stay distinct.
    """
    family, chain, state, links, steps = _Family(), [0], (0, 0), [], []
    for i in range(depth):
        options = [(m, g) for m in moves if step(state, m) in can[depth - 1 - i] for g in "mf"]
        rng.shuffle(options)
        for m, g in options:
            middles = ["m", "f"] if len(m) > 1 else ["m"]
            rng.shuffle(middles)
            person = next((p for mid in middles if (p := family.apply(chain[-1], m, g, mid)) not in chain),
                          None)
            if person is not None:
                break
        else:
            return None
        state = step(state, m)
        chain.append(person)
        links.append(_KIN_WORD[(m, g)])
        steps.append(_kin_word(*state, g))
    return links, steps


def kinship_task(rng: random.Random, n: int, depth: int, seed: int, *, max_up: int, max_down: int,
                 compound: bool, shuffle: bool) -> list[Example]:
    """Return n kinship examples of `depth` links drawn from rng (make_task's builder; seed is unused here)."""
    max_up, max_down = check_int("max_up", max_up, 1, 12), check_int("max_down", max_down, 1, 12)
    compound, shuffle = check_bool("compound", compound), check_bool("shuffle", shuffle)
    return [_kinship_one(rng, depth, max_up, max_down, compound, shuffle) for _ in range(n)]
