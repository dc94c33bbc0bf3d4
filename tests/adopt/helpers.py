"""Shared checks for adopt tests: rewrite, parse, idempotence, and numerics against eager PyTorch."""
from __future__ import annotations

import textwrap

import torch

from kiln.adopt import rewrite_source


def rewrite(src: str, rules=None):
    """Rewrite dedented `src`; asserts the result parses and a second run changes nothing."""
    src = textwrap.dedent(src)
    new, matches = rewrite_source(src, rules=rules)
    compile(new, "<rewritten>", "exec")
    again, more = rewrite_source(new, rules=rules)
    assert again == new, "rewriting twice changed the source"
    assert not [m for m in more if m.applied], "a rewritten file matched again"
    return src, new, matches


def load(src: str, name: str):
    namespace: dict = {}
    exec(compile(src, f"<{name}>", "exec"), namespace)
    return namespace


def assert_same_numerics(original: str, rewritten: str, cls: str, args=(), shape=(3, 5, 8), dtype=torch.float32,
                         atol=1e-6, rtol=1e-5):
    """Build `cls(*args)` from both sources with the same weights; forward outputs and the gradients
    of the input and of every parameter must agree (the reference is the original eager code)."""
    torch.manual_seed(0)
    ref = load(original, "original")[cls](*args)
    new = load(rewritten, "rewritten")[cls](*args)
    with torch.no_grad():
        for p in ref.parameters():          # non-trivial weights, not the ones/zeros init
            p.copy_(torch.randn_like(p))
    new.load_state_dict(ref.state_dict())
    assert_same_training(ref, new, torch.randn(*shape, dtype=dtype), atol=atol, rtol=rtol)


def assert_same_training(ref, new, x, *extra, atol=1e-6, rtol=1e-5):
    """`ref(x, *extra)` and `new(x, *extra)` (same weights) agree: output, and the gradients of `x` and
    of every parameter for one random output gradient."""
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_new = ref(x_ref, *extra), new(x_new, *extra)
    torch.testing.assert_close(out_new, out_ref, atol=atol, rtol=rtol)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_new.backward(grad)
    torch.testing.assert_close(x_new.grad, x_ref.grad, atol=atol, rtol=rtol)
    for (name, p_ref), p_new in zip(ref.named_parameters(), new.parameters()):
        torch.testing.assert_close(p_new.grad, p_ref.grad, atol=atol, rtol=rtol, msg=f"grad of {name}")
