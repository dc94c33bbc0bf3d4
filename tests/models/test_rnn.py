"""Recurrent language models (embedding -> LSTM / GRU / RNN -> linear -> cross-entropy) against eager:
one SGD(lr=1) step (the parameter delta is the gradient), then 3 kiln.optim.AdamW steps against
torch.optim.AdamW. Kiln differentiates the unrolled recurrence itself (kiln/capture/decomps.py): no
autograd fallback."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.capture import decomps
from kiln.errors import UnsupportedError
from tests.models.reference import check_training

VOCAB, EMB, HIDDEN, BATCH, SEQ = 13, 6, 5, 3, 4


class RecurrentLM(nn.Module):
    def __init__(self, kind="LSTM", batch_first=True, initial_state=False, **kw):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.rnn = getattr(nn, kind)(EMB, HIDDEN, batch_first=batch_first, **kw)
        dirs = 2 if kw.get("bidirectional") else 1
        out = kw.get("proj_size") or HIDDEN
        self.head = nn.Linear(out * dirs, VOCAB)
        self.kind, self.batch_first, self.initial_state = kind, batch_first, initial_state
        layers = kw.get("num_layers", 1) * dirs
        if initial_state:       # learned initial states: their gradients are checked too
            self.h0 = nn.Parameter(0.5 * torch.randn(layers, BATCH, out))
            if kind == "LSTM":
                self.c0 = nn.Parameter(0.5 * torch.randn(layers, BATCH, HIDDEN))

    def forward(self, ids, labels):
        x = self.emb(ids if self.batch_first else ids.t())
        if self.initial_state:
            out, last = self.rnn(x, (self.h0, self.c0) if self.kind == "LSTM" else self.h0)
        else:
            out, last = self.rnn(x)
        if not self.batch_first:
            out = out.transpose(0, 1)
        h = last[0] if self.kind == "LSTM" else last
        logits = self.head(out)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + h.pow(2).mean()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def train_like_eager(model):
    return check_training(lambda: model, *batch())


CASES = {
    "lstm": dict(kind="LSTM"),
    "lstm-seq-first": dict(kind="LSTM", batch_first=False),
    "lstm-2-layers": dict(kind="LSTM", num_layers=2),
    "lstm-bidirectional-2-layers": dict(kind="LSTM", num_layers=2, bidirectional=True),
    "lstm-initial-state": dict(kind="LSTM", initial_state=True, num_layers=2, batch_first=False),
    "lstm-bidirectional-initial-state": dict(kind="LSTM", initial_state=True, bidirectional=True),
    "lstm-no-bias": dict(kind="LSTM", bias=False),
    "lstm-projections": dict(kind="LSTM", proj_size=3, num_layers=2, bidirectional=True),
    "gru": dict(kind="GRU"),
    "gru-2-layers-bidirectional": dict(kind="GRU", num_layers=2, bidirectional=True, batch_first=False),
    "gru-initial-state": dict(kind="GRU", initial_state=True),
    "rnn-tanh-2-layers": dict(kind="RNN", num_layers=2),
    "rnn-relu-bidirectional": dict(kind="RNN", nonlinearity="relu", bidirectional=True, initial_state=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_recurrent_language_model_trains_like_eager(name):
    torch.manual_seed(0)
    train_like_eager(RecurrentLM(**CASES[name]))


def test_dropout_between_layers_draws_like_eager():
    """Dropout between stacked layers: the same draws as eager's LSTM, given the same seed."""
    torch.manual_seed(0)
    model = RecurrentLM("LSTM", num_layers=2, dropout=0.5)
    args = batch()
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    opt = kiln.optim.SGD(lr=0.0)
    step = kiln.compile(mine, optimizer=opt)
    step(*args)                  # compiles (which may draw random numbers: kernel timing) and changes nothing
    before = {n: p.detach().clone() for n, p in mine.named_parameters()}
    opt.lr = 1.0
    torch.manual_seed(5)
    got = step(*args)
    torch.manual_seed(5)
    want = ref(*args)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(before[n] - dict(mine.named_parameters())[n].detach(), q.grad,
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"gradient of {n}: {m}")
    assert not [n for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"]
    assert [n.op.name for n in step.graph.nodes].count("aten.native_dropout") == 1


class PackedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, EMB), nn.LSTM(EMB, HIDDEN, batch_first=True), \
            nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=SEQ)
        return self.head(out).pow(2).mean()


def test_packed_sequences_are_refused_with_what_to_do():
    step = kiln.compile(PackedLM(), optimizer=kiln.optim.SGD(lr=1.0))
    with decomps.refuse_packed_sequences(), pytest.raises(UnsupportedError, match="(?i)packed sequences .* pass the padded batch"):
        step(batch()[0], torch.tensor([4, 2, 3]))
