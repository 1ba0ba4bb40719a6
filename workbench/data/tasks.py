"""Depth-controlled synthetic tasks: seeded generators, plain-text rendering and exact scoring.

`make_task(name, n, depth, seed)` returns `n` `Example`s. Each example is a `prompt` the model reads and
a short `answer` it must produce (always beginning with a space), a `depth` (the difficulty axis), the
`task` name, its `group` ("reasoning" or "knowledge") and, where meaningful, `steps`: the intermediate
answer after every reasoning step, for per-loop supervision. All randomness comes from one
`random.Random(f"{task}/{depth}/{seed}")` per call: the same arguments give the same examples on
every run and machine, different seeds give different ones, and the first m of n examples equal
`make_task(..., n=m)`.

Tasks
-----
deduction (ProofWriter-like, depth 0..8). Invented entities ("Bix", "Dumo"), adjectives as attributes,
    facts "Bix is red." and single-premise rules, either generic ("If something is red then it is
    kind.") or about one entity ("If Bix is kind then Bix is big."), shuffled, then
    "Question: Is Bix big? Answer:" -> " true" / " false" under the closed-world assumption (false =
    not derivable). Rules only lead from earlier to later attributes of a per-example random order, so
    every theory is acyclic. Depth is exact and checked by the generator's own forward chaining:
    - true: the forward-chaining round in which the queried fact first appears (0 = stated fact), i.e.
      the minimal number of rule applications that derive it;
    - false: the refutation depth, the length of the longest chain of rules that concludes the queried
      fact (every such chain bottoms out in a fact that is neither stated nor derivable); 0 = no rule
      concludes it. False queries are near misses: the chain's first attribute is stated for another
      entity, so the queried attribute is derivable for someone, just not for the queried entity.
    Half the answers are true (`p_true`); distractor facts and rules are added and any theory whose
    depth comes out different is redrawn. `steps` of a true example are the derived facts along one
    shortest proof ("Bix is kind", ..., "Bix is big"); a false example has none.
kinship (CLUTRR-like, depth k = 2..10). A chain of k people p0..pk with one sentence
    "p(i+1) is the R of p(i)." per link, R among father/mother, son/daughter, brother/sister and (with
    `compound=True`) grandfather/grandmother, grandson/granddaughter, uncle/aunt, nephew/niece; then
    "Question: How is pk related to p0? Answer:" -> " great-aunt". Relations are blood relations in a
    family of full siblings where differently named people are different people (as in CLUTRR), tracked
    as a generational offset (u, v): from p0 go up u generations to the nearest common ancestors, then
    down v. Links whose composition would still be ambiguous (the mother of one's son may be one's
    wife; the brother of one's aunt may be one's father; the son of one's grandfather may be one's
    father; the grandson of one's father may be one's son), and parent links that would name an
    already named person again (the father of one's brother, once one's father is named) are never
    drawn, so every story has one reading. Chains stay inside the named set:
    u <= max_up, v <= max_down, no cousins (u >= 2 and v >= 2). Answers: parent, grand- and
    great-...-grandparent, child, grand-/great-grandchild, sibling, uncle/aunt with great- prefixes,
    nephew/niece with great- prefixes; the gender is that of the last link. The final offset is drawn
    uniformly from those reachable in exactly k links, so answers are spread, not dominated by
    "brother". `steps` is the relation of p1..pk to p0 after each link (len k). Sentences are shuffled
    unless `shuffle=False`.
iterated (depth d >= 0, no upper bound). A start state and a rule applied d times, e.g.
    "x=4; f(x)=x+3 mod 10; f^5(x)=" -> " 9". Rules: "add" (x+c mod m), "affine" (a*x+b mod m with a
    coprime to m, a != 1), "rotate" (a string of distinct letters rotated left by r) and "permute"
    ("f(s)=s[2]s[0]s[4]s[1]s[3]": the letters re-ordered by a fixed non-identity permutation); one is
    drawn per example unless `rule=` fixes it. `steps` holds the state after every application
    (len d); the answer is the final state (the start when d = 0).
recall (knowledge, depth 0 only). Invented countries, each with a capital, language, currency and
    longest river; `recall_facts(n_entities, seed)` is the training text ("The capital of Zorbia is
    Plim.", one sentence per fact) and the task queries it ("The capital of Zorbia is" -> " Plim"),
    drawn from the first `n_entities` (default 100) countries of the same seed. The world is generated
    entity by entity, so `recall_facts(m, seed)` is a prefix of `recall_facts(n, seed)` for m < n and
    queries are answerable from any `recall_facts(N, seed)` with N >= n_entities.

Options (`task_options(name)` lists them with defaults): deduction n_entities=3, distractor_facts=3,
distractor_rules=3, p_true=0.5, p_generic=0.5 (share of rules about "something"); kinship max_up=4,
max_down=4, compound=True, shuffle=True; iterated rule=None, modulus=10, length=5; recall
n_entities=100. `depth_range(name)` gives each task's depths.

Steps are bare strings (no leading space); for kinship and iterated `answer == " " + steps[-1]` when
there are steps. `score` compares after stripping surrounding whitespace only. `mix_texts` inserts task
texts among corpus chunks at seeded random positions, cycling through the examples if it needs more
than are given. Bad arguments raise ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import check_bool, check_float, check_int, fail

REASONING = "reasoning"
KNOWLEDGE = "knowledge"

DEDUCTION_MAX_DEPTH = 8
KINSHIP_MIN_DEPTH = 2
KINSHIP_MAX_DEPTH = 10
ITERATED_RULES = ("add", "affine", "rotate", "permute")

# adjectives that read as "Is Bix big?"; a theory uses depth + 1 + _EXTRA_ATTRIBUTES of them
ATTRIBUTES = ("red", "blue", "green", "white", "big", "small", "round", "cold", "rough", "smooth",
              "kind", "nice", "quiet", "young", "furry", "smart", "shy", "tall", "soft", "fast",
              "calm", "bright", "loud", "heavy")
_EXTRA_ATTRIBUTES = 4
_MAX_TRIES = 10_000

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


# ----------------------------------------------------------------------------- invented names

def _word(rng: random.Random) -> str:
    syllables = rng.choice((1, 2))
    w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
    if syllables == 1 or rng.random() < 0.5:
        w += rng.choice(_FINALS)
    return w


def _names(rng: random.Random, k: int, taken: set[str] | None = None) -> list[str]:
    """Return k distinct capitalised invented names not in `taken` (which is updated)."""
    seen = taken if taken is not None else set()
    out = []
    while len(out) < k:
        w = _word(rng).capitalize()
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


# ----------------------------------------------------------------------------- deduction

Atom = tuple[str, str]  # (entity, attribute)
Rule = tuple[str | None, str, str]  # (entity or None for "something", premise, conclusion)


def _forward_chain(facts: Sequence[Atom], rules: Sequence[Rule]) -> dict[Atom, int]:
    """Return every derivable atom with the round in which forward chaining first derives it."""
    depth = {f: 0 for f in facts}
    frontier = set(facts)
    r = 0
    while frontier:
        r += 1
        new = set()
        for ent, prem, concl in rules:
            for e, a in frontier:
                if a == prem and (ent is None or ent == e) and (e, concl) not in depth:
                    new.add((e, concl))
        for atom in new:
            depth[atom] = r
        frontier = new
    return depth


def _refutation_depth(atom: Atom, rules: Sequence[Rule], memo: dict[Atom, int] | None = None) -> int:
    """Return the length of the longest rule chain concluding `atom` (rules must be acyclic)."""
    memo = {} if memo is None else memo
    if atom not in memo:
        e, a = atom
        memo[atom] = max((1 + _refutation_depth((e, prem), rules, memo)
                          for ent, prem, concl in rules if concl == a and (ent is None or ent == e)),
                         default=0)
    return memo[atom]


def _rule_text(rule: Rule) -> str:
    ent, prem, concl = rule
    if ent is None:
        return f"If something is {prem} then it is {concl}."
    return f"If {ent} is {prem} then {ent} is {concl}."


def _deduction_one(rng: random.Random, depth: int, n_entities: int, distractor_facts: int,
                   distractor_rules: int, p_true: float, p_generic: float) -> Example:
    label = rng.random() < p_true
    for _ in range(_MAX_TRIES):
        ents = _names(rng, n_entities)
        e = ents[0]
        attrs = rng.sample(ATTRIBUTES, min(len(ATTRIBUTES), depth + 1 + _EXTRA_ATTRIBUTES))
        chain = [attrs[i] for i in sorted(rng.sample(range(len(attrs)), depth + 1))]
        rules: list[Rule] = [(None if rng.random() < p_generic else e, a, b)
                             for a, b in zip(chain, chain[1:])]
        facts: list[Atom] = []
        if label:
            facts.append((e, chain[0]))
        elif n_entities > 1:
            facts.append((rng.choice(ents[1:]), chain[0]))  # near miss: someone else starts the chain
        for _ in range(distractor_facts):
            facts.append((rng.choice(ents), rng.choice(attrs)))
        for _ in range(distractor_rules):
            i, j = sorted(rng.sample(range(len(attrs)), 2))  # earlier -> later keeps the theory acyclic
            rules.append((None if rng.random() < p_generic else rng.choice(ents), attrs[i], attrs[j]))
        facts, rules = list(dict.fromkeys(facts)), list(dict.fromkeys(rules))
        query = (e, chain[-1])
        derived = _forward_chain(facts, rules)
        if label:
            ok = derived.get(query) == depth
        else:
            ok = query not in derived and _refutation_depth(query, rules) == depth
        if ok:
            break
    else:  # pragma: no cover - acceptance is frequent; this guards against an infinite loop
        raise RuntimeError(f"could not draw a deduction theory of depth {depth} in {_MAX_TRIES} tries")
    sentences = [f"{x} is {a}." for x, a in facts] + [_rule_text(r) for r in rules]
    rng.shuffle(sentences)
    prompt = " ".join(sentences) + f" Question: Is {e} {chain[-1]}? Answer:"
    steps = tuple(f"{e} is {a}" for a in chain[1:]) if label else ()
    return Example(prompt, " true" if label else " false", depth, "deduction", REASONING, steps)


def _deduction(rng: random.Random, n: int, depth: int, seed: int, *, n_entities: int,
               distractor_facts: int, distractor_rules: int, p_true: float,
               p_generic: float) -> list[Example]:
    n_entities = check_int("n_entities", n_entities, 1, 20)
    distractor_facts = check_int("distractor_facts", distractor_facts, 0, 50)
    distractor_rules = check_int("distractor_rules", distractor_rules, 0, 50)
    p_true, p_generic = check_float("p_true", p_true, 0, 1), check_float("p_generic", p_generic, 0, 1)
    return [_deduction_one(rng, depth, n_entities, distractor_facts, distractor_rules, p_true, p_generic)
            for _ in range(n)]


# ----------------------------------------------------------------------------- kinship

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
        self.gender.append(gender)
        return len(self.gender) - 1

    def parent(self, x: int, gender: str) -> int:
        if x not in self.parents:
            pair = (self._new("m"), self._new("f"))
            self.parents[x] = self.couple[pair[0]] = self.couple[pair[1]] = pair
        return self.parents[x][0 if gender == "m" else 1]

    def child(self, x: int, gender: str) -> int:
        if x not in self.couple:
            spouse = self._new("f" if self.gender[x] == "m" else "m")
            pair = (x, spouse) if self.gender[x] == "m" else (spouse, x)
            self.couple[x] = self.couple[spouse] = pair
        c = self._new(gender)
        self.parents[c] = self.couple[x]
        return c

    def sibling(self, x: int, gender: str) -> int:
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
    moves = _BASIC_MOVES + (_COMPOUND_MOVES if compound else ())

    def step(s: Offset, m: str) -> Offset | None:
        return _kin_move(s, m, max_up, max_down)

    reach = {(0, 0)}
    for _ in range(depth):
        reach = {t for s in reach for m in moves if (t := step(s, m)) is not None}
    target = rng.choice(sorted(reach))
    states = [(u, v) for u in range(max_up + 1) for v in range(max_down + 1) if not (u >= 2 and v >= 2)]
    can = [{target}]  # can[m]: offsets from which the target is reachable in exactly m links
    for _ in range(depth - 1):
        can.append({s for s in states if any(step(s, m) in can[-1] for m in moves)})
    for _ in range(_MAX_TRIES):
        # walk towards the target; a parent link that lands on someone already named (the father of
        # one's brother is one's own, already named father) is refused, so named people stay distinct
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
                break
            state = step(state, m)
            chain.append(person)
            links.append(_KIN_WORD[(m, g)])
            steps.append(_kin_word(*state, g))
        if len(links) == depth:
            break
    else:  # pragma: no cover - a fresh walk almost always succeeds
        raise RuntimeError(f"could not draw a kinship chain of depth {depth} in {_MAX_TRIES} tries")
    names = _names(rng, depth + 1)
    sentences = [f"{names[i + 1]} is the {link} of {names[i]}." for i, link in enumerate(links)]
    if shuffle:
        rng.shuffle(sentences)
    prompt = " ".join(sentences) + f" Question: How is {names[-1]} related to {names[0]}? Answer:"
    return Example(prompt, " " + steps[-1], depth, "kinship", REASONING, tuple(steps))


def _kinship(rng: random.Random, n: int, depth: int, seed: int, *, max_up: int, max_down: int,
             compound: bool, shuffle: bool) -> list[Example]:
    max_up, max_down = check_int("max_up", max_up, 1, 12), check_int("max_down", max_down, 1, 12)
    compound, shuffle = check_bool("compound", compound), check_bool("shuffle", shuffle)
    return [_kinship_one(rng, depth, max_up, max_down, compound, shuffle) for _ in range(n)]


# ----------------------------------------------------------------------------- iterated

def _iterated_one(rng: random.Random, depth: int, rule: str | None, modulus: int, length: int) -> Example:
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


def _iterated(rng: random.Random, n: int, depth: int, seed: int, *, rule: str | None, modulus: int,
              length: int) -> list[Example]:
    if rule is not None and rule not in ITERATED_RULES:
        fail("rule", rule, f"must be None (one drawn per example) or one of {', '.join(ITERATED_RULES)}")
    modulus = check_int("modulus", modulus, 3, 10**6)
    length = check_int("length", length, 2, 26)
    return [_iterated_one(rng, depth, rule, modulus, length) for _ in range(n)]


# ----------------------------------------------------------------------------- recall

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
            country = _word(rng).capitalize() + rng.choice(("ia", "land", "stan", "ora"))
            if country not in taken:
                taken.add(country)
                break
        values = []
        for _, style in _RECALL_RELATIONS:
            w = _word(rng)
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


def _recall(rng: random.Random, n: int, depth: int, seed: int, *, n_entities: int) -> list[Example]:
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


# ----------------------------------------------------------------------------- the public face

@dataclass(frozen=True)
class _Task:
    build: Callable[..., list[Example]]
    group: str
    depths: tuple[int, int | None]
    defaults: dict[str, Any]


_TASKS: dict[str, _Task] = {
    "deduction": _Task(_deduction, REASONING, (0, DEDUCTION_MAX_DEPTH),
                       {"n_entities": 3, "distractor_facts": 3, "distractor_rules": 3, "p_true": 0.5,
                        "p_generic": 0.5}),
    "kinship": _Task(_kinship, REASONING, (KINSHIP_MIN_DEPTH, KINSHIP_MAX_DEPTH),
                     {"max_up": 4, "max_down": 4, "compound": True, "shuffle": True}),
    "iterated": _Task(_iterated, REASONING, (0, None), {"rule": None, "modulus": 10, "length": 5}),
    "recall": _Task(_recall, KNOWLEDGE, (0, 0), {"n_entities": 100}),
}
TASKS = tuple(_TASKS)


def _task(name: Any) -> _Task:
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
    """Return the majority-class chance of task `name` at `depth`: the share of n examples whose answer is the most
    common one (what the best constant answer scores; 0.5 for balanced true/false deduction)."""
    from collections import Counter

    examples = make_task(name, n, depth, seed, **options)
    if not examples:
        fail("n", n, "must be >= 1 to estimate a chance rate")
    return max(Counter(ex.answer for ex in examples).values()) / len(examples)


def score(example: Example, prediction: str) -> bool:
    """Return True when prediction equals the example's answer up to surrounding whitespace."""
    if not isinstance(prediction, str):
        fail("prediction", prediction, "must be a string")
    return prediction.strip() == example.answer.strip()


def _texts(examples: Sequence[Example | str]) -> list[str]:
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
# The retrofit experiment (workbench.experiments.retrofit) trains one iterated step per loop, compares
# against a scratchpad that writes the steps as tokens, and checks that the base model's facts survive.

SCRATCHPAD_STOP = "."  # a scratchpad ends with this character


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
