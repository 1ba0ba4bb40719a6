"""Synthetic tasks: determinism, labels checked by independent solvers, scoring, mixing, bad input."""

import math
import re

import pytest

from workbench.data.tasks import (
    DEDUCTION_MAX_DEPTH, TASKS, Example, depth_range, make_task, mix_texts, recall_facts, render_stream,
    score,
)

DEPTH_OF = {"deduction": 3, "kinship": 4, "iterated": 5, "recall": 0}


# ----------------------------------------------------------------------------- shape and determinism

@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_examples_and_different_seed_different(name):
    a = make_task(name, 20, DEPTH_OF[name], seed=3)
    assert a == make_task(name, 20, DEPTH_OF[name], seed=3)
    assert a != make_task(name, 20, DEPTH_OF[name], seed=4)
    assert len({ex.text for ex in a}) > 1
    # the first m of n examples are the examples of n = m
    assert make_task(name, 7, DEPTH_OF[name], seed=3) == a[:7]


@pytest.mark.parametrize("name", TASKS)
def test_examples_are_well_formed(name):
    group = "knowledge" if name == "recall" else "reasoning"
    for ex in make_task(name, 30, DEPTH_OF[name], seed=1):
        assert isinstance(ex, Example)
        assert ex.task == name and ex.group == group and ex.depth == DEPTH_OF[name]
        assert ex.text == ex.prompt + ex.answer
        assert ex.answer.startswith(" ") and ex.answer.strip() and ex.answer == " " + ex.answer.strip()
        assert "\n" not in ex.text
        assert isinstance(ex.steps, tuple)


def test_recall_facts_are_deterministic_and_seeded():
    assert recall_facts(20, seed=5) == recall_facts(20, seed=5)
    assert recall_facts(20, seed=5) != recall_facts(20, seed=6)
    # generated entity by entity: a smaller world is a prefix of a larger one
    assert recall_facts(100, seed=5)[:40] == recall_facts(10, seed=5)


# ----------------------------------------------------------------------------- deduction

_QUESTION = re.compile(r"^(.*) Question: Is ([A-Z][a-z]+) ([a-z]+)\? Answer:$")
_FACT = re.compile(r"^([A-Z][a-z]+) is ([a-z]+)$")
_GENERIC = re.compile(r"^If something is ([a-z]+) then it is ([a-z]+)$")
_SPECIFIC = re.compile(r"^If ([A-Z][a-z]+) is ([a-z]+) then \1 is ([a-z]+)$")


def parse_theory(prompt):
    """Parse a rendered deduction prompt into facts, ground rules and the query (independent of the library)."""
    m = _QUESTION.match(prompt)
    assert m, prompt
    body, qent, qattr = m.groups()
    facts, generic, specific, entities = set(), [], [], {qent}
    for sentence in body.split("."):
        sentence = sentence.strip()
        if not sentence:
            continue
        if fm := _FACT.match(sentence):
            facts.add(fm.groups())
            entities.add(fm.group(1))
        elif gm := _GENERIC.match(sentence):
            generic.append(gm.groups())
        elif sm := _SPECIFIC.match(sentence):
            ent, prem, concl = sm.groups()
            specific.append(((ent, prem), (ent, concl)))
            entities.add(ent)
        else:
            raise AssertionError(f"unparsed sentence {sentence!r}")
    ground = specific + [((e, p), (e, c)) for e in sorted(entities) for p, c in generic]
    return facts, ground, (qent, qattr)


def saturate(facts, ground):
    """Brute-force forward chaining: every derivable atom -> the round it first appears in."""
    first = {f: 0 for f in facts}
    rnd = 0
    while True:
        rnd += 1
        known = set(first)
        new = {c for p, c in ground if p in known and c not in known}
        if not new:
            return first
        for c in new:
            first[c] = rnd


def longest_backward_chain(atom, ground):
    """Longest chain of ground rules ending in `atom`, by repeated relaxation (fails on a cycle)."""
    length = {}
    for _ in range(len(ground) + 2):
        changed = False
        for p, c in ground:
            cand = length.get(p, 0) + 1
            if cand > length.get(c, 0):
                length[c] = cand
                changed = True
        if not changed:
            return length.get(atom, 0)
    raise AssertionError("the rules contain a cycle")


