"""A bare name is torch's only when the file imports it from torch: the file's own `softmax`,
`sigmoid`, `erf` ... (defined, imported from elsewhere, brought by a star import, or bound two
ways) is never taken for torch's; torch's, however spelled, still is (compared with eager)."""
import textwrap

import libcst as cst
import pytest
import torch

from kiln.adopt.scope import Resolver
from tests.adopt.helpers import assert_same_training, load, rewrite

ATTENTION = """\
import math
import torch
import torch.nn.functional as F
from torch import nn
{binding}


class Attention(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        return {probs} @ v
"""

OWN_SOFTMAX = "def softmax(x, dim=-1):\n    return x / x.sum(dim, keepdim=True)"

# How a file can bind `softmax` to something that is not torch's softmax.
NOT_TORCH = {
    "local_def": OWN_SOFTMAX,
    "imported_from_elsewhere": "from mylib import softmax",
    "star_import": "from mylib import *",
    "two_bindings": "try:\n    from torch.nn.functional import softmax\nexcept ImportError:\n"
                    + textwrap.indent(OWN_SOFTMAX, "    "),
    "assigned": "softmax = lambda x, dim: x / x.sum(dim, keepdim=True)",
}


@pytest.mark.parametrize("binding", sorted(NOT_TORCH))
def test_softmax_not_torchs_is_left_alone(binding):
    src = ATTENTION.format(binding=NOT_TORCH[binding], probs="softmax(s, dim=-1)")
    _, new, matches = rewrite(src)
    assert new == src and matches == []     # neither rewritten nor reported as attention


# torch's softmax in its spellings: each is still attention, rewritten to sdpa.
TORCH = {
    "F.softmax": ("", "F.softmax(s, dim=-1)"),
    "torch.softmax": ("", "torch.softmax(s, dim=-1)"),
    "from_F_import": ("from torch.nn.functional import softmax", "softmax(s, dim=-1)"),
    "from_F_import_as": ("from torch.nn.functional import softmax as sm", "sm(s, dim=-1)"),
    "method": ("", "s.softmax(dim=-1)"),
    "nn.Softmax": ("", "self.sm(s)"),
    # `torch` is imported; the fallback binding in `except` does not make it the file's own
    "guarded_import": ("try:\n    import torch\nexcept ImportError:\n    torch = None", "torch.softmax(s, dim=-1)"),
}


@pytest.mark.parametrize("spelling", sorted(TORCH))
def test_torchs_softmax_is_still_attention(spelling):
    binding, probs = TORCH[spelling]
    src, new, matches = rewrite(ATTENTION.format(binding=binding, probs=probs))
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    assert "scaled_dot_product_attention(q, k, v" in new
    torch.manual_seed(0)
    ref, rew = load(src, "original")["Attention"](), load(new, "rewritten")["Attention"]()
    rew.load_state_dict(ref.state_dict())
    assert_same_training(ref, rew, torch.randn(2, 5, 16), atol=1e-5, rtol=1e-5)


ACTIVATION = """\
import math
import torch
from torch import nn
{binding}


class Act(nn.Module):
    def forward(self, x):
        return {expr}
"""

# (rule, the function the rule's pattern calls, the file's own version of it, the hand-written form)
ACTIVATIONS = {
    "silu": ("sigmoid", "def sigmoid(x):\n    return x.clamp(0, 1)", "x * sigmoid(x)"),
    "gelu_erf": ("erf", "def erf(x):\n    return x.clamp(-1, 1)", "0.5 * x * (1 + erf(x / math.sqrt(2)))"),
    "gelu_tanh": ("tanh", "def tanh(x):\n    return x.clamp(-1, 1)",
                  "0.5 * x * (1 + tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))"),
    "rms_norm": ("rsqrt", "def rsqrt(x):\n    return 1 / x",
                 "x * rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)"),
}


@pytest.mark.parametrize("how", ["local_def", "imported_from_elsewhere", "star_import"])
@pytest.mark.parametrize("rule", sorted(ACTIVATIONS))
def test_activation_helpers_not_torchs_are_left_alone(rule, how):
    name, own, expr = ACTIVATIONS[rule]
    binding = {"local_def": own, "imported_from_elsewhere": f"from mylib import {name}",
               "star_import": "from mylib import *"}[how]
    src = ACTIVATION.format(binding=binding, expr=expr)
    _, new, matches = rewrite(src)
    assert new == src and matches == []


@pytest.mark.parametrize("rule", sorted(ACTIVATIONS))
def test_activation_helpers_imported_from_torch_still_rewrite(rule):
    name, _, expr = ACTIVATIONS[rule]
    src, new, matches = rewrite(ACTIVATION.format(binding=f"from torch import {name}", expr=expr))
    assert [(m.rule, m.applied) for m in matches] == [(rule, True)]
    if rule == "rms_norm" and not hasattr(torch.nn.functional, "rms_norm"):
        return
    assert_same_training(load(src, "original")["Act"](), load(new, "rewritten")["Act"](), torch.randn(3, 8),
                         atol=1e-5, rtol=1e-5)


def _qualname(source: str, name: str) -> str:
    return Resolver(cst.parse_module(textwrap.dedent(source))).qualname(cst.Name(name))


def test_resolver_keeps_the_files_own_names_apart():
    assert _qualname("def softmax(x): ...", "softmax") == "__file__.softmax"
    assert _qualname("from torch.nn.functional import softmax", "softmax") == "torch.nn.functional.softmax"
    assert _qualname("from mylib import softmax", "softmax") == "mylib.softmax"
    assert _qualname("", "softmax") == "__file__.softmax"          # bound by nothing: not torch's either
    assert _qualname("", "abs") == "abs"                            # Python's builtin
    assert _qualname("def abs(x): ...", "abs") == "__file__.abs"
    assert _qualname("def maybe_add_mask(s, m): ...", "maybe_add_mask") == "maybe_add_mask"   # no meaning to clash with
    assert _qualname("import torch\ntorch = None", "torch") == "torch"
    assert _qualname("torch = object()", "torch") == "__file__.torch"
