"""kiln.kernels.cross_entropy (op kiln::softmax_cross_entropy) against F.cross_entropy and float64 truth: loss and
logits gradient, fp32 and bf16, every reduction, ignored rows, edge values, layouts; the native loops against
the ATen composition; what it keeps for the backward; a model calling it trained by Kiln like eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
import kiln.kernels as K
from kiln.kernels import native
from tests.kernels import refs
from tests.kernels.test_native import _run, _used

REDUCTIONS = ["mean", "sum", "none"]


def _case(n=48, c=3000, dtype=torch.float32, seed=0, ignore=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g) * 4).to(dtype)
    y = torch.randint(0, c, (n,), generator=g)
    y[list(ignore)] = -100
    return x, y


def _loss_and_grad(fn, x, y, reduction):
    x = x.detach().clone().requires_grad_()
    loss = fn(x, y, reduction=reduction)
    g = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(loss.dtype) if loss.dim() else None
    (gx,) = torch.autograd.grad(loss, x, g)
    return loss.detach(), gx


def _truth(x, y, reduction):
    return _loss_and_grad(F.cross_entropy, x.double(), y, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "aten"])
def test_matches_float64_truth_no_worse_than_eager(reduction, dtype, native_on):
    """Loss and gradient no further from float64 than F.cross_entropy on the same rounded logits (plus one
    rounding of the dtype); a vocabulary larger than one block of the loops and not a multiple of it."""
    x, y = _case(c=5000, dtype=dtype)
    truth_loss, truth_grad = _truth(x, y, reduction)
    got_loss, got_grad = _run(lambda: _loss_and_grad(K.cross_entropy, x, y, reduction), native_on)
    want_loss, want_grad = _loss_and_grad(F.cross_entropy, x, y, reduction)
    assert got_loss.dtype == want_loss.dtype == dtype and got_loss.shape == want_loss.shape
    assert got_grad.dtype == dtype and got_grad.shape == x.shape
    eps = torch.finfo(dtype).eps
    for got, want, truth in ((got_loss, want_loss, truth_loss), (got_grad, want_grad, truth_grad)):
        scale = truth.abs().max().item()
        err = (got.double() - truth).abs().max().item() / scale
        eager = (want.double() - truth).abs().max().item() / scale
        assert err <= eager + 4 * eps, (err, eager)
    assert (got_grad[[3, 17]] == 0).all()                      # ignored rows: no gradient


def test_native_loops_run():
    if native.library() is None:
        pytest.skip("no C compiler: the ATen composition runs")
    x, y = _case()
    with pytest.MonkeyPatch.context() as mp:
        fwd, bwd = _used(mp, "kiln_ce_forward"), _used(mp, "kiln_ce_backward")
        _loss_and_grad(K.cross_entropy, x, y, "mean")
    assert len(fwd) == 1 and len(bwd) == 1


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "aten"])
def test_edge_values_as_pytorch(native_on):
    """-inf logits (masked classes) get exactly 0 gradient; a row with NaN, or +inf, gives NaN like eager; every
    row ignored gives a NaN mean and a zero gradient."""
    x, y = _case(n=6, c=40, ignore=())
    x[0, 5:] = float("-inf")
    y[0] = 2
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    got_loss, got_grad = _run(lambda: _loss_and_grad(K.cross_entropy, x, y, "none"), native_on)
    want_loss, want_grad = _loss_and_grad(F.cross_entropy, x, y, "none")
    torch.testing.assert_close(got_loss, want_loss, equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad, equal_nan=True)
    assert (got_grad[0, 5:] == 0).all()
    all_ignored = torch.full((6,), -100)
    loss, grad = _run(lambda: _loss_and_grad(K.cross_entropy, x[3:], all_ignored[3:], "mean"), native_on)
    assert torch.isnan(loss) and (grad == 0).all()


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "aten"])
def test_out_of_range_label_is_an_index_error(native_on):
    x, y = _case(n=4, c=10, ignore=())
    y[2] = 10
    with pytest.raises(IndexError, match="out of bounds"):
        _run(lambda: K.cross_entropy(x, y), native_on)


def test_layouts_and_other_inputs():
    """Rows with a stride (a slice of wider logits), a transposed matrix (not dense in the last dimension:
    the composition), and inputs the op does not take (class dimension 1, probabilities) as F.cross_entropy."""
    wide, y = _case(c=300)
    y = torch.where(y == -100, y, y % 257)
    for x in (wide[:, :257], wide[:, :257].t().contiguous().t()):
        got, gx = _loss_and_grad(K.cross_entropy, x, y, "mean")
        want, wx = _loss_and_grad(F.cross_entropy, x, y, "mean")
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, wx)
    x3, y3 = torch.randn(2, 5, 7), torch.randint(0, 5, (2, 7))
    torch.testing.assert_close(K.cross_entropy(x3, y3), F.cross_entropy(x3, y3))
    probs = torch.softmax(torch.randn(4, 5), -1)
    x2 = torch.randn(4, 5)
    torch.testing.assert_close(K.cross_entropy(x2, probs), F.cross_entropy(x2, probs))


def test_bad_arguments():
    x, y = _case(n=4, c=10, ignore=())
    with pytest.raises(ValueError, match="reduction"):
        torch.ops.kiln.softmax_cross_entropy(x, y, -100, "avg")
    with pytest.raises(ValueError, match="int64"):
        torch.ops.kiln.softmax_cross_entropy(x, y.int(), -100, "mean")


def test_keeps_one_number_per_row_not_the_log_softmax():
    x, y = _case(n=64, c=1000)
    x.requires_grad_()
    assert refs.saved_bytes(lambda x, y: K.cross_entropy(x, y), [x, y]) == 64 * 4            # the log-sum-exp
    assert refs.saved_bytes(lambda x, y: F.cross_entropy(x, y), [x, y]) >= 64 * 1000 * 4     # log_softmax


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        return K.cross_entropy(logits.view(-1, 50), labels.view(-1))


def test_a_model_calling_it_trains_with_kiln_like_eager():
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    ids, labels = torch.randint(0, 50, (4, 9)), torch.randint(0, 50, (4, 9))
    labels[0, :3] = -100
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        got = step(ids, labels)
        opt.zero_grad()
        want = F.cross_entropy(ref.head(torch.tanh(ref.emb(ids))).view(-1, 50), labels.view(-1))
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_cross_entropy_of_takes_the_kernel_only_for_a_plain_loss():
    """The run-time guard `kiln adopt` writes: a plain nn.CrossEntropyLoss (its ignore_index and reduction) or
    F.cross_entropy runs the kernel (it keeps one number per row); class weights, label smoothing, a subclass
    or a hook run the loss as written. Every case equals the loss itself."""
    x, y = _case(n=32, c=200, ignore=(1,))
    y[4] = 7
    x.requires_grad_()

    class Mine(nn.CrossEntropyLoss):
        pass

    hooked = nn.CrossEntropyLoss()
    hooked.register_forward_hook(lambda *a: None)
    sevens = torch.where(y == -100, 7, y)
    for loss, fused in ((nn.CrossEntropyLoss(), True), (nn.CrossEntropyLoss(ignore_index=7, reduction="sum"), True),
                        (F.cross_entropy, True), (nn.CrossEntropyLoss(weight=torch.rand(200)), False),
                        (nn.CrossEntropyLoss(label_smoothing=0.1), False), (Mine(), False), (hooked, False)):
        labels = sevens if getattr(loss, "ignore_index", -100) == 7 else y
        kept = refs.saved_bytes(lambda x, y: K.cross_entropy_of(loss, x, y), [x, labels])
        assert (kept == 32 * 4) == fused, (loss, kept)
        got, gx = _loss_and_grad(lambda a, b, reduction: K.cross_entropy_of(loss, a, b), x, labels, None)
        want, wx = _loss_and_grad(lambda a, b, reduction: loss(a, b), x, labels, None)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, wx)
