"""`kiln adopt` on the command line: outputs, writes, reports, and every bad-input path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.adopt import cli as adopt_cli
from kiln.cli import main

GOOD = "import torch\n\n\ndef f(x):\n    # keep\n    return x * torch.sigmoid(x)\n"
REWRITTEN = "import torch\n\n\ndef f(x):\n    # keep\n    return torch.nn.functional.silu(x)\n"


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(GOOD)
    return path


def test_lists_matches_without_changing_files(good, capsys):
    assert main(["adopt", str(good)]) == 0
    assert f"{good}:6-6: silu in f (rewritten)" in capsys.readouterr().out
    assert good.read_text() == GOOD


def test_diff(good, capsys):
    assert main(["adopt", str(good), "--diff"]) == 0
    out = capsys.readouterr().out
    assert "-    return x * torch.sigmoid(x)\n+    return torch.nn.functional.silu(x)\n" in out


def test_write_with_backup_then_idempotent(good, capsys):
    assert main(["adopt", str(good), "--write"]) == 0
    assert good.read_text() == REWRITTEN
    assert (good.parent / "model.py.orig").read_text() == GOOD
    os.remove(good.parent / "model.py.orig")
    assert main(["adopt", str(good), "--write"]) == 0          # nothing to do: no write, no backup
    assert good.read_text() == REWRITTEN and not (good.parent / "model.py.orig").exists()
    assert sorted(p.name for p in good.parent.iterdir()) == ["model.py"]     # no temp files left


def test_write_no_backup(good):
    assert main(["adopt", str(good), "--write", "--no-backup"]) == 0
    assert good.read_text() == REWRITTEN and not (good.parent / "model.py.orig").exists()


def test_write_is_atomic(good, monkeypatch):
    """A failure while writing leaves the original file whole and no temporary behind."""
    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(adopt_cli.os, "replace", broken_replace)
    with pytest.raises(OSError):
        main(["adopt", str(good), "--write", "--no-backup"])
    assert good.read_text() == GOOD
    assert sorted(p.name for p in good.parent.iterdir()) == ["model.py"]


def test_out_dir_mirrors_tree(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text(GOOD)
    (src / "b.py").write_text("x = 1\n")
    out = tmp_path / "out"
    assert main(["adopt", str(src), "--out", str(out)]) == 0
    assert (out / "pkg" / "a.py").read_text() == REWRITTEN
    assert not (out / "b.py").exists()          # unchanged files are not written
    assert (src / "pkg" / "a.py").read_text() == GOOD


def test_list_rules_starts_without_torch_or_libcst():
    # `kiln adopt --list-rules` (and the startup of every `kiln adopt`) must not import torch or libcst
    code = ("import sys; from kiln.cli import main; main(['adopt', '--list-rules']); "
            "print(sorted(m for m in ('torch', 'libcst') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.stdout.splitlines()[-1] == "[]"


def test_report_json(good, tmp_path):
    report = tmp_path / "r.json"
    assert main(["adopt", str(good), "--rules", "silu,rms_norm", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["files"] == 1 and isinstance(data["seconds"], float)
    assert data["matches"] == [{"file": str(good), "rule": "silu", "class": None, "method": "f",
                                "first_line": 6, "last_line": 6, "applied": True, "reason": None, "requires": []}]


def test_user_rule_file(good, tmp_path, capsys):
    rules = tmp_path / "mine.kiln"
    rules.write_text("rule sig2 {\n  pattern { sigmoid($x) -> $y }\n  replace { torch.nn.functional.hardsigmoid($x) -> $y }\n}\n")
    assert main(["adopt", str(good), "--rules", str(rules), "--diff"]) == 0
    assert "+    return x * torch.nn.functional.hardsigmoid(x)\n" in capsys.readouterr().out


def test_show_dsl(good, capsys):
    assert main(["adopt", str(good), "--show-dsl"]) == 0
    out = capsys.readouterr().out
    assert "def f(x) {\n  sigmoid(x) -> %1\n  x * %1 -> %2\n  return %2\n}" in out
    assert good.read_text() == GOOD


def test_list_rules(capsys):
    assert main(["adopt", "--list-rules"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["cross_entropy", "dropout_add_layernorm", "fused_qkv", "gelu_erf", "gelu_tanh", "linear_cross_entropy",
                     "linear_gelu", "rms_norm", "rope", "sdpa", "silu", "swiglu"]


# -- bad input -------------------------------------------------------------------------------------

def test_syntax_error_is_reported_and_skipped(good, tmp_path, capsys):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n    pass\n")
    assert main(["adopt", str(bad), str(good), "--write", "--no-backup"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err and "syntax error" in err
    assert good.read_text() == REWRITTEN                      # the good file was still processed
    assert bad.read_text() == "def f(:\n    pass\n"


def test_missing_path(good, capsys):
    assert main(["adopt", "/no/such/file.py", str(good)]) == 1
    assert "/no/such/file.py: no such file or directory" in capsys.readouterr().err


def test_non_python_file(tmp_path, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert main(["adopt", str(other)]) == 1
    assert "not a Python file" in capsys.readouterr().err
    binary = tmp_path / "blob.py"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    assert main(["adopt", str(binary)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read anything")
def test_unreadable_file(good, capsys):
    good.chmod(0)
    try:
        assert main(["adopt", str(good)]) == 1
        assert "cannot read" in capsys.readouterr().err
    finally:
        good.chmod(0o644)


def test_rule_file_grammar_error(good, tmp_path, capsys):
    rules = tmp_path / "bad.kiln"
    rules.write_text("rule r {\n  pattern { sigmoid($x) -> }\n}\n")
    assert main(["adopt", str(good), "--rules", str(rules)]) == 2
    assert f"{rules}:2:" in capsys.readouterr().err
    assert good.read_text() == GOOD


@pytest.mark.parametrize("argv, message", [
    (["adopt"], "no PATH"),
    (["adopt", "x.py", "--rules", "geglu"], "unknown rule 'geglu'"),
    (["adopt", "x.py", "--rules", "missing.kiln"], "cannot read rule file"),
    (["adopt", "x.py", "--no-backup"], "only makes sense with --write"),
])
def test_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_write_and_out_are_exclusive(good):
    with pytest.raises(SystemExit) as info:
        main(["adopt", str(good), "--write", "--out", "d"])
    assert info.value.code == 2


def test_console_entry_point(good):
    result = subprocess.run([sys.executable, "-m", "kiln", "adopt", str(good), "--diff"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "torch.nn.functional.silu(x)" in result.stdout


def test_write_through_symlink_keeps_the_link(good, tmp_path):
    link = tmp_path / "link.py"
    link.symlink_to(good)
    assert main(["adopt", str(link), "--write", "--no-backup"]) == 0
    assert link.is_symlink() and good.read_text() == REWRITTEN
