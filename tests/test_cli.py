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


def test_explain_profiles_a_peer_beside_kiln(capsys):
    """--vs eager here (torch.compile takes tens of seconds; the same code path profiles it): both columns of
    the split, each category's time a number, and the gap line."""
    assert main(["explain", "--profile", "--vs", "eager", *TINY]) == 0
    out = capsys.readouterr().out
    table = out.split("Where each step's time goes")[1]
    head = next(line for line in table.splitlines() if line.startswith("category"))
    assert head.split()[1:] == ["kiln", "eager"]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in table.splitlines()
            if line.split() and line.split()[0] in ("matmul", "attention", "optimizer", "casts", "fused")}
    assert rows["matmul"][0] > 0 and rows["matmul"][1] > 0 and rows["optimizer"][1] > 0
    assert rows["fused"][1] == 0 and "kiln against eager, ms a step:" in out


def test_bad_arguments_exit_nonzero(capsys):
    with pytest.raises(SystemExit, match="give --profile too"):
        main(["explain", "--vs", "compile", *TINY])
    with pytest.raises(SystemExit, match="divisible"):
        main(["explain", "--hidden", "10", "--heads", "3"])
    with pytest.raises(SystemExit, match="unknown dialect"):
        main(["explain", "--dialects", "nope", *TINY])
    with pytest.raises(SystemExit, match="must be positive"):
        main(["demo", "--steps", "0"])
