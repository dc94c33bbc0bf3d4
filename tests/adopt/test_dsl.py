"""The DSL: grammar, round trips, and error messages that name file, line and column."""
import pytest

from kiln.adopt import DSLError, load_text
from kiln.adopt.analysis import analyze
from kiln.adopt.dsl import Const, Node, Ref, Rule, Structure, Var, format_node, format_structure, parse
from kiln.adopt.rules import builtin_names, load_builtin

RULE = """\
# a comment
rule my_silu {
  doc "x * sigmoid(x)"
  vars $x: tensor
  pattern {
    torch.sigmoid($x) -> $s    # canonicalized to sigmoid
    $x * $s -> $y
  }
  replace {
    torch.nn.functional.silu($x) -> $y
  }
}
"""


def test_parse_rule():
    [rule] = parse(RULE, "r.kiln")
    assert isinstance(rule, Rule) and rule.name == "my_silu" and rule.doc == "x * sigmoid(x)"
    assert rule.var_types == {"$x": "tensor"}
    [variant] = rule.variants
    assert [format_node(n) for n in variant.pattern] == ["torch.sigmoid($x) -> $s", "$x * $s -> $y"]
    assert [format_node(n) for n in variant.replace] == ["torch.nn.functional.silu($x) -> $y"]
    assert variant.pattern[0].line == 6


def test_user_rule_compiles_like_builtin():
    [compiled] = load_text(RULE, "r.kiln")
    [builtin] = load_builtin(["silu"])
    assert compiled.variants[0].tree.key == builtin.variants[0].tree.key


def test_structure_round_trip_from_source():
    src = (
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x, mask=None):\n"
        "        h = F.gelu(self.fc(x))\n"
        "        if mask is not None:\n            h = h.masked_fill(mask, 0.0)\n"
        "        y = h[..., : h.shape[-1] // 2].tanh() @ x.transpose(-1, -2)\n"
        "        return torch.softmax(y * 0.5, dim=-1), [h]\n"
    )
    fn = [f for f in analyze(src).functions if f.name == "forward"][0]
    text = fn.show()
    assert text == """\
def M.forward(self, x, mask) {
  torch.nn.Linear<self.fc>(x) -> %1
  torch.nn.functional.gelu(%1) -> h:1
  if {
    .masked_fill(h:1, mask, 0.0) -> h:2
  }
  tanh(h:3[..., : h.shape[-1] // 2]) -> %4
  transpose(x, dim0=-2, dim1=-1) -> %5
  %4 @ %5 -> y:1
  y:1 * 0.5 -> %7
  softmax(%7, dim=-1) -> %8
  return (%8, (h:3,))
}"""
    [again] = parse(text, "<show-dsl>")
    assert isinstance(again, Structure)
    assert format_structure(again.name, again.params, again.items) == text


def test_operands():
    [s] = parse("def f(x) {\n  .to(x, torch.float32, non_blocking=True) -> %1\n  return %1\n}")
    node = s.items[0]
    assert isinstance(node, Node) and node.op == ".to"
    assert node.args == (Var("x"), Ref("torch.float32")) and node.kwargs == (("non_blocking", Const(True)),)


@pytest.mark.parametrize("text, where, message", [
    ("rule x {\n  pattern {\n    tanh($x) ->\n  }\n}", "bad.kiln:4:3", "unexpected '}'"),
    ("rule x {\n  pattern { tanh($x) -> $y }\n", "bad.kiln:2:", "unexpected end of file"),
    ("rule x {\n  vars $x: matrix\n}", "bad.kiln:2:12", "unknown variable type 'matrix'"),
    ("rule ?", "bad.kiln:1:6", "unexpected character '?'"),
])
def test_grammar_errors_name_file_line_column(text, where, message):
    with pytest.raises(DSLError) as info:
        load_text(text, "bad.kiln")
    assert str(info.value).startswith(where) and message in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("rule x {\n  pattern { tanh($x) -> $y }\n  replace { F.gelu($z) -> $y }\n}", "$z is not bound"),
    ("rule x {\n  pattern { tanh($x) -> $t\n sigmoid($x) -> $y }\n  replace { g($x) -> $y }\n}", "never used"),
    ("rule x {\n  pattern { tanh($x) }\n  replace { g($x) -> $y }\n}", "needs `-> $result`"),
    ("rule x {\n  pattern { tanh(x) -> $y }\n  replace { g($y) }\n}", "start with `$`"),
    ("rule x {\n  pattern { tanh($x) -> $y }\n  replace { tanh($x) -> $y }\n}", "qualified name"),
    ("rule x {\n  doc \"no pattern\"\n}", "has no pattern"),
    ("rule x {\n  pattern { sigmoid($x) -> $s\n $x * $s -> $y }\n  replace { torch.sigmoid($x) -> $t\n"
     " $t * $x -> $y }\n}", "matches its own replacement"),
    ("rule x {\n  pattern { tanh($x) -> $y }\n  replace { torch.nn.functional.gelu($x) }\n}\n"
     "rule x {\n  pattern { tanh($x) -> $y }\n  replace { torch.nn.functional.gelu($x) }\n}", "defined twice"),
])
def test_rule_meaning_errors(text, message):
    with pytest.raises(DSLError) as info:
        load_text(text, "bad.kiln")
    assert str(info.value).startswith("bad.kiln:") and message in str(info.value)


def test_builtin_rules_load():
    assert builtin_names() == ["cross_entropy", "dropout_add_layernorm", "fused_qkv", "gelu_erf", "gelu_tanh", "linear_cross_entropy",
                               "linear_gelu", "rms_norm", "rope", "sdpa", "silu", "swiglu"]
    assert all(r.doc for r in load_builtin())
    with pytest.raises(DSLError, match="unknown rule 'geglu'"):
        load_builtin(["geglu"])
