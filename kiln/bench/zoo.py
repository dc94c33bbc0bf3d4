"""The benchmark model zoo: architectures built from configs with random weights.

Nothing is downloaded: every model is constructed from a config and seeded
random initialisation, so a benchmark needs no network and no checkpoint.

``get(name, size="default", **overrides)`` returns a :class:`ZooEntry` with

* ``build_model()``  - a fresh fp32 model, seeded (same weights on every call),
* ``build_batch(i)`` - the i-th batch, a dict of kwargs with labels so that
  ``model(**batch).loss`` is the training loss (seeded, so every mode trains on
  the same data),
* ``items_per_batch`` / ``unit`` - tokens per batch (samples for vision models),
* ``flops_per_step`` - analytic FLOPs of one training step (see ``kiln.bench.flops``).

Sizes: ``default`` is CPU-sized (4 layers, hidden 512, 8 heads, vocab 8192,
batch 8, seq 256; Llama's MLP is 1408 wide), ``tiny`` is for tests.  Overrides:
layers, hidden, heads, intermediate, seq, batch, vocab.  For the vision models
``seq`` is the image side in pixels and ``vocab`` the number of classes.
Dropout is disabled and ``use_cache=False`` so runs are deterministic and the
graph holds only training work.

FLOPs per training step are 3 x forward (see ``kiln.bench.flops`` for the
convention).  With B batch, s sequence, T = B*s tokens, L layers, h hidden,
i MLP width, V vocabulary (classes), the forward counts are:

* llama:  L*(8*T*h^2 + 4*B*s^2*h + 6*T*h*i) + 2*T*h*V   (Q,K,V,O; attention; gated MLP; head)
* gpt2:   L*(8*T*h^2 + 4*B*s^2*h + 4*T*h*i) + 2*T*h*V
* bert:   as gpt2, plus 2*T*h^2 for the MLM head's transform
* t5:     L*(E + D) + 2*T*h*V, E = 8*T*h^2 + 4*B*s^2*h + 4*T*h*i (encoder layer),
          D = E + 8*T*h^2 + 4*B*s^2*h (plus cross-attention); source and target both s long
* vit:    patch embedding 2*B*n*(3*p^2)*h for n patches of side p, then the gpt2
          formula over s = n+1 tokens, and 2*B*h*V for the [CLS] classifier
* resnet: sum over convolutions of 2*B*Ho*Wo*Cout*Cin*k^2, plus 2*B*w*V for the head
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kiln.bench import cnn, flops

SIZES: dict[str, dict[str, int]] = {
    "default": dict(layers=4, hidden=512, heads=8, vocab=8192, batch=8, seq=256),
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=256, batch=2, seq=32),
}

# Per-model departures from the size preset.  The "-32k"/"-50k" variants keep a
# real tokenizer's vocabulary at every size: their point is to show what the
# logits and cross-entropy cost in time and memory.
MODEL_DEFAULTS: dict[str, dict[str, dict[str, int]]] = {
    "llama-32k": {"default": dict(vocab=32000), "tiny": dict(vocab=32000)},
    "gpt2-50k": {"default": dict(vocab=50257), "tiny": dict(vocab=50257)},
    "vit": {"default": dict(seq=224, vocab=1000), "tiny": dict(seq=32, vocab=10)},
    "resnet": {"default": dict(seq=128, vocab=1000), "tiny": dict(seq=32, vocab=10)},
}


@dataclass
class ZooEntry:
    name: str
    params: dict[str, int]
    build_model: Callable[[], torch.nn.Module]
    build_batch: Callable[[int], dict[str, torch.Tensor]]
    items_per_batch: int
    unit: str
    flops_per_step: int
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _llama_intermediate(hidden: int) -> int:
    # Llama's rule: about 8/3 of hidden, rounded up to a multiple of 64 (512 -> 1408).
    return 64 * math.ceil(hidden * 8 / 3 / 64)


def _seeded(seed: int, make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        model = make()
        model.train()
        return model
    return build


def _gen(seed: int, index: int) -> torch.Generator:
    # One generator per batch index: batch i is the same whatever else was drawn.
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def _lm_batch(p: dict, seed: int) -> Callable[[int], dict]:
    def batch(i: int) -> dict:
        ids = torch.randint(p["vocab"], (p["batch"], p["seq"]), generator=_gen(seed, i))
        # HF causal LMs shift labels internally, so labels == input_ids.
        return {"input_ids": ids, "labels": ids.clone()}
    return batch


def _llama(p: dict, seed: int) -> ZooEntry:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                      num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                      num_key_value_heads=p["heads"], max_position_embeddings=max(p["seq"], 128),
                      attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    tokens = p["batch"] * p["seq"]
    fwd = p["layers"] * flops.transformer_layer(tokens, p["batch"], p["seq"], p["hidden"], p["heads"],
                                                p["intermediate"], mlp_matrices=3)
    fwd += flops.linear(tokens, p["hidden"], p["vocab"])  # LM head
    return ZooEntry("", p, _seeded(seed, lambda: LlamaForCausalLM(cfg)), _lm_batch(p, seed),
                    tokens, "tokens", flops.train_step(fwd), "LlamaForCausalLM (SwiGLU MLP, RoPE, RMSNorm)")


def _gpt2(p: dict, seed: int) -> ZooEntry:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=p["vocab"], n_positions=max(p["seq"], 128), n_embd=p["hidden"],
                     n_layer=p["layers"], n_head=p["heads"], n_inner=p["intermediate"],
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    tokens = p["batch"] * p["seq"]
    fwd = p["layers"] * flops.transformer_layer(tokens, p["batch"], p["seq"], p["hidden"], p["heads"],
                                                p["intermediate"])
    fwd += flops.linear(tokens, p["hidden"], p["vocab"])  # LM head (tied to the embedding)
    return ZooEntry("", p, _seeded(seed, lambda: GPT2LMHeadModel(cfg)), _lm_batch(p, seed),
                    tokens, "tokens", flops.train_step(fwd), "GPT2LMHeadModel (tied embeddings)")


def _bert(p: dict, seed: int) -> ZooEntry:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
                     num_attention_heads=p["heads"], intermediate_size=p["intermediate"],
                     max_position_embeddings=max(p["seq"], 128), hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, use_cache=False)
    mask_id = min(103, p["vocab"] - 1)  # BERT's [MASK] id when the vocabulary is big enough

    def batch(i: int) -> dict:
        g = _gen(seed, i)
        ids = torch.randint(p["vocab"], (p["batch"], p["seq"]), generator=g)
        masked = torch.rand(ids.shape, generator=g) < 0.15
        masked[:, 0] = True  # at least one target per row, so the loss is never empty
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return {"input_ids": torch.where(masked, torch.full_like(ids, mask_id), ids),
                "attention_mask": torch.ones_like(ids), "labels": labels}

    tokens = p["batch"] * p["seq"]
    fwd = p["layers"] * flops.transformer_layer(tokens, p["batch"], p["seq"], p["hidden"], p["heads"],
                                                p["intermediate"])
    # The MLM head runs on every position: a hidden x hidden transform, then the decoder.
    fwd += flops.linear(tokens, p["hidden"], p["hidden"]) + flops.linear(tokens, p["hidden"], p["vocab"])
    return ZooEntry("", p, _seeded(seed, lambda: BertForMaskedLM(cfg)), batch, tokens, "tokens",
                    flops.train_step(fwd), "BertForMaskedLM, 15% of positions masked")


def _t5(p: dict, seed: int) -> ZooEntry:
    from transformers import T5Config, T5ForConditionalGeneration

    h, heads = p["hidden"], p["heads"]
    cfg = T5Config(vocab_size=p["vocab"], d_model=h, d_kv=h // heads, d_ff=p["intermediate"],
                   num_layers=p["layers"], num_decoder_layers=p["layers"], num_heads=heads,
                   dropout_rate=0.0, feed_forward_proj="relu", use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)

    def batch(i: int) -> dict:
        g = _gen(seed, i)
        src = torch.randint(1, p["vocab"], (p["batch"], p["seq"]), generator=g)
        tgt = torch.randint(1, p["vocab"], (p["batch"], p["seq"]), generator=g)
        return {"input_ids": src, "attention_mask": torch.ones_like(src), "labels": tgt}

    b, s = p["batch"], p["seq"]
    t = b * s  # source and target both have `seq` tokens
    enc = flops.transformer_layer(t, b, s, h, heads, p["intermediate"])
    dec = (flops.transformer_layer(t, b, s, h, heads, p["intermediate"])  # self-attention + MLP
           + 2 * flops.linear(t, h, h)                                      # cross-attn Q and output
           + 2 * flops.linear(t, h, h)                                      # cross-attn K, V of the encoder
           + flops.attention(b, heads, s, s, h // heads))                   # cross-attention products
    fwd = p["layers"] * (enc + dec) + flops.linear(t, h, p["vocab"])
    return ZooEntry("", p, _seeded(seed, lambda: T5ForConditionalGeneration(cfg)), batch, t, "tokens",
                    flops.train_step(fwd), "T5ForConditionalGeneration; tokens = source tokens "
                    "(the target has as many again)")


def _vit(p: dict, seed: int) -> ZooEntry:
    from transformers import ViTConfig, ViTForImageClassification

    patch = 16 if p["seq"] >= 64 else 8
    cfg = ViTConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                    intermediate_size=p["intermediate"], image_size=p["seq"], patch_size=patch,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=p["vocab"])

    def batch(i: int) -> dict:
        g = _gen(seed, i)
        return {"pixel_values": torch.randn(p["batch"], 3, p["seq"], p["seq"], generator=g),
                "labels": torch.randint(p["vocab"], (p["batch"],), generator=g)}

    b, side = p["batch"], p["seq"] // patch
    seq = side * side + 1  # patches + [CLS]
    fwd = flops.conv2d(b, 3, p["hidden"], patch, side, side)  # patch embedding
    fwd += p["layers"] * flops.transformer_layer(b * seq, b, seq, p["hidden"], p["heads"], p["intermediate"])
    fwd += flops.linear(b, p["hidden"], p["vocab"])  # classifier on [CLS] only
    return ZooEntry("", p, _seeded(seed, lambda: ViTForImageClassification(cfg)), batch, b, "samples",
                    flops.train_step(fwd), f"ViTForImageClassification, patch {patch}, {seq} tokens/image",
                    {"patch": patch})


def _resnet(p: dict, seed: int) -> ZooEntry:
    def batch(i: int) -> dict:
        g = _gen(seed, i)
        return {"pixel_values": torch.randn(p["batch"], 3, p["seq"], p["seq"], generator=g),
                "labels": torch.randint(p["vocab"], (p["batch"],), generator=g)}

    fwd = cnn.forward_flops(p["batch"], p["seq"], p["layers"], p["hidden"], p["vocab"])
    return ZooEntry("", p, _seeded(seed, lambda: cnn.ResNet(p["layers"], p["hidden"], p["vocab"])), batch,
                    p["batch"], "samples", flops.train_step(fwd),
                    f"plain-torch ResNet: {p['layers']} basic blocks, widths up to {p['hidden']}")


BUILDERS: dict[str, Callable[[dict, int], ZooEntry]] = {
    "llama": _llama, "llama-32k": _llama, "gpt2": _gpt2, "gpt2-50k": _gpt2,
    "bert": _bert, "t5": _t5, "vit": _vit, "resnet": _resnet,
}
MODELS = tuple(BUILDERS)
PLAIN_TORCH = frozenset({"resnet"})     # the other models are built by transformers (the `bench` extra)
OVERRIDABLE = ("layers", "hidden", "heads", "intermediate", "seq", "batch", "vocab")


def resolve(name: str, size: str = "default", **overrides: int | None) -> dict[str, int]:
    """The effective size parameters of ``name``; raises ValueError on bad input."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"unknown size override(s) {sorted(unknown)}; allowed: {', '.join(OVERRIDABLE)}")
    p = dict(SIZES[size])
    p.update(MODEL_DEFAULTS.get(name, {}).get(size, {}))
    p.update({k: int(v) for k, v in overrides.items() if v is not None})
    if p.get("intermediate") is None:
        p["intermediate"] = _llama_intermediate(p["hidden"]) if name.startswith("llama") else 4 * p["hidden"]
    for key, value in p.items():
        if value <= 0:
            raise ValueError(f"--{key} must be positive, got {value}")
    if name != "resnet" and p["hidden"] % p["heads"]:
        raise ValueError(f"hidden ({p['hidden']}) must be divisible by heads ({p['heads']})")
    if name == "vit" and p["seq"] % (16 if p["seq"] >= 64 else 8):
        raise ValueError(f"vit image size (--seq {p['seq']}) must be a multiple of its patch size")
    return p


def get(name: str, size: str = "default", seed: int = 0, **overrides: int | None) -> ZooEntry:
    """Build the zoo entry ``name`` (see module docstring); cheap: no model is built yet."""
    p = resolve(name, size, **overrides)
    entry = BUILDERS[name](p, seed)
    entry.name = name
    return entry
