"""The deduction task (ProofWriter-like, depth 0..8): facts and rules, then "Is Bix big?" -> true / false.

Invented entities ("Bix", "Dumo"), adjectives as attributes, facts "Bix is red." and single-premise
rules, either generic ("If something is red then it is kind.") or about one entity ("If Bix is kind
then Bix is big."), shuffled, then "Question: Is Bix big? Answer:" -> " true" / " false" under the
closed-world assumption (false = not derivable). Rules only lead from earlier to later attributes of a
per-example random order, so every theory is acyclic. Depth is exact and checked by the generator's own
forward chaining:

- true: the forward-chaining round in which the queried fact first appears (0 = stated fact), i.e. the
  minimal number of rule applications that derive it;
- false: the refutation depth, the length of the longest chain of rules that concludes the queried fact
  (every such chain bottoms out in a fact that is neither stated nor derivable); 0 = no rule concludes
  it. False queries are near misses: the chain's first attribute is stated for another entity, so the
  queried attribute is derivable for someone, just not for the queried entity.

Half the answers are true (`p_true`); distractor facts and rules are added and any theory whose depth
comes out different is redrawn. `steps` of a true example are the derived facts along one shortest
proof ("Bix is kind", ..., "Bix is big"); a false example has none.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..config import check_float, check_int
from .examples import MAX_TRIES, REASONING, Example, invented_names

DEDUCTION_MAX_DEPTH = 8

# adjectives that read as "Is Bix big?"; a theory uses depth + 1 + _EXTRA_ATTRIBUTES of them
ATTRIBUTES = ("red", "blue", "green", "white", "big", "small", "round", "cold", "rough", "smooth",
              "kind", "nice", "quiet", "young", "furry", "smart", "shy", "tall", "soft", "fast",
              "calm", "bright", "loud", "heavy")
_EXTRA_ATTRIBUTES = 4

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
    """Return the English sentence of a rule."""
    ent, prem, concl = rule
    if ent is None:
        return f"If something is {prem} then it is {concl}."
    return f"If {ent} is {prem} then {ent} is {concl}."


def _deduction_one(rng: random.Random, depth: int, n_entities: int, distractor_facts: int,
                   distractor_rules: int, p_true: float, p_generic: float) -> Example:
    """Return one deduction example of `depth`, redrawing theories until the depth comes out exact."""
    label = rng.random() < p_true
    for _ in range(MAX_TRIES):
        ents = invented_names(rng, n_entities)
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
        raise RuntimeError(f"could not draw a deduction theory of depth {depth} in {MAX_TRIES} tries")
    sentences = [f"{x} is {a}." for x, a in facts] + [_rule_text(r) for r in rules]
    rng.shuffle(sentences)
    prompt = " ".join(sentences) + f" Question: Is {e} {chain[-1]}? Answer:"
    steps = tuple(f"{e} is {a}" for a in chain[1:]) if label else ()
    return Example(prompt, " true" if label else " false", depth, "deduction", REASONING, steps)


def deduction_task(rng: random.Random, n: int, depth: int, seed: int, *, n_entities: int,
                   distractor_facts: int, distractor_rules: int, p_true: float,
                   p_generic: float) -> list[Example]:
    """Return n deduction examples of `depth` drawn from rng (make_task's builder; seed is unused here)."""
    n_entities = check_int("n_entities", n_entities, 1, 20)
    distractor_facts = check_int("distractor_facts", distractor_facts, 0, 50)
    distractor_rules = check_int("distractor_rules", distractor_rules, 0, 50)
    p_true, p_generic = check_float("p_true", p_true, 0, 1), check_float("p_generic", p_generic, 0, 1)
    return [_deduction_one(rng, depth, n_entities, distractor_facts, distractor_rules, p_true, p_generic)
            for _ in range(n)]
