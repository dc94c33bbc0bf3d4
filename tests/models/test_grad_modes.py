"""The model's own grad-mode and autocast blocks (kiln/capture/modes.py), against eager PyTorch.

torch.export (2.13) records `torch.no_grad()` as a higher-order call Kiln detaches, but a no_grad block
*inside* a `torch.autocast` block is lost (the autocast pass splits the block and no grad-mode call is
left): Kiln used to differentiate through it silently (gradients off by 0.75 on the model below). It is
refused now, naming the module; a `torch.autocast(enabled=False)` block runs in fp32 under amp."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln

aten = torch.ops.aten


class Blocks(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.proj, self.router, self.kind = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), kind

    def forward(self, x):
        h = self.proj(x)
        if self.kind == "no_grad":
            s = self.router(h).sigmoid()
            with torch.no_grad():
                z = s.sum(-1, keepdim=True) * 2
        elif self.kind == "autocast_in_no_grad":
            s = self.router(h).sigmoid()
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                z = s.sum(-1, keepdim=True) * 2
        elif self.kind in ("no_grad_in_autocast_off", "set_grad_in_autocast_on"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.kind.endswith("_on")):
                s = self.router(h).sigmoid().float()
                with (torch.set_grad_enabled(False) if self.kind.startswith("set_grad") else torch.no_grad()):
                    z = s.sum(-1, keepdim=True) * 2
        else:                                       # "autocast_off": the router in full precision
            with torch.autocast("cpu", enabled=False):
                s = self.router(h.float()).sigmoid()
            z = 1.0
        return (h * s.sum(-1, keepdim=True) * z).square().mean()


def _sgd_grads(model, x, **kw):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), **kw)
    loss = step(x)
    return step, loss, {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["no_grad", "autocast_in_no_grad"])
def test_no_grad_blocks_carry_no_gradient(kind):
    torch.manual_seed(0)
    model, x = Blocks(kind), torch.randn(3, 5, 8)
    ref = copy.deepcopy(model)
    ref(x).backward()
    _, _, got = _sgd_grads(model, x)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad if p.grad is not None else torch.zeros_like(got[n]),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["no_grad_in_autocast_off", "set_grad_in_autocast_on"])
def test_a_no_grad_block_inside_an_autocast_block_is_refused(kind):
    model, x = Blocks(kind), torch.randn(3, 5, 8)
    before = copy.deepcopy(model.state_dict())
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))
    with pytest.raises(kiln.UnsupportedError, match=r"no_grad.*inside a torch.autocast.*\.detach\(\)"):
        step(x)
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n])


def test_an_autocast_off_block_stays_in_fp32_under_amp():
    torch.manual_seed(0)
    model, x = Blocks("autocast_off"), torch.randn(3, 5, 8)
    step, _, _ = _sgd_grads(model, x, amp="bf16")
    linears = [n for n in step.graph.nodes if n.target is aten.linear.default and n.phase.value == "forward"]
    proj, router = linears                      # (export gives the block's ops no module path)
    assert proj.args[0].meta.dtype == torch.bfloat16 and not proj.full_precision         # amp as usual
    assert router.full_precision and {a.meta.dtype for a in router.inputs} == {torch.float32}


def test_hugging_face_maybe_autocast_off_blocks_stay_in_fp32_under_amp():
    """`maybe_autocast(device, enabled=False)` (transformers' MoE routers) is a no-op outside autocast; during
    capture Kiln opens the block itself, so the router's top-k runs in fp32 as under autocast."""
    generic = pytest.importorskip("transformers.utils.generic")

    class Router(Blocks):
        def forward(self, x):
            h = self.proj(x)
            with generic.maybe_autocast("cpu", enabled=False):
                s = self.router(h.float()).sigmoid()
            return (h * s.sum(-1, keepdim=True)).square().mean()

    torch.manual_seed(0)
    model, x = Router("maybe_autocast"), torch.randn(3, 5, 8)
    ref = copy.deepcopy(model)
    ref(x).backward()
    step, _, got = _sgd_grads(model, x, amp="bf16")
    router = [n for n in step.graph.nodes if n.target is aten.linear.default and n.phase.value == "forward"][1]
    assert router.full_precision and {a.meta.dtype for a in router.inputs} == {torch.float32}
    assert (got["router.weight"] - ref.router.weight.grad).norm() <= 0.05 * ref.router.weight.grad.norm()
    assert generic.maybe_autocast("cpu", enabled=False).__class__.__name__ == "nullcontext"    # restored


class GrowingTable(torch.nn.Module):
    """A position table the forward grows for a longer input and stores back (seamless_m4t's conformer)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("pe", torch.zeros(1, 4, 8))

    def forward(self, x):
        if x.shape[1] > self.pe.shape[1]:
            self.pe = torch.sin(torch.arange(x.shape[1] * 8.0).reshape(1, x.shape[1], 8))
        return (self.proj(x) + self.pe[:, : x.shape[1]]).square().mean()


def test_a_rebound_buffer_is_warned_about_and_the_step_computes_with_it(caplog):
    torch.manual_seed(0)
    model, x = GrowingTable(), torch.randn(2, 6, 8)
    ref = copy.deepcopy(model)
    want = ref(x)
    want.backward()
    step, loss, got = _sgd_grads(model, x)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(got["proj.weight"], ref.proj.weight.grad)
    assert "rebinds buffer `pe` to shape (1, 6, 8) (was (1, 4, 8))" in caplog.text
