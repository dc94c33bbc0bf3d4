"""transformers code that takes another path when traced than in eager (kiln/capture/hf.py), against eager.

A Gemma whose attention is bidirectional (`use_bidirectional_attention`, as PaliGemma's) builds its mask with
`create_causal_mask`, which eager skips on an unpadded batch (the attention then sees no mask and attends
both ways) and a traced forward always builds (causal): Kiln trained the traced model, 24 % off eager's
gradients on PaliGemma. Capture now decides as eager does, on the batch's values, under a branch guard."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln

transformers = pytest.importorskip("transformers")


def _gemma():
    config = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=32, use_bidirectional_attention=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(config)


def _eager_grads(model, batch):
    ref = copy.deepcopy(model)
    loss = ref(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def test_a_bidirectional_gemma_trains_like_eager_with_and_without_padding():
    model = _gemma()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    padded_mask = torch.ones_like(ids)
    padded_mask[1, 8:] = 0
    padded = dict(input_ids=ids, attention_mask=padded_mask, labels=ids.masked_fill(padded_mask == 0, -100))
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))
    for batch in (plain, padded, plain):
        want_loss, want = _eager_grads(model, batch)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.testing.assert_close(step(**batch), want_loss, rtol=1e-5, atol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(before[n] - p.detach(), want[n], rtol=1e-4, atol=1e-6, msg=n)
    # eager's two paths: the unpadded batch attends both ways, the padded one causally; one variant each
    assert step.cache_info().compiles == 2