@pytest.mark.parametrize("depth", range(DEDUCTION_MAX_DEPTH + 1))
def test_deduction_labels_and_depths_agree_with_brute_force_solver(depth):
    examples = make_task("deduction", 40, depth, seed=11)
    labels = set()
    for ex in examples:
        facts, ground, query = parse_theory(ex.prompt)
        first = saturate(facts, ground)
        truth = query in first
        assert ex.answer == (" true" if truth else " false"), ex.prompt
        if truth:
            assert first[query] == depth, ex.prompt  # minimal number of rule applications
            # steps: one shortest proof, one derived fact per round
            assert len(ex.steps) == depth
            for i, step in enumerate(ex.steps, start=1):
                ent, _, attr = step.partition(" is ")
                assert first[(ent, attr)] == i
            if depth:
                assert ex.steps[-1] == f"{query[0]} is {query[1]}"
        else:
            assert longest_backward_chain(query, ground) == depth, ex.prompt
            assert ex.steps == ()
        labels.add(truth)
    assert labels == {True, False}  # both answers occur at every depth


def test_deduction_depth_range_and_options():
    assert depth_range("deduction") == (0, DEDUCTION_MAX_DEPTH)
    assert {ex.answer for ex in make_task("deduction", 20, 2, p_true=1.0)} == {" true"}
    assert {ex.answer for ex in make_task("deduction", 20, 2, p_true=0.0)} == {" false"}
    plain = make_task("deduction", 10, 4, distractor_facts=0, distractor_rules=0, p_generic=0.0)
    for ex in plain:
        facts, ground, _ = parse_theory(ex.prompt)
        assert len(ground) == 4 and len(facts) == 1  # just the chain and its start (or near miss)


# ----------------------------------------------------------------------------- kinship

class Tree:
    """A family tree (full siblings, one couple per person); people are ints, copied per branch."""

    def __init__(self):
        self.gender, self.parents, self.couple = [], {}, {}

    def copy(self):
        t = Tree()
        t.gender, t.parents, t.couple = list(self.gender), dict(self.parents), dict(self.couple)
        return t

    def new(self, g):
        self.gender.append(g)
        return len(self.gender) - 1

    def parents_of(self, x):
        if x not in self.parents:
            pair = (self.new("m"), self.new("f"))
            self.parents[x] = self.couple[pair[0]] = self.couple[pair[1]] = pair
        return self.parents[x]

    def couple_of(self, x):
        if x not in self.couple:
            s = self.new("f" if self.gender[x] == "m" else "m")
            pair = (x, s) if self.gender[x] == "m" else (s, x)
            self.couple[x] = self.couple[s] = pair
        return self.couple[x]


def _kids(t, pair, g, exclude):
    """Every way to pick a g-gendered child of `pair`: an existing one not excluded, or a new one."""
    out = [(t, c) for c, par in t.parents.items() if par == pair and t.gender[c] == g and c not in exclude]
    t2 = t.copy()
    c = t2.new(g)
    t2.parents[c] = pair
    return out + [(t2, c)]


def op(t, x, kind, g, exclude):
    """Every (tree, person) that can be 'the g-gendered <parent|child|sibling> of x'."""
    t = t.copy()
    if kind == "P":
        return [(t, t.parents_of(x)[0 if g == "m" else 1])]
    if kind == "C":
        return _kids(t, t.couple_of(x), g, exclude)
    return _kids(t, t.parents_of(x), g, exclude | {x})


DEFINITION = {  # relation word -> primitive relations; "*" = the person in between may be either gender
    "father": ["Pm"], "mother": ["Pf"], "son": ["Cm"], "daughter": ["Cf"], "brother": ["Sm"], "sister": ["Sf"],
    "grandfather": ["P*", "Pm"], "grandmother": ["P*", "Pf"], "grandson": ["C*", "Cm"],
    "granddaughter": ["C*", "Cf"], "uncle": ["P*", "Sm"], "aunt": ["P*", "Sf"], "nephew": ["S*", "Cm"],
    "niece": ["S*", "Cf"],
}
WORDS = {  # (generations up from the anchor to the common ancestors, generations down) -> (male, female)
    (1, 0): ("father", "mother"), (2, 0): ("grandfather", "grandmother"),
    (3, 0): ("great-grandfather", "great-grandmother"), (4, 0): ("great-great-grandfather", "great-great-grandmother"),
    (0, 1): ("son", "daughter"), (0, 2): ("grandson", "granddaughter"),
    (0, 3): ("great-grandson", "great-granddaughter"), (0, 4): ("great-great-grandson", "great-great-granddaughter"),
    (1, 1): ("brother", "sister"), (2, 1): ("uncle", "aunt"), (3, 1): ("great-uncle", "great-aunt"),
    (4, 1): ("great-great-uncle", "great-great-aunt"), (1, 2): ("nephew", "niece"),
    (1, 3): ("great-nephew", "great-niece"), (1, 4): ("great-great-nephew", "great-great-niece"),
}


