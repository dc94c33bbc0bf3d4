"""kiln.kernels.ctc_loss against torch.nn.functional.ctc_loss (loss and gradient), and a model whose loss
calls F.ctc_loss with tensor lengths trained by Kiln against eager (export cannot capture ATen's
`_ctc_loss.Tensor`: its alignment table is shaped by tensor values)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.kernels import ctc_loss


def _batch(dtype=torch.float64, T=12, B=3, C=6, S=5):
    torch.manual_seed(0)
    logits = torch.randn(T, B, C, dtype=dtype)
    targets = torch.randint(1, C, (B, S))
    il = torch.tensor([T, T - 2, T - 5])
    tl = torch.tensor([S, 3, 1])
    return logits, targets, il, tl


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_matches_torch(reduction, zero_infinity):
    logits, targets, il, tl = _batch()
    il[2] = 2                       # too short for its target when zero_infinity: an infinite loss
    tl[2] = 3
    got_in = logits.clone().requires_grad_(True)
    want_in = logits.clone().requires_grad_(True)
    got = ctc_loss(got_in.log_softmax(-1), targets, il, tl, 0, reduction, zero_infinity)
    want = F.ctc_loss(want_in.log_softmax(-1), targets, il, tl, 0, reduction, zero_infinity)
    torch.testing.assert_close(got, want)
    cot = torch.rand_like(want)
    got.backward(cot)
    want.backward(cot)
    torch.testing.assert_close(got_in.grad, want_in.grad, equal_nan=True)   # inf loss: NaN, as in torch


def test_ctc_loss_unbatched_and_concatenated_targets():
    logits, targets, il, tl = _batch()
    x = logits[:, 0].clone().requires_grad_(True)
    y = logits[:, 0].clone().requires_grad_(True)
    a = ctc_loss(x.log_softmax(-1), targets[0], il[0], tl[0])
    b = F.ctc_loss(y.log_softmax(-1), targets[0], il[0], tl[0])
    torch.testing.assert_close(a, b)
    a.backward(), b.backward()
    torch.testing.assert_close(x.grad, y.grad)
    flat = torch.cat([targets[i, :tl[i]] for i in range(3)])
    x = logits.clone().requires_grad_(True)
    y = logits.clone().requires_grad_(True)
    a = ctc_loss(x.log_softmax(-1), flat, il, tl, reduction="sum")
    b = F.ctc_loss(y.log_softmax(-1), flat, il, tl, reduction="sum")
    a.backward(), b.backward()
    torch.testing.assert_close(x.grad, y.grad)


class Acoustic(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.head = nn.Linear(16, 6)

    def forward(self, x):                       # (B, T, 8) -> (T, B, C) log-probabilities
        return self.head(torch.tanh(self.proj(x))).log_softmax(-1).transpose(0, 1)


def ctc_objective(model, x, targets, input_lengths, target_lengths):
    return F.ctc_loss(model(x), targets, input_lengths, target_lengths, blank=0, zero_infinity=True)


def test_model_with_ctc_loss_trains_like_eager():
    torch.manual_seed(0)
    model = Acoustic()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 12, 8)
    targets, il, tl = torch.randint(1, 6, (3, 5)), torch.tensor([12, 10, 7]), torch.tensor([5, 3, 1])
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ctc_objective)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        got = step(x, targets, il, tl)
        opt.zero_grad()
        want = ctc_objective(ref, x, targets, il, tl)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _wav2vec2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)
    torch.manual_seed(0)
    x, labels = torch.randn(2, 1600), torch.randint(1, 20, (2, 5))
    labels[1, 3:] = -100
    return transformers.Wav2Vec2ForCTC(cfg).train(), x, labels


def hf_ctc_loss(model, input_values, labels):
    """The loss_fn Kiln's refusal suggests for a Hugging Face CTC head: padded targets, tensor lengths."""
    logits = model(input_values=input_values).logits
    log_probs = logits.log_softmax(-1).transpose(0, 1)
    input_lengths = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, labels.clamp_min(0), input_lengths, (labels >= 0).sum(-1),
                      blank=model.config.pad_token_id, reduction=model.config.ctc_loss_reduction,
                      zero_infinity=model.config.ctc_zero_infinity)


def test_hugging_face_ctc_head_is_refused_with_a_recipe_that_trains_exactly():
    model, x, labels = _wav2vec2()
    with pytest.raises(kiln.UnsupportedError) as e:        # the labels check is a branch guard now; the
        kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))(input_values=x, labels=labels)   # masked targets not
    msg = str(e.value)
    assert "Wav2Vec2ForCTC" in msg and "masked_select" in msg and "modeling_wav2vec2.py" in msg, msg
    assert "loss_fn=" in msg, msg
    ref = copy.deepcopy(model)
    kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=hf_ctc_loss)(x, labels)
    want = ref(input_values=x, labels=labels).loss           # the head's own loss, eagerly
    want.backward()
    scale = max(q.grad.abs().max() for q in ref.parameters() if q.grad is not None)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert ((p - (q - q.grad)).abs().max() <= 1e-5 * scale), n
