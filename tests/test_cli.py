import math

import pytest

from workbench.cli import demo, main


def test_demo_learns_and_reports_every_loop_count(capsys):
    losses = demo(steps=25, seed=0, max_loops=5, progress=False)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    # 25 steps on the stdlib take a byte-level model well below the uniform loss ln 256 = 5.55
    assert losses[4] < math.log(256) - 2
    out = capsys.readouterr().out
    assert "r= 4" in out and "<- K" in out


def test_demo_rejects_bad_step_count(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert "--steps=0" in capsys.readouterr().err
