"""Every numeric parameter has a stated range, upper bound included, the same on every machine (config.LIMITS).

A value past its kind's limit is refused before any work, naming the field, the value, the bound and
how to go past it; `WORKBENCH_BEYOND_LIMITS=1` or `config.beyond_limits()` says so explicitly.
"""

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest

from workbench import LoopConfig, config
from workbench.config import LIMITS, PARAMETERS, beyond_limits, check_int, parameter_name
from workbench.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# numeric parameters without a kind in config.PARAMETERS: each is bounded by its own check, or a label
BOUNDED_ELSEWHERE = {
    **dict.fromkeys(("seed", "data_seed", "init_seed"), "a label for a random stream: any integer >= 0"),
    **dict.fromkeys(("token", "pad_id", "stop"), "a token id: checked against the vocabulary"),
    **dict.fromkeys(("min_lr_ratio", "decay_frac", "knowledge_margin", "level", "p_generic", "p_true", "ratio",
                     "task_ratio", "top_p"), "a fraction: [0, 1] in its own check"),
    **dict.fromkeys(("taper_start", "taper_end"), "taper_start + taper_end = 2, both > 0"),
    **dict.fromkeys(("norm_eps", "init_std"), "(0, 1] in LoopConfig"),
    "hits": "<= n", "dims": "2 or 3 (a plot's axes)", "length": "2..26 (letters of a chain)", "modulus": "3..10^6 in its own check",
    **dict.fromkeys(("phi", "fixed_phi"), "the fit's own bounds (laws.fit._PHI_BOUNDS)"),
    "threshold": "a KL or gate threshold: inf means never exit",
}


def _checked_fields() -> dict[str, str]:
    """Return {parameter name: where} for every literal field name given to check_int / check_float in workbench/."""
    out = {}
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("check_int", "check_float")
                    and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Call) and arg.args:  # f("d_model"), _f(name): the name inside
                arg = arg.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                text = arg.value
            elif isinstance(arg, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "0" for v in arg.values)
            else:
                continue  # a name held in a variable: the config dataclasses' fields are checked below
            name = parameter_name(re.sub(r"\[0\]$", "", text))
            if name.isidentifier():  # not a field named wholly at run time (f"{field}[{i}]")
                out.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def _notebook_numbers() -> dict[str, str]:
    """Return {parameter name: notebook} for every int / float / list[int] / list[float] notebook parameter."""
    out = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cell = next(c for c in json.loads(nb.read_text())["cells"] if "parameters" in c["metadata"].get("tags", []))
        for line in "".join(cell["source"]).splitlines():
            m = re.match(r"^(\w+): (int|float|list\[int\]|list\[float\]) =", line)
            if m:
                out.setdefault(m.group(1), nb.name)
    return out


def test_every_numeric_parameter_has_a_stated_range():
    import dataclasses

    fields = {f.name: f"{cls.__name__}" for cls in (LoopConfig, TrainConfig) for f in dataclasses.fields(cls)
              if re.search(r"\b(int|float)\b", str(f.type))}
    everything = {**fields, **_notebook_numbers(), **_checked_fields()}
    missing = {n: where for n, where in everything.items()
               if n not in PARAMETERS and n not in BOUNDED_ELSEWHERE and n != "out_dir"}
    assert not missing, f"numeric parameters with no range (add a kind in config.PARAMETERS): {missing}"
    assert set(PARAMETERS.values()) == set(LIMITS)  # every kind bounds something, every parameter has a kind


