"""Parameters declared once (issue 28): the train and retrofit notebooks pass their parameters on by name.

The train notebook's parameters are mapped onto LoopConfig, TrainConfig and train_run by reading the
dataclasses' fields (no list of its own in the library), and the retrofit notebook's defaults are the
ones retrofit_run declares.
"""

import dataclasses
import inspect

import pytest

from workbench.config import LoopConfig
from workbench.experiments import passed, train_notebook_args
from workbench.experiments.retrofit import retrofit_run
from workbench.experiments.runs import RUN_PARAMETERS
from workbench.pipeline.spec import notebook_defaults
from workbench.train import TrainConfig


def test_every_train_notebook_parameter_is_a_config_field_or_a_run_argument():
    model = {f.name for f in dataclasses.fields(LoopConfig)}
    train = {f.name for f in dataclasses.fields(TrainConfig)}
    run = set(inspect.signature(__import__("workbench.experiments", fromlist=["train_run"]).train_run).parameters)
    for name in notebook_defaults("train"):
        assert name in model | train | set(RUN_PARAMETERS) | {"model_overrides", "train_overrides", "out_dir"}, name
    assert set(RUN_PARAMETERS) <= run


def test_a_config_field_reaches_its_config_by_its_name_alone():
    """A field added to LoopConfig or TrainConfig is a train-notebook parameter by one line in its cell: the
    mapping is read off the dataclasses, so every field goes where its name says (run arguments first)."""
    for f in dataclasses.fields(LoopConfig):
        args = train_notebook_args(**{f.name: getattr(LoopConfig(), f.name)})
        if f.name in RUN_PARAMETERS:  # vocab_size: the tokenizer decides the model's
            assert f.name in args and f.name not in args["model"]
        else:
            assert f.name in args["model"], f.name
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("backward_loops", "flops", "steps"):  # mapped (0: full BPTT; 0 flops: steps), tested below
            continue
        args = train_notebook_args(**{f.name: f.default})
        if f.name in RUN_PARAMETERS:
            assert f.name in args
        elif f.name == "loops":  # LoopConfig's K first
            assert "loops" in args["model"] and "loops" not in args["train"]
        else:
            assert args["train"][f.name] == f.default, f.name


def test_overrides_reach_any_field_and_misnamed_parameters_are_refused():
    args = train_notebook_args(d_model=32, model_overrides={"history": 2}, train_overrides={"weight_decay": 0.1})
    assert args["model"] == {"d_model": 32, "history": 2} and args["train"] == {"weight_decay": 0.1}
    with pytest.raises(ValueError, match=r"d_modle=3 is invalid: is not a parameter of the train notebook"):
        train_notebook_args(d_modle=3)
    with pytest.raises(ValueError, match=r"train_overrides=\[1\] is invalid: must be a mapping of TrainConfig"):
        train_notebook_args(train_overrides=[1])


def test_the_notebook_defaults_map_as_the_notebook_documents_them():
    args = train_notebook_args(**notebook_defaults("train"))
    nb = notebook_defaults("train")
    assert args["model"]["max_seq_len"] == max(nb["seq_len"], 512)
    assert args["train"]["warmup"] == min(20, nb["steps"] // 10)
    assert args["train"]["steps"] == nb["steps"] and "flops" not in args["train"]  # flops 0: the budget is steps
    assert args["train"]["backward_loops"] is None  # 0: full BPTT
    assert args["data_seed"] is None and args["task_depths"] is None and args["task_options"] is None
    budget = train_notebook_args(**{**nb, "flops": 1e9, "nproc": 2, "batch_size": 8})
    assert budget["train"]["flops"] == 1e9 and "steps" not in budget["train"] and budget["train"]["batch_size"] == 4
    with pytest.raises(ValueError, match="batch_size=7 is invalid: must be a multiple of nproc=2"):
        train_notebook_args(**{**nb, "nproc": 2, "batch_size": 7})


def test_the_retrofit_notebook_declares_retrofit_runs_parameters_with_its_defaults():
    sig = inspect.signature(retrofit_run).parameters
    for name, default in notebook_defaults("retrofit").items():
        if name == "out_dir":
            continue
        assert name in sig, name
        want = sig[name].default
        assert (list(want) if isinstance(want, tuple) else want) == default, name


def test_passed_hands_on_only_what_the_function_takes():
    def f(a, b=1, *, c=2):
        return a, b, c

    assert passed(f, {"a": 1, "c": 3, "figures": object()}) == {"a": 1, "c": 3}
    names = passed(train_notebook_args, {"d_model": 8, "figures": None, "out_dir": "."})
    assert names == {"d_model": 8, "out_dir": "."}
