"""Models as users write them, trained by Kiln and by PyTorch eager side by side.

Each model is checked twice against eager PyTorch: one SGD(lr=1) step, whose parameter deltas are the
gradients (compared with eager's .grad), and 3 kiln.optim.AdamW steps against torch.optim.AdamW.
Buffers, losses and untouched frozen parameters are compared too.

Entries whose true gradient is zero (a key projection's bias, a bias just before BatchNorm: both are
shifts the next op removes) get rounding noise as gradient, which Adam scales up to lr-sized steps; any
other summation order gives other noise. Those entries are compared to within lr * steps after AdamW;
their SGD gradients, and every other entry, as tightly as ever.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.reference import check_training

def _tokens(batch=2, seq=6, vocab=50, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---- nn.TransformerEncoder ---------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self, is_causal, vocab=50, d=32):
        super().__init__()
        self.is_causal = is_causal
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, pad, labels):
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.enc(self.emb(ids), mask=causal, src_key_padding_mask=pad, is_causal=self.is_causal)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask")
@pytest.mark.parametrize("is_causal", [True, None], ids=["is_causal", "causal-mask-detected"])
def test_transformer_encoder_with_padding_and_causal_masks(is_causal):
    """is_causal=None (the default) makes PyTorch compare the mask with a causal one, on its values."""
    ids = _tokens()
    pad = torch.zeros(ids.shape, dtype=torch.bool)
    pad[1, -2:] = True                                   # the second sequence is two tokens shorter
    check_training(lambda: Encoder(is_causal), ids, pad, _tokens(seed=2))


# ---- in-place ops in forward -------------------------------------------------------------------
class InPlace(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        h = self.a(x)
        h.add_(1.0)
        h.masked_fill_(mask, 0.0)
        h.mul_(2.0)
        h.relu_()                    # last: relu's backward reads its output
        y = self.b(h)
        y.add_(x)
        return y.pow(2).mean()


def test_in_place_ops_on_intermediates():
    x = torch.randn(4, 8)
    check_training(InPlace, x, x[:, :1] > 0.3)


# ---- buffers updated in forward -------------------------------------------------------------
class RunningMean(nn.Module):
    def __init__(self, form: str, d=8):
        super().__init__()
        self.form = form
        self.lin = nn.Linear(d, d)
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.lin(x)
        if self.form == "no_grad":
            with torch.no_grad():
                self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        else:
            self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        self.calls.add_(1)
        return ((h - self.mean) ** 2).mean()


@pytest.mark.parametrize("form", ["detach", "no_grad"])
def test_running_mean_buffer_updated_in_forward(form):
    check_training(lambda: RunningMean(form), torch.randn(5, 8))


class BatchNormNet(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        # no bias before the BatchNorm: its true gradient is 0, Adam steps on the rounding noise, and the
        # running mean tracks that bias (the noise differs between CPUs' kernels, not between Kiln and eager)
        self.lin, self.bn, self.out = nn.Linear(d, d, bias=False), nn.BatchNorm1d(d), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.lin(x)))).pow(2).mean()


def test_batchnorm_running_stats():
    check_training(BatchNormNet, torch.randn(6, 8))


class TransposedBatchNorm(nn.Module):
    """BatchNorm1d over channels of a (B, T, C) sequence: normalized as (B, C, T), then back."""

    def __init__(self, c=8):
        super().__init__()
        # no bias before the BatchNorm: its gradient would be 0 (noise), and the running mean tracks it
        self.inp, self.bn, self.out = nn.Linear(c, c, bias=False), nn.BatchNorm1d(c), nn.Linear(c, c)

    def forward(self, x):
        h = self.bn(self.inp(x).transpose(1, 2)).transpose(1, 2)
        return self.out(h).pow(2).mean()


def test_batchnorm_over_transposed_views_then_linear():
    check_training(TransposedBatchNorm, torch.randn(3, 5, 8))


# ---- frozen and shared parameters ---------------------------------------------------------------
class FrozenShared(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.shared = nn.Parameter(torch.randn(d) * 0.1)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.bias = self.a.bias                            # one parameter in two modules
        self.scale = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.a(self.frozen(x)) + self.shared)
        return (self.b(h) * self.scale + self.shared).pow(2).mean()


def test_frozen_parameters_and_a_parameter_shared_by_two_modules():
    check_training(FrozenShared, torch.randn(4, 8))


# ---- tied weights in every form ---------------------------------------------------------------
class Tied(nn.Module):
    """An embedding table that is also the output projection, written five ways."""

    def __init__(self, form: str, vocab=40, d=16):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if form == "module":
            self.lm_head.weight = self.emb.weight
        self.w = nn.Parameter(torch.randn(vocab, d) * 0.3)      # (vocab, d), used as a plain Parameter
        self.wt = nn.Parameter(torch.randn(d, vocab) * 0.3)     # stored transposed: (d, vocab)

    def forward(self, ids, labels):
        if self.form == "F.linear_t":
            x = F.embedding(ids, self.wt.t())
        elif self.form == "param_T":
            x = F.embedding(ids, self.w)
        else:
            x = self.emb(ids)
        h = torch.tanh(self.mid(x))
        if self.form == "module":
            logits = self.lm_head(h)
        elif self.form == "matmul_T":
            logits = h @ self.emb.weight.T
        elif self.form == "F.linear":
            logits = F.linear(h, self.emb.weight)
        elif self.form == "F.linear_t":
            logits = F.linear(h, self.wt.t())
        else:
            logits = h @ self.w.T
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("form", ["module", "matmul_T", "F.linear", "F.linear_t", "param_T"])
def test_tied_weights(form):
    check_training(lambda: Tied(form), _tokens(vocab=40), _tokens(vocab=40, seed=3))


class LinearOfTransposed(nn.Module):
    """F.linear(x, W.t()) with W stored (in, out), and x @ W with W (in, out)."""

    def __init__(self, d_in=8, d_out=6):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.v = nn.Parameter(torch.randn(d_out, d_in) * 0.3)

    def forward(self, x):
        return (F.linear(x, self.w.t()) + x @ self.v.T).pow(2).mean()


def test_linear_of_a_transposed_parameter():
    check_training(LinearOfTransposed, torch.randn(5, 8))


# ---- Python values as inputs --------------------------------------------------------------------
class Structured(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin, self.gate = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, batch: dict, extra: list, n_loops: int, scale: float, use_gate: bool, bias=None):
        h = batch["x"]
        for _ in range(n_loops):
            h = torch.tanh(self.lin(h)) * scale
        if use_gate:
            h = h * torch.sigmoid(self.gate(extra[0]))
        if bias is not None:
            h = h + bias
        return F.mse_loss(h, batch["target"]) + extra[1].mean() * 0.0


def test_dict_list_int_float_bool_none_inputs():
    x, t, e = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
    check_training(Structured, {"x": x, "target": t}, [e, torch.ones(2)], 2, 0.5, True, None)


# ---- a module called twice, a loss_fn --------------------------------------------------------------
class Twice(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.block, self.out = nn.Sequential(nn.Linear(d, d), nn.GELU()), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.block(self.block(x) + x))


def test_module_called_twice_with_a_loss_fn():
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    check_training(Twice, x, y, loss_fn=lambda model, x, y: F.smooth_l1_loss(model(x), y))


# ---- recurrent ----------------------------------------------------------------------------------
class LSTMTagger(nn.Module):
    def __init__(self, vocab=30, d=8):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(vocab, d), nn.LSTM(d, d, batch_first=True), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h, _ = self.rnn(self.emb(ids))
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())


def test_lstm():
    check_training(LSTMTagger, _tokens(vocab=30), _tokens(vocab=30, seed=4))


# ---- a custom autograd Function ------------------------------------------------------------------
class _ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s: float):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.s = s
        return y * s

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * ctx.s * (1 - y * y), None


class WithFunction(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):
        return self.b(_ScaledTanh.apply(self.a(x), 1.5)).pow(2).mean()


def test_custom_autograd_function():
    check_training(WithFunction, torch.randn(4, 8), fallbacks=True)


# ---- attention written out by hand ---------------------------------------------------------------
class HandAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        h = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.o(h).pow(2).mean()


def test_hand_written_causal_attention():
    check_training(HandAttention, torch.randn(2, 5, 16))
