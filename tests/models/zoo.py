"""Tiny models for parity tests: each builder returns (model, batch kwargs or args, loss_fn)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 96, 12, 2


def _ids(batch=BATCH, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq))


def mlp():
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
    x, y = torch.randn(16, 10), torch.randint(0, 5, (16,))
    return model, (x, y), {}, lambda m, x, y: F.cross_entropy(m(x), y)


class SmallCNN(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        # convolutions feeding a training-mode BatchNorm carry no bias: its gradient is zero up to
        # rounding, and Adam's normalization turns that rounding noise into full-size updates
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(self.drop(torch.flatten(x, 1)))


def cnn():
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    return SmallCNN(), (x, y), {}, lambda m, x, y: F.cross_entropy(m(x), y)


def _hf(cls_name, config_name, **cfg):
    import transformers
    config = getattr(transformers, config_name)(**cfg)
    config._attn_implementation = "sdpa"
    return getattr(transformers, cls_name)(config)


DROP0 = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert():
    model = _hf("BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, max_position_embeddings=32, **DROP0)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.clone()
    labels[:, ::2] = -100
    return model, (), dict(input_ids=ids, attention_mask=mask, labels=labels), None


def gpt2():
    model = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return model, (), dict(input_ids=ids, labels=ids), None


def llama():
    model = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = _ids()
    return model, (), dict(input_ids=ids, labels=ids), None


def t5():
    model = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ids = _ids()
    return model, (), dict(input_ids=ids, labels=_ids(seq=SEQ // 2)), None


def vit():
    model = _hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4, hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=10, **DROP0)
    return model, (), dict(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.randint(0, 10, (2,))), None


MODELS = {"mlp": mlp, "cnn": cnn, "bert": bert, "gpt2": gpt2, "llama": llama, "t5": t5, "vit": vit}
