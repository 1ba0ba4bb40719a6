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
    cfg = LoopConfig()
    with pytest.raises(Exception):
        cfg.loops = 3  # type: ignore[misc]
    assert cfg.replace(loops=3).loops == 3
