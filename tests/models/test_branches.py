"""Python branches on tensor values (kiln/capture/branches.py): decided by the batch that compiled the
program, checked on every batch by a guard, a variant compiled for a batch that decides otherwise.
Every step is compared with eager PyTorch (torch.optim.SGD on a copy)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


class Branchy(nn.Module):
    """A label check that raises (Hugging Face CTC heads), a branch on a mask (Longformer's
    `if is_global_attn:`) and a Python assert on values (ProphetNet)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, x, labels, mask):
        if labels.max() >= 8:
            raise ValueError("labels must be below 8")
        assert torch.all(labels >= 0).item(), "labels must be non-negative"
        y = self.a(x)
        if (mask > 0).any():
            y = y + self.b(x * mask[:, None])
        return F.cross_entropy(y, labels)


def _batches():
    gen = torch.Generator().manual_seed(0)
    x, labels = torch.randn(6, 4, generator=gen), torch.randint(0, 8, (6,), generator=gen)
    some, none = torch.tensor([0, 1, 0, 0, 1, 0.0]), torch.zeros(6)
    return [(x, labels, m) for m in (some, none, some, none, none, some)]


def _compiled(model):
    return kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, *a: m(*a))


def test_each_batch_takes_its_own_branch_like_eager(kiln_log):
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = _compiled(model)
    for batch in _batches():
        got = step(*batch)
        opt.zero_grad()
        want = ref(*batch)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert len(step.programs) == 2, "one variant per way the branch goes, compiled once each"
    assert "another branch" in kiln_log.text and "if (mask > 0).any():" in kiln_log.text
    guards = [n for n in step.graph.nodes if n.op.name == "kiln.branch_guard"]
    assert guards and all("test_branches.py" in n.args[2] for n in guards)
    text = kiln.explain(step)
    assert "value-dependent branches" in text and "if (mask > 0).any():" in text


def test_a_batch_the_model_rejects_raises_its_error_and_changes_nothing():
    torch.manual_seed(0)
    model = Branchy()
    step = _compiled(model)
    x, labels, mask = _batches()[0]
    step(x, labels, mask)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(kiln.KilnError, match="labels must be below 8"):
        step(x, torch.full_like(labels, 9), mask)
    with pytest.raises(kiln.KilnError, match="labels must be non-negative"):
        step(x, torch.full_like(labels, -1), mask)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    step(x, labels, mask)                               # and training goes on


def test_shapes_that_depend_on_values_stay_refused():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, keep):
            return self.lin(x[keep]).sum()

    step = kiln.compile(Masked(), optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, *a: m(*a))
    with pytest.raises(kiln.KilnError, match=r"shape depends on tensor values.*x\[keep\]"):
        step(torch.randn(5, 4), torch.tensor([True, False, True, True, False]))


class EosCheck(nn.Module):
    """BART's sequence-classification check: a value-dependent *shape* (`unique_consecutive`) computed only
    to decide a branch is recomputed by the guard; the training step never holds it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, eos):
        if len(torch.unique_consecutive(eos.sum(1))) > 1:
            raise ValueError("All examples must have the same number of <eos> tokens.")
        return self.lin(x).square().mean()


def test_a_value_dependent_shape_used_only_by_a_decision_is_checked_not_refused():
    torch.manual_seed(0)
    model = EosCheck()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    same = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]])
    step = _compiled(model)
    got = step(x, same)
    want = ref(x, same)
    want.backward()
    torch.testing.assert_close(got, want.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - 0.1 * q.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(kiln.KilnError, match="same number of <eos> tokens"):
        step(x, torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]]))


class LayerDrop(nn.Module):
    """A layer skipped when a random draw says so (LayerDrop, as in wav2vec2 and SeamlessM4T), then dropout:
    when the draw takes the other branch, the variant for it must see the same random numbers as eager."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.3)

    def forward(self, x):
        h = self.a(x)
        if not (self.training and torch.rand([]) < 0.5):
            h = h + self.b(h)
        return self.drop(h).square().mean()


def test_a_branch_on_a_random_draw_trains_like_eager_across_variants():
    torch.manual_seed(0)
    model, x = LayerDrop(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1))
    for i in range(8):                       # seeds 100.. take both branches within the first 4 steps
        torch.manual_seed(100 + i)
        got = step(x)
        torch.manual_seed(100 + i)
        opt.zero_grad()
        want = ref(x)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0, msg=f"step {i}")
    assert step.cache_info().compiles == 2
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n], p, rtol=1e-5, atol=1e-7)
