"""sdpa with the explicit attention kept where it is needed: `if <test>: <as written> else: <sdpa>`
(attention_split.py). Reference: the original module, on the paths that take the explicit branch and
on those that take scaled_dot_product_attention (outputs, returned probabilities and gradients)."""
import pytest
import torch

from tests.adopt.helpers import load, rewrite

BERT_STYLE = '''\
import math
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=16, heads=2, relative=False):
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, d // heads
        self.all_head_size = d
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.dropout = nn.Dropout(0.0)
        self.distance_embedding = nn.Embedding(64, self.attention_head_size)
        self.position_embedding_type = "relative_key" if relative else "absolute"

    def transpose_for_scores(self, x):
        x = x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        # raw attention scores
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        if self.position_embedding_type == "relative_key":
            seq_length = hidden_states.size()[1]
            distance = torch.arange(seq_length).view(-1, 1) - torch.arange(seq_length).view(1, -1)
            positional_embedding = self.distance_embedding(distance + 31)
            attention_scores = attention_scores + torch.einsum("bhld,lrd->bhlr", query_layer, positional_embedding)
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        if head_mask is not None:
            attention_probs = attention_probs * head_mask
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        {tail}
'''
TAIL = "return (context_layer, attention_probs) if output_attentions else (context_layer,)"


def test_explicit_path_kept_under_its_tests():
    src, new, matches = rewrite(BERT_STYLE.replace("{tail}", TAIL), rules=["sdpa"])
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    assert ('        if self.position_embedding_type == "relative_key" or head_mask is not None or output_attentions:'
            '  # kiln adopt: the attention as written, where it is still needed\n' in new)
    assert "            attention_probs = None\n" in new
    assert "        # raw attention scores\n        if self.position" in new      # the comment stays above the `if`


@pytest.mark.parametrize("relative, mask, head_mask, output_attentions", [
    (False, None, None, False),            # scaled_dot_product_attention
    (False, "mask", None, False),
    (True, "mask", None, False),           # explicit: relative-position scores
    (False, "mask", "head", False),        # explicit: head mask
    (False, "mask", None, True),           # explicit: probabilities returned
])
def test_both_branches_compute_the_original(relative, mask, head_mask, output_attentions):
    src, new, _ = rewrite(BERT_STYLE.replace("{tail}", TAIL), rules=["sdpa"])
    torch.manual_seed(0)
    ref = load(src, "o")["SelfAttention"](relative=relative)
    rew = load(new, "n")["SelfAttention"](relative=relative)
    rew.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    kwargs = {"attention_mask": torch.randn(2, 1, 1, 5) if mask else None,
              "head_mask": torch.rand(1, 2, 1, 1) if head_mask else None, "output_attentions": output_attentions}
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, **kwargs), rew(xb, **kwargs)
    assert len(ya) == len(yb)
    for a, b in zip(ya, yb):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    ya[0].sum().backward()
    yb[0].sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    for (name, pa), pb in zip(ref.named_parameters(), rew.parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("tail, reason", [
    # the probabilities leave on every call (GPT-2's `_attn`): nothing can drop them
    ("return context_layer, attention_probs", "the attention probabilities are returned on every call"),
    # packed into the outputs without a test
    ("outputs = (context_layer, attention_probs)\n        return outputs",
     "the attention probabilities are returned on every call"),
])
def test_no_split_without_a_test_that_covers_every_use(tail, reason):
    src, new, matches = rewrite(BERT_STYLE.replace("{tail}", tail), rules=["sdpa"])
    assert new == src and [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    assert reason in matches[0].reason, matches[0].reason