def _ancestors(t, x):
    dist, frontier = {x: 0}, [x]
    while frontier:
        nxt = []
        for p in frontier:
            for q in t.parents.get(p, ()):
                if q not in dist:
                    dist[q] = dist[p] + 1
                    nxt.append(q)
        frontier = nxt
    return dist


def relation(t, x, anchor):
    """The word for x's relation to anchor, found in the tree via the nearest common ancestors."""
    ax, aa = _ancestors(t, x), _ancestors(t, anchor)
    common = set(ax) & set(aa)
    if not common:
        return "unrelated"
    best = min(common, key=lambda c: ax[c] + aa[c])
    key = (aa[best], ax[best])
    return WORDS[key][0 if t.gender[x] == "m" else 1] if key in WORDS else f"offset{key}"


def all_readings(links):
    """Relations of p1..pk to p0 in EVERY family consistent with the story (named people distinct)."""
    worlds = []
    for g0 in "mf":
        t = Tree()
        worlds.append((t, [t.new(g0)]))
    for rel in links:
        nxt = []
        for t, named in worlds:
            frontier = [(t, named[-1])]
            prims = DEFINITION[rel]
            for i, prim in enumerate(prims):
                last = i == len(prims) - 1
                genders = "mf" if prim[1] == "*" else prim[1]
                frontier = [res for tt, x in frontier for g in genders
                            for res in op(tt, x, prim[0], g, set(named) if last else set())]
            nxt += [(tt, named + [y]) for tt, y in frontier if y not in named]
        worlds = nxt
        assert len(worlds) < 20000
    return {tuple(relation(t, p, named[0]) for p in named[1:]) for t, named in worlds}


_KIN_Q = re.compile(r"^(.*) Question: How is ([A-Z][a-z]+) related to ([A-Z][a-z]+)\? Answer:$")
_KIN_S = re.compile(r"^([A-Z][a-z]+) is the ([a-z-]+) of ([A-Z][a-z]+)$")


def parse_story(prompt):
    """Return the chain's relation words p0 -> pk, in chain order, from a rendered kinship prompt."""
    m = _KIN_Q.match(prompt)
    assert m, prompt
    body, last, anchor = m.groups()
    link = {}  # object -> (subject, relation)
    for sentence in filter(None, (s.strip() for s in body.split("."))):
        subj, rel, obj = _KIN_S.match(sentence).groups()
        assert obj not in link
        link[obj] = (subj, rel)
    name, rels = anchor, []
    while name in link:
        name, rel = link[name]
        rels.append(rel)
    assert name == last and len(rels) == len(link)
    return rels


def test_family_tree_readings_detect_ambiguity():
    # the checker itself: these stories have more than one reading, or none that is a blood relation
    assert len(all_readings(["aunt", "brother"])) > 1  # an uncle, or one's father
    assert all_readings(["son", "mother"]) == {("son", "unrelated")}  # one's wife (or oneself: excluded)
    assert len(all_readings(["grandfather", "son"])) > 1  # one's father or an uncle
    assert all_readings(["father", "son"]) == {("father", "brother")}
    assert all_readings(["brother", "father", "son", "father"]) == set()  # the 2nd father is the 1st one


@pytest.mark.parametrize("depth", range(2, 11))
def test_kinship_answers_agree_with_every_reading_of_the_story(depth):
    answers = set()
    for ex in make_task("kinship", 20, depth, seed=5):
        rels = parse_story(ex.prompt)
        assert len(rels) == depth
        readings = all_readings(rels)
        assert readings == {ex.steps}, (ex.prompt, readings)  # consistent, and the answer is entailed
        assert ex.answer == " " + ex.steps[-1]
        answers.add(ex.answer)
    assert len(answers) >= 8  # answers are spread, not one relation


def test_kinship_unshuffled_keeps_chain_order():
    ex = make_task("kinship", 1, 6, seed=2, shuffle=False)[0]
    body = _KIN_Q.match(ex.prompt).group(1)
    sents = [_KIN_S.match(s.strip()).groups() for s in body.split(".") if s.strip()]
    assert all(a[0] == b[2] for a, b in zip(sents, sents[1:]))


