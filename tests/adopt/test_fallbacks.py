"""Rewrites to kiln kernels keep the user's modules and run without kiln.

References: the original eager modules (outputs, gradients, hooks), and kiln's own kernels for the
plain-PyTorch fallbacks a rewritten file defines for machines without kiln."""
import sys

import pytest
import torch

from kiln import kernels
from kiln.adopt import fallbacks
from tests.adopt.helpers import load, rewrite

MLP = """\
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d=8, approximate="tanh"):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)
        self.approximate = approximate

    def forward(self, x):
        h = self.c_fc(x)
        h = self.gelu(h)
        return self.c_proj(h) + self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))
"""


def _pair():
    src, new, matches = rewrite(MLP, rules=["linear_gelu"])
    assert [m.applied for m in matches] == [True, True]
    torch.manual_seed(0)
    ref, rew = load(src, "o")["MLP"](), load(new, "n")["MLP"]()
    rew.load_state_dict(ref.state_dict())
    return ref, rew, new


def test_state_dict_and_modules_are_kept():
    ref, rew, new = _pair()
    assert list(rew.state_dict()) == list(ref.state_dict())
    assert "self.gelu = nn.GELU()" in new            # still called: kiln_kernels.linear_act(x, self.c_fc, self.gelu)
    assert "kiln_kernels.linear_act(x, self.c_fc, self.gelu)" in new


def test_forward_hooks_on_the_linear_still_fire():
    ref, rew, _ = _pair()
    seen = {"ref": 0, "rew": 0}
    ref.c_fc.register_forward_hook(lambda m, i, o: seen.__setitem__("ref", seen["ref"] + 1))
    rew.c_fc.register_forward_hook(lambda m, i, o: seen.__setitem__("rew", seen["rew"] + 1))
    x = torch.randn(3, 8)
    torch.testing.assert_close(rew(x), ref(x))
    assert seen["rew"] == seen["ref"] == 2


def test_dynamic_quantization_falls_back_to_the_module_call():
    ref, rew, _ = _pair()
    qref = torch.ao.quantization.quantize_dynamic(ref, {torch.nn.Linear}, dtype=torch.qint8)
    qrew = torch.ao.quantization.quantize_dynamic(rew, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(qrew(x), qref(x))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_config_chosen_approximation_is_honoured(approximate):
    src, new, _ = rewrite(MLP, rules=["linear_gelu"])
    torch.manual_seed(0)
    ref, rew = load(src, "o")["MLP"](approximate=approximate), load(new, "n")["MLP"](approximate=approximate)
    rew.load_state_dict(ref.state_dict())
    x = torch.randn(3, 8, requires_grad=True)
    torch.testing.assert_close(rew(x), ref(x), atol=1e-6, rtol=1e-5)


def test_rewritten_file_runs_without_kiln(monkeypatch):
    ref, _, new = _pair()
    for name in [m for m in sys.modules if m == "kiln.kernels" or m.startswith("kiln.kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kiln.kernels", None)      # `import kiln.kernels` raises ImportError
    namespace = load(new, "no_kiln")
    assert isinstance(namespace["kiln_kernels"], type)          # the fallback namespace, not the package
    rew = namespace["MLP"]()
    rew.load_state_dict(ref.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(rew(x), ref(x))


def _module_code(name):
    import libcst as cst
    return "import torch\n" + cst.Module(body=[fallbacks.block([name])]).code


@pytest.fixture
def no_kiln(monkeypatch):
    monkeypatch.setitem(sys.modules, "kiln.kernels", None)


def test_fallbacks_compute_what_the_kernels_compute(no_kiln):
    torch.manual_seed(0)
    fc = torch.nn.Linear(8, 12)
    x = torch.randn(2, 5, 8)
    gate, up = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    cases = {
        "linear_act": ((x, fc, torch.nn.GELU()), kernels.linear_act),
        "linear_gelu_of": ((x, fc, "tanh"), kernels.linear_gelu_of),
        "act_mul": ((torch.nn.SiLU(), gate, up), kernels.act_mul),
        "cross_entropy_of": ((torch.nn.CrossEntropyLoss(ignore_index=3), x.reshape(10, 8),
                              torch.tensor([1, 3, 0, 7, 3, 2, 5, 6, 4, 3])), kernels.cross_entropy_of),
        "cross_entropy": ((x.reshape(10, 8), torch.tensor([1, -100, 0, 7, 3, 2, 5, 6, 4, 3])), kernels.cross_entropy),
        "swiglu": ((gate, up), kernels.swiglu),
        "rope": ((q, k, cos, sin), kernels.rope),
    }
    assert set(cases) == set(fallbacks.EAGER)
    for name, (args, kernel) in cases.items():
        namespace: dict = {}
        exec(compile(_module_code(name), "<fallback>", "exec"), namespace)
        got, want = getattr(namespace["kiln_kernels"], name)(*args), kernel(*args)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


def test_a_second_run_extends_the_block():
    first, _ = rewrite("import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    def __init__(self):\n"
                       "        super().__init__()\n        self.fc = nn.Linear(4, 4)\n        self.act = nn.GELU()\n\n"
                       "    def forward(self, x):\n        return self.act(self.fc(x))\n", rules=["linear_gelu"])[1:]
    assert first.count("import kiln.kernels as kiln_kernels") == 1
    more = first + ("\n\nclass N(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.fc = nn.Linear(4, 4)\n\n    def forward(self, x):\n"
                    "        return torch.nn.functional.gelu(self.fc(x))\n")
    _, again, _ = rewrite(more, rules=["linear_gelu"])
    assert again.count("import kiln.kernels as kiln_kernels") == 1
    assert "def linear_act(" in again and "def linear_gelu_of(" in again
