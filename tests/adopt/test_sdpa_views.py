"""sdpa where the mask is added through a view of 3-D scores (BART, CLIP and their copies in
transformers 4.x): `s = bmm(q, k^T)`, checked to be (b * h, t, k), `s = s.view(b, h, t, k) + m` and
viewed back, under the split of attention_split.py (head masks, probabilities returned under
`output_attentions`).  Reference: the original module on every path (outputs, returned
probabilities, gradients of the input and of every parameter)."""
import itertools

import pytest
import torch

from tests.adopt.helpers import load, rewrite

BART_STYLE = '''\
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, embed_dim=16, num_heads=2):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout = 0.0
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None, layer_head_mask=None,
                output_attentions=False):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
{check}
        if causal_attention_mask is not None:
            if causal_attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"mask of size {causal_attention_mask.size()}")
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"mask of size {attention_mask.size()}")
            attn_weights = attn_weights.view({view}) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)

        if layer_head_mask is not None:
            if layer_head_mask.size() != (self.num_heads,):
                raise ValueError(f"head mask of size {layer_head_mask.size()}")
            attn_weights = layer_head_mask.view(1, -1, 1, 1) * attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if output_attentions:
            attn_weights_reshaped = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights_reshaped.view(bsz * self.num_heads, tgt_len, src_len)
        else:
            attn_weights_reshaped = None

        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return attn_output.reshape(bsz, tgt_len, self.embed_dim), attn_weights_reshaped
'''
CHECK = '''        if attn_weights.size() != (bsz * self.num_heads, tgt_len, src_len):
            raise ValueError(f"weights of size {attn_weights.size()}")
'''
VIEW = "bsz, self.num_heads, tgt_len, src_len"


def source(check=CHECK, view=VIEW):
    return BART_STYLE.replace("{check}", check).replace("{view}", view)


def test_the_mask_added_through_a_view_is_rewritten():
    src, new, matches = rewrite(source(), rules=["sdpa"])
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    explicit, fast = new.split("        else:\n            if causal_attention_mask is not None:")
    assert "if layer_head_mask is not None or output_attentions:  # kiln adopt" in explicit
    # the fast path: q, k and v split like the scores were, both optional masks, the checks of the
    # masks kept (the check of the scores goes with the scores), the constant of the `else` taken
    assert ("scaled_dot_product_attention(query_states.unflatten(0, (bsz, self.num_heads)), "
            "key_states.unflatten(0, (bsz, self.num_heads)), value_states.unflatten(0, (bsz, self.num_heads)), "
            "attn_mask=causal_attention_mask if attention_mask is None else attention_mask if causal_attention_mask "
            "is None else causal_attention_mask + attention_mask") in fast
    assert ").flatten(0, 1)\n" in fast and "scale=1.0" in fast
    assert fast.count("raise ValueError") == 2 and "weights of size" not in fast
    assert "            attn_weights_reshaped = None\n" in fast


@pytest.mark.parametrize("mask, causal, head_mask, output_attentions",
                         list(itertools.product([False, True], [False, True], [False, True], [False, True])))
def test_every_path_computes_the_original(mask, causal, head_mask, output_attentions):
    src, new, _ = rewrite(source(), rules=["sdpa"])
    torch.manual_seed(0)
    ref, rew = load(src, "o")["Attention"](), load(new, "n")["Attention"]()
    rew.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    kwargs = {"attention_mask": torch.randn(2, 1, 5, 5) if mask else None,
              "causal_attention_mask": torch.randn(2, 1, 5, 5) if causal else None,
              "layer_head_mask": torch.rand(2) if head_mask else None, "output_attentions": output_attentions}
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ya, pa), (yb, pb) = ref(xa, **kwargs), rew(xb, **kwargs)
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    assert (pa is None) == (pb is None) and (pa is None or torch.allclose(pa, pb, atol=1e-6))
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(ref.named_parameters(), rew.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_a_wrong_mask_still_fails_on_the_fast_path():
    src, new, _ = rewrite(source(), rules=["sdpa"])
    rew = load(new, "n")["Attention"]()
    with pytest.raises(ValueError, match="mask of size"):
        rew(torch.randn(2, 5, 16), attention_mask=torch.zeros(2, 1, 1, 5))


@pytest.mark.parametrize("check, view, reason", [
    # nothing shows that the scores have the sizes the view back names
    ("", VIEW, "and no check before it shows that they have the sizes of"),
    # a view that does not only split the first dimension (t and k swapped)
    (CHECK, "bsz, self.num_heads, src_len, tgt_len", "in a way other than splitting their first dimension"),
])
def test_views_that_are_not_shown_to_split_dim_0_are_refused(check, view, reason):
    src, new, matches = rewrite(source(check, view), rules=["sdpa"])
    assert new == src and [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    assert reason in matches[0].reason, matches[0].reason