# ----------------------------------------------------------------------------- iterated

_ADD = re.compile(r"^x=(\d+); f\(x\)=x\+(\d+) mod (\d+); f\^(\d+)\(x\)=$")
_AFFINE = re.compile(r"^x=(\d+); f\(x\)=(\d+)\*x\+(\d+) mod (\d+); f\^(\d+)\(x\)=$")
_ROTATE = re.compile(r"^s=([a-z]+); f\(s\)=rotate left by (\d+); f\^(\d+)\(s\)=$")
_PERMUTE = re.compile(r"^s=([a-z]+); f\(s\)=((?:s\[\d+\])+); f\^(\d+)\(s\)=$")


def run_prompt(prompt):
    """Parse an iterated-step prompt and apply its rule in a plain loop; return (rule, depth, states)."""
    if m := _ADD.match(prompt):
        x, c, mod, d = map(int, m.groups())
        kind, f = "add", lambda v: (v + c) % mod
    elif m := _AFFINE.match(prompt):
        x, a, b, mod, d = map(int, m.groups())
        kind, f = "affine", lambda v: (a * v + b) % mod
    elif m := _ROTATE.match(prompt):
        x, r, d = m.group(1), int(m.group(2)), int(m.group(3))
        kind, f = "rotate", lambda s: s[r:] + s[:r]
    elif m := _PERMUTE.match(prompt):
        x, d = m.group(1), int(m.group(3))
        idx = [int(i) for i in re.findall(r"\d+", m.group(2))]
        assert sorted(idx) == list(range(len(x)))
        kind, f = "permute", lambda s: "".join(s[i] for i in idx)
    else:
        raise AssertionError(f"unparsed prompt {prompt!r}")
    states = []
    for _ in range(d):
        x = f(x)
        states.append(str(x))
    return kind, d, states, str(x)


@pytest.mark.parametrize("depth", [0, 1, 7, 30])
def test_iterated_labels_agree_with_a_plain_loop(depth):
    kinds = set()
    for ex in make_task("iterated", 60, depth, seed=9):
        kind, d, states, final = run_prompt(ex.prompt)
        assert d == depth == ex.depth
        assert list(ex.steps) == states and len(ex.steps) == depth
        assert ex.answer == " " + final
        kinds.add(kind)
    assert kinds == {"add", "affine", "rotate", "permute"}


def test_iterated_options_fix_rule_modulus_and_length():
    for ex in make_task("iterated", 10, 4, rule="affine", modulus=17):
        m = _AFFINE.match(ex.prompt)
        assert m and m.group(4) == "17" and math.gcd(int(m.group(2)), 17) == 1
    for ex in make_task("iterated", 10, 4, rule="permute", length=8):
        assert len(_PERMUTE.match(ex.prompt).group(1)) == 8


# ----------------------------------------------------------------------------- recall

@pytest.mark.parametrize("seed", [0, 7])
def test_recall_queries_are_answerable_from_the_facts(seed):
    lines = recall_facts(100, seed=seed)
    examples = make_task("recall", 300, 0, seed=seed)
    for ex in examples:
        assert ex.prompt + ex.answer + "." in lines
        # the prompt identifies exactly one fact, so the answer is determined by the text
        assert sum(line.startswith(ex.prompt + " ") for line in lines) == 1
    assert len({ex.prompt for ex in examples}) == 300  # no repeats until every fact was asked
    small = make_task("recall", 20, 0, seed=seed, n_entities=5)
    assert all(ex.prompt + ex.answer + "." in recall_facts(5, seed=seed) for ex in small)


# ----------------------------------------------------------------------------- scoring and streams

@pytest.mark.parametrize("name", TASKS)
def test_score_accepts_the_answer_and_rejects_wrong_ones(name):
    for ex in make_task(name, 10, DEPTH_OF[name], seed=2):
        assert score(ex, ex.answer)
        assert score(ex, ex.answer.strip())
        assert score(ex, "  " + ex.answer.strip() + " \n")
        assert not score(ex, ex.answer + "x")
        assert not score(ex, ex.answer.strip()[:-1])
        assert not score(ex, "")
        if name == "deduction":
            assert not score(ex, " false" if ex.answer == " true" else " true")
        if any(c.isalpha() for c in ex.answer):
            assert not score(ex, ex.answer.upper() if ex.answer != ex.answer.upper() else ex.answer.lower())


