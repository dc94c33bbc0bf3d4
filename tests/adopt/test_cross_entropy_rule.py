"""The cross_entropy rule: every spelling of a cross-entropy call is rewritten to kiln.kernels.cross_entropy_of /
cross_entropy (checked at run time), the rewritten model computes the original's loss and gradients, the
language-model head is still reported by linear_cross_entropy, and what the kernel does not take is kept."""
from __future__ import annotations

import torch

from tests.adopt.helpers import load, rewrite

SRC = '''\
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss, MSELoss


class LM(nn.Module):
    def __init__(self, vocab=50, d=16, smoothing=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab)
        self.cls = nn.Linear(d, 3)
        self.head_loss = nn.CrossEntropyLoss(reduction="sum", label_smoothing=smoothing)

    def forward(self, ids, labels, classes):
        h = torch.tanh(self.emb(ids))
        logits = self.lm_head(h)
        shift_logits = logits[..., :-1, :].contiguous()
        loss_fct = CrossEntropyLoss()
        lm = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), labels[..., 1:].reshape(-1))
        again = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
        scores = self.cls(h[:, 0])
        cls = F.cross_entropy(scores, classes, reduction="sum", ignore_index=2)
        inline = CrossEntropyLoss(reduction="none")(scores, classes)
        attr = self.head_loss(logits.view(-1, logits.size(-1)), labels.view(-1))
        if classes.sum() > 100:
            other = MSELoss()
            lm = other(scores, scores.detach())
        return lm + again + cls + inline.mean() + attr, logits
'''


def _rewritten(rules=None):
    src, new, matches = rewrite(SRC, rules=rules)
    return src, new, [(m.rule, m.first_line, m.applied) for m in matches if "cross_entropy" in m.rule]


def test_every_spelling_is_rewritten_and_the_head_reported():
    _, new, got = _rewritten()
    assert "kiln_kernels.cross_entropy_of(loss_fct, shift_logits.view(-1, shift_logits.size(-1)), " in new
    assert "kiln_kernels.cross_entropy_of(loss_fct, logits.view(-1, logits.size(-1)), labels.view(-1))" in new
    assert 'kiln_kernels.cross_entropy(scores, classes, ignore_index=2, reduction="sum")' in new
    assert 'kiln_kernels.cross_entropy_of(CrossEntropyLoss(reduction="none"), scores, classes)' in new
    assert "kiln_kernels.cross_entropy_of(self.head_loss, logits.view" in new
    assert "other(scores, scores.detach())" in new                       # an MSELoss is not one
    assert sum(applied for rule, _, applied in got if rule == "cross_entropy") == 5
    assert ("linear_cross_entropy", 20, False) in got                 # the LM head: reported beside the rewrite


def _train(src, name, smoothing):
    torch.manual_seed(0)
    model = load(src, name)["LM"](smoothing=smoothing)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 50, (3, 7), generator=g), torch.randint(1, 50, (3, 7), generator=g)
    labels[0, :2] = -100
    classes = torch.tensor([2, 1, 0])
    loss, _ = model(ids, labels, classes)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_the_rewritten_model_computes_the_same_loss_and_gradients():
    """fp32, against the original eager code; with label smoothing the attribute's loss runs as written."""
    src, new, _ = _rewritten()
    for smoothing in (0.0, 0.1):
        want, want_grads = _train(src, "original", smoothing)
        got, got_grads = _train(new, "rewritten", smoothing)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_what_the_kernel_does_not_take_is_kept_with_its_reason():
    src = SRC.replace('F.cross_entropy(scores, classes, reduction="sum", ignore_index=2)',
                      'F.cross_entropy(scores, classes, weight=torch.ones(3))').replace(
        "lm = loss_fct(shift_logits", "lm = loss_fct(input=shift_logits").replace(
        "labels[..., 1:].reshape(-1))", "target=labels[..., 1:].reshape(-1))")
    _, new, matches = rewrite(src, rules=["cross_entropy"])
    refused = {m.first_line: m.reason for m in matches if not m.applied}
    assert "F.cross_entropy(scores, classes, weight=torch.ones(3))" in new
    assert any("weight is kept" in r for r in refused.values()), refused
    assert any("other than (logits, labels)" in r for r in refused.values()), refused


def test_the_rewrite_does_not_depend_on_the_order_rules_are_given_in():
    """The report-only linear_cross_entropy, given first, still leaves the node to the rule that rewrites it."""
    for rules in (["linear_cross_entropy", "cross_entropy"], ["cross_entropy", "linear_cross_entropy"]):
        _, new, got = _rewritten(rules)
        assert new == _rewritten()[1], rules
        assert sum(applied for rule, _, applied in got if rule == "cross_entropy") == 5, rules
