"""The `kiln demo` and `kiln explain` commands on tiny sizes."""
import pytest

from kiln.cli import main

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--batch", "2", "--seq", "8"]


def test_demo_trains_both_and_reports(capsys):
    assert main(["demo", "--steps", "3", *TINY]) == 0
    out = capsys.readouterr().out
    assert "median step time" in out and "time to first step" in out
    drift = float(out.split("largest relative loss difference kiln vs eager:")[1].split()[0])
    assert drift < 1e-4


def test_explain_prints_the_table_and_source(capsys):
    assert main(["explain", *TINY]) == 0
    out = capsys.readouterr().out
    assert "sdpa:flash" in out and "adamw_update" in out
    assert main(["explain", "--source", "--dialects", "aten", *TINY]) == 0
    src = capsys.readouterr().out
    assert src.startswith("def kiln_step(") and "flash" not in src


def test_bad_arguments_exit_nonzero(capsys):
    with pytest.raises(SystemExit, match="divisible"):
        main(["explain", "--hidden", "10", "--heads", "3"])
    with pytest.raises(SystemExit, match="unknown dialect"):
        main(["explain", "--dialects", "nope", *TINY])
    with pytest.raises(SystemExit, match="must be positive"):
        main(["demo", "--steps", "0"])