def test_render_stream_joins_texts_by_newline():
    examples = make_task("iterated", 5, 2) + make_task("kinship", 3, 2)
    stream = render_stream(examples)
    assert stream.split("\n") == [ex.text for ex in examples]


def test_mix_texts_ratio_order_and_determinism():
    chunks = [f"corpus chunk {i}" for i in range(2000)]
    examples = make_task("iterated", 50, 3, seed=1)
    texts = {ex.text for ex in examples}
    for ratio in (0.05, 0.2, 0.5):
        mixed = mix_texts(chunks, examples, ratio, seed=4)
        share = sum(item in texts for item in mixed) / len(mixed)
        assert abs(share - ratio) < 0.01
        assert [item for item in mixed if item not in texts] == chunks  # corpus order kept
        assert mixed == mix_texts(chunks, examples, ratio, seed=4)
        assert mixed != mix_texts(chunks, examples, ratio, seed=5)
    assert mix_texts(chunks, examples, 0.0, seed=0) == chunks
    task_items = [item for item in mix_texts(chunks[:100], examples, 0.5, seed=0) if item in texts]
    assert task_items == [ex.text for ex in examples] * 2  # in order, cycled when more are needed


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,field", [
    (dict(name="sudoku", n=3, depth=1), "name"),
    (dict(name="deduction", n=-1, depth=1), "n"),
    (dict(name="deduction", n=2.5, depth=1), "n"),
    (dict(name="deduction", n=3, depth=DEDUCTION_MAX_DEPTH + 1), "depth"),
    (dict(name="deduction", n=3, depth=-1), "depth"),
    (dict(name="kinship", n=3, depth=1), "depth"),
    (dict(name="kinship", n=3, depth=11), "depth"),
    (dict(name="iterated", n=3, depth=-2), "depth"),
    (dict(name="recall", n=3, depth=1), "depth"),
    (dict(name="iterated", n=3, depth=True), "depth"),
    (dict(name="iterated", n=3, depth=2, seed="x"), "seed"),
    (dict(name="iterated", n=3, depth=2, bogus=1), "bogus"),
    (dict(name="iterated", n=3, depth=2, rule="square"), "rule"),
    (dict(name="iterated", n=3, depth=2, modulus=1), "modulus"),
    (dict(name="iterated", n=3, depth=2, length=40), "length"),
    (dict(name="deduction", n=3, depth=2, p_true=1.5), "p_true"),
    (dict(name="deduction", n=3, depth=2, n_entities=0), "n_entities"),
    (dict(name="kinship", n=3, depth=2, max_up=0), "max_up"),
    (dict(name="kinship", n=3, depth=2, shuffle="yes"), "shuffle"),
    (dict(name="recall", n=3, depth=0, n_entities=-4), "n_entities"),
])
def test_bad_input_names_the_field_and_value(kwargs, field):
    with pytest.raises(ValueError, match=rf"(^|\W){field}=") as err:
        make_task(**kwargs)
    assert repr(kwargs[field]) in str(err.value)
    if field == "name":
        assert all(t in str(err.value) for t in TASKS)


def test_depth_errors_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"depth=11 .*2\.\.10"):
        make_task("kinship", 1, 11)
    with pytest.raises(ValueError, match=rf"depth=9 .*0\.\.{DEDUCTION_MAX_DEPTH}"):
        make_task("deduction", 1, 9)
    with pytest.raises(ValueError, match="bogus=1 .*options are"):
        make_task("kinship", 1, 3, bogus=1)


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, "0.5", True])
def test_mix_texts_rejects_bad_ratio(ratio):
    with pytest.raises(ValueError, match=r"ratio="):
        mix_texts(["a", "b"], make_task("iterated", 2, 1), ratio, seed=0)


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="examples="):
        mix_texts(["a"] * 10, [], 0.5, seed=0)
    with pytest.raises(ValueError, match="corpus_text_chunks="):
        mix_texts("not a list", [], 0.0, seed=0)
    with pytest.raises(ValueError, match="prediction="):
        score(make_task("iterated", 1, 1)[0], None)
    with pytest.raises(ValueError, match="n_entities="):
        recall_facts(0, seed=0)
    with pytest.raises(ValueError, match="name="):
        depth_range("nope")
