import pytest
import torch

from workbench import LoopConfig, LoopLM


def test_json_round_trip_keeps_every_field():
    cfg = LoopConfig(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, prelude=2, core=3, coda=0,
                     loops=9, inject="dense", history=2, history_op="channel", timestep="adaln",
                     hyper=2, hyper_dynamic=True, taper="reverse", taper_multiple=16, d_ff=128)
    again = LoopConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.notation == "2+3x9+0"
    assert again.effective_depth(4) == 2 + 3 * 4


def test_unknown_json_field_is_named():
    with pytest.raises(ValueError, match="bogus"):
        LoopConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("field,value", [
    ("prelude", -1), ("coda", -2), ("core", 0), ("loops", 0), ("loops", -3), ("d_model", 0),
    ("history", -1), ("hyper", 0), ("vocab_size", 0), ("loops", 2.5), ("core", True),
])
def test_bad_counts_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"LoopConfig\.{field}="):
        LoopConfig(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("inject", "concat"), ("timestep", "film"), ("taper", "linear"), ("history_op", "conv"),
])
def test_unknown_variant_names_the_field_and_the_choices(field, value):
    with pytest.raises(ValueError, match=rf"LoopConfig\.{field}='{value}'.*one of"):
        LoopConfig(**{field: value})


def test_heads_must_divide_d_model():
    with pytest.raises(ValueError, match=r"n_heads=5.*divide d_model=64"):
        LoopConfig(d_model=64, n_heads=5)
    with pytest.raises(ValueError, match=r"n_kv_heads=3"):
        LoopConfig(d_model=64, n_heads=4, n_kv_heads=3)


def test_taper_budget_rules():
    with pytest.raises(ValueError, match="taper_start"):
        LoopConfig(taper="cosine", taper_start=1.6, taper_end=0.5)
    with pytest.raises(ValueError, match="taper_multiple"):
        LoopConfig(d_ff=100, taper_multiple=64)


def test_loops_below_one_at_call_time_is_rejected():
    model = LoopLM(LoopConfig(vocab_size=64, d_model=32, n_heads=2, prelude=0, coda=0, core=1, loops=2))
    x = torch.zeros(1, 4, dtype=torch.long)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="loops="):
            model(x, loops=bad)
    with pytest.raises(ValueError, match="backward_loops="):
        model(x, loops=2, backward_loops=3)
    with pytest.raises(ValueError, match="loops="):
        model.trace(x, loops=0)


def test_config_is_frozen():
    import dataclasses

    cfg = LoopConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match="loops"):
        cfg.loops = 3  # type: ignore[misc]
    assert cfg.loops == LoopConfig().loops
    assert cfg.replace(loops=3).loops == 3


# ---- the shared argument checks ---------------------------------------------------------------------------
def test_check_int_accepts_integers_in_range_and_names_field_value_and_range():
    import numpy as np

    from workbench.config import check_int

    assert check_int("n", 3) == 3 and check_int("n", np.int64(4), 1, 4) == 4
    assert type(check_int("n", np.int32(2), 0)) is int
    for value, lo, hi, allowed in ((True, None, None, "must be an integer"), (2.0, None, None, "must be an integer"),
                                   ("3", 0, None, "must be an integer >= 0"), (0, 1, None, "must be an integer >= 1"),
                                   (11, 2, 10, "must be an integer in 2..10"), (5, None, 4, "must be an integer <= 4")):
        with pytest.raises(ValueError) as err:
            check_int("depth", value, lo, hi)
        assert str(err.value) == f"depth={value!r} is invalid: {allowed}"
    with pytest.raises(ValueError, match=r"^seed='x' is invalid: a seed$"):
        check_int("seed", "x", allowed="a seed")


def test_check_float_bounds_finiteness_and_bools():
    import math

    import numpy as np

    from workbench.config import check_float

    assert check_float("p", 1) == 1.0 and check_float("p", np.float32(0.5), 0, 1) == 0.5
    assert check_float("x", math.inf, finite=False) == math.inf
    assert check_float("p", 0.0, 0, 1) == 0.0 and check_float("p", 1.0, 0, 1) == 1.0  # closed by default
    cases = [
        (True, {}, "must be a finite number"), ("0.5", {}, "must be a finite number"),
        (math.nan, {"finite": False}, "must be a number"), (math.inf, {}, "must be a finite number"),
        (1.5, {"lo": 0, "hi": 1}, "must be a finite number in [0, 1]"),
        (1.0, {"lo": 0, "hi": 1, "hi_open": True}, "must be a finite number in [0, 1)"),
        (0.0, {"lo": 0, "lo_open": True}, "must be a finite number > 0"),
        (-1e-9, {"lo": 0}, "must be a finite number >= 0"), (3.0, {"hi": 2, "hi_open": True}, "must be a finite number < 2"),
    ]
    for value, kw, allowed in cases:
        with pytest.raises(ValueError) as err:
            check_float("eps", value, **kw)
        assert str(err.value) == f"eps={value!r} is invalid: {allowed}", (value, kw)


def test_check_bool_and_check_choice():
    from workbench.config import check_bool, check_choice, fail

    assert check_bool("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match=rf"^flag={bad!r} is invalid: must be True or False$"):
            check_bool("flag", bad)
    assert check_choice("kind", "dense", ("scalar", "dense")) == "dense"
    with pytest.raises(ValueError, match=r"^kind='conv' is invalid: must be one of scalar, dense$"):
        check_choice("kind", "conv", ("scalar", "dense"))
    with pytest.raises(ValueError, match="must be one of 1, 2"):
        check_choice("n", True, (1, 2))  # True == 1, but a bool is not a count
    with pytest.raises(ValueError, match=r"^where: x=\[1\] is invalid: no lists$"):
        fail("where: x", [1], "no lists")


@pytest.mark.parametrize("field,value", [
    ("tie_embeddings", 1), ("hyper_dynamic", "yes"), ("rope_theta", float("inf")), ("norm_eps", 0),
    ("init_std", True), ("taper_start", "1.5"), ("d_ff", True), ("n_kv_heads", 1.0),
])
def test_other_fields_are_checked_too(field, value):
    with pytest.raises(ValueError, match=rf"LoopConfig\.{field}={value!r}"):
        LoopConfig(**{field: value})