LIMITED = [  # (what is built, field named in the message, value, bound)
    (lambda v: LoopConfig(loops=v), "LoopConfig.loops", 4097, 4096),
    (lambda v: LoopConfig(core=v), "LoopConfig.core", 1025, 1024),
    (lambda v: LoopConfig(d_model=v, n_heads=2), "LoopConfig.d_model", 1 << 17, 65536),
    (lambda v: LoopConfig(n_heads=v, d_model=4096), "LoopConfig.n_heads", 2048, 1024),
    (lambda v: LoopConfig(vocab_size=v), "LoopConfig.vocab_size", (1 << 20) + 1, 1 << 20),
    (lambda v: LoopConfig(max_seq_len=v), "LoopConfig.max_seq_len", (1 << 20) + 1, 1 << 20),
    (lambda v: LoopConfig(hyper=v), "LoopConfig.hyper", 65, 64),
    (lambda v: LoopConfig(rope_theta=v), "LoopConfig.rope_theta", 2e12, 1e12),
    (lambda v: TrainConfig(steps=1, batch_size=v), "TrainConfig.batch_size", 65537, 65536),
    (lambda v: TrainConfig(steps=v), "TrainConfig.steps", (1 << 31) + 1, 1 << 31),
    (lambda v: TrainConfig(tokens=v), "TrainConfig.tokens", 10 ** 15 + 1, 10 ** 15),
    (lambda v: TrainConfig(flops=v), "TrainConfig.flops", 2e27, 1e27),
    (lambda v: TrainConfig(steps=1, lr=v), "TrainConfig.lr", 30.0, 10),
    (lambda v: TrainConfig(steps=1, eval_loops=[1, v]), "TrainConfig.eval_loops[1]", 5000, 4096),
    (lambda v: TrainConfig(steps=1, checkpoint_seconds=v), "TrainConfig.checkpoint_seconds", 1e8, 10000000),
    (lambda v: TrainConfig(steps=1, grad_clip=v), "TrainConfig.grad_clip", 1e7, 1000000),
    (lambda v: TrainConfig(steps=1, keep_checkpoints=v), "TrainConfig.keep_checkpoints", 1 << 25, 1 << 24),
]


@pytest.mark.parametrize("build, field, value, bound", LIMITED, ids=[c[1] for c in LIMITED])
def test_past_the_limit_is_refused_naming_it_and_the_way_past(build, field, value, bound, monkeypatch):
    monkeypatch.delenv(config.BEYOND_LIMITS_ENV, raising=False)
    with pytest.raises(ValueError) as e:
        build(value)
    msg = str(e.value)
    shown = int(bound) if float(bound).is_integer() and bound < 1e18 else bound
    assert msg.startswith(f"{field}={value!r} is invalid") and f"{shown}]" in msg and config.BEYOND_LIMITS_ENV in msg, msg
    build(bound)  # the limit itself is allowed
    with beyond_limits():  # said explicitly: allowed
        build(value)
    monkeypatch.setenv(config.BEYOND_LIMITS_ENV, "1")
    build(value)


def test_a_task_generator_refuses_a_count_past_the_limit_before_making_any():
    from workbench.data.tasks import make_task

    with pytest.raises(ValueError, match=r"n=16777217 is invalid: must be in \[0, 16777216\]"):
        make_task("iterated", (1 << 24) + 1, 1)


def test_a_pipeline_refuses_any_notebooks_number_past_its_limit_before_anything_runs(tmp_path, monkeypatch):
    from workbench import pipeline

    monkeypatch.delenv(config.BEYOND_LIMITS_ENV, raising=False)
    spec = tmp_path / "big.yaml"
    spec.write_text(textwrap.dedent("""\
        name: big
        steps:
          - name: train
            notebook: train
            params: {steps: 3, d_model: 32, n_heads: 2, n_kv_heads: 1, loops: 2, vocab_size: 300, seq_len: 32,
                     batch_size: 4, eval_loops: [1, 2, 40000]}
          - name: sweep
            notebook: loop_sweep
            each: {train: checkpoint}
            params: {max_loops: 100000, n_sequences: 100000000}
        """))
    with pytest.raises(pipeline.PipelineError) as e:
        pipeline.run(spec, runs_dir=tmp_path / "runs", report_html=False, log=None)
    msg = str(e.value)
    for text in ("step 'train': parameter eval_loops[2]=40000 is invalid: must be <= 4096",
                 "step 'sweep': parameter max_loops=100000 is invalid: must be <= 4096",
                 "step 'sweep': parameter n_sequences=100000000 is invalid: must be <= 16777216"):
        assert text in msg, msg
    assert "nothing was run" in msg and not (tmp_path / "runs").exists()
    # said explicitly: the limits step aside (the sweep's own check would still want a trained run)
    monkeypatch.setenv(config.BEYOND_LIMITS_ENV, "1")
    pipe = pipeline.load_spec(spec)
    pipeline.spec.validate(pipe, pipeline.expand(pipe, tmp_path / "runs"))


def test_the_readme_states_every_limit():
    readme = (ROOT / "README.md").read_text()
    for kind, (bound, what) in LIMITS.items():
        shown = f"{int(bound):,}" if float(bound).is_integer() and bound < 1e18 else f"{bound:g}"
        assert f"| {kind} | {shown} |" in readme, f"README lacks the row of {kind} (| {kind} | {shown} |)"
    assert config.BEYOND_LIMITS_ENV in readme
    assert check_int("max_loops", 4096, 1) == 4096
