"""Model-coverage sweep, part 1: which Hugging Face architectures, their shrunk configs, their batches.

`entries()` walks transformers' auto mappings (causal LM, masked LM, seq2seq, sequence / image / audio
classification, CTC, speech seq2seq, image-text-to-text) into `Entry(model_type, class_name, head)`.
`shrink(config_dict)` turns a default config into a tiny one by key names, generically: every sub-config
(`text_config`, `vision_config`, `encoder`, ...) recursively; hidden 64, 4 heads of 16 (MQA / MHA kept),
2 layers (per-layer lists cut to layers that keep each distinct kind), vocab 256, 4 experts, image 32 with
patch 4, all dropout and SpecAugment probabilities 0 (eager and Kiln must see the same function).
`candidate_batches(model, head)` yields batches for the head, most likely first: the sweep keeps the first
one eager trains on.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN, VOCAB = 64, 4, 16, 2, 128, 256
EXPERTS, TOP_K, IMAGE, PATCH, POSITIONS, BATCH, SEQ = 4, 2, 32, 4, 128, 2, 16
N_SPECIAL = 32                      # special token ids live in [0, N_SPECIAL); inputs avoid them

# auto mapping -> head kind, in the order a class seen in two mappings is attributed
MAPPINGS = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal_lm"), ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked_lm"),
            ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
            ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "seq_cls"),
            ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image_cls"), ("MODEL_FOR_CTC_MAPPING_NAMES", "ctc"),
            ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio_cls"),
            ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech_seq2seq"),
            ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "vlm"))


@dataclass(frozen=True)
class Entry:
    model_type: str
    class_name: str
    head: str

    @property
    def key(self) -> str:
        return f"{self.model_type}/{self.class_name}"


def entries() -> list[Entry]:
    from transformers.models.auto import modeling_auto
    seen: dict[str, Entry] = {}
    for mapping, head in MAPPINGS:
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in (names if isinstance(names, (tuple, list)) else (names,)):
                seen.setdefault(f"{model_type}/{name}", Entry(model_type, name, head))
    return sorted(seen.values(), key=lambda e: (e.model_type, e.class_name))


# ---- config shrinking ------------------------------------------------------------------------------
LAYER_KEYS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "depth", "layers", "num_text_layers", "num_vision_layers",
              "num_self_attends_per_block"}
HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "dim", "word_embed_proj_dim", "embedding_size", "text_hidden_size",
               "encoder_hidden_size", "out_hidden_size", "projector_hidden_size", "hidden_dim", "attention_hidden_size",
               "decoder_hidden_size", "output_hidden_size", "pooler_hidden_size", "projection_dim", "mm_hidden_size",
               "vision_output_dim", "emb_dim", "codebook_dim", "audio_hidden_size", "text_embed_dim", "vision_embed_dim", "hidden_size_global",
               "embed_dim", "projection_hidden_dim", "cross_attention_hidden_size", "d_embed", "image_text_hidden_size",
               "d_latents"}
HEAD_KEYS = {"num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads", "attention_heads",
             "decoder_attention_heads", "swa_num_attention_heads", "index_n_heads", "resampler_n_heads",
             "linear_num_value_heads", "linear_num_heads", "num_attention_heads_global"}
KV_KEYS = {"num_key_value_heads", "num_kv_heads", "n_head_kv", "linear_num_key_heads", "swa_num_key_value_heads",
           "multi_query_group_num", "num_key_value_heads_global"}
HEAD_DIM_KEYS = {"head_dim", "d_kv", "kv_channels", "attention_head_dim", "d_head", "dim_head", "swa_head_dim",
                 "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "resampler_head_dim",
                 "v_head_dim", "attention_head_size", "mamba_head_dim", "mamba_d_head", "linear_head_dim"}
SMALL_DIMS = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32,
              "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "num_mel_bins": 16,
              "max_source_positions": 32, "max_target_positions": POSITIONS, "xvector_output_dim": 32,
              "classifier_proj_size": 32, "codevector_dim": 32, "proj_codevector_dim": 32, "num_codevectors_per_group": 16,
              "sliding_window": 8, "sliding_window_size": 8, "attention_window": 8, "local_attention": 8,
              "attention_chunk_size": 8, "window_size": 4, "num_query_tokens": 4, "mamba_d_state": 16, "state_size": 16,
              "ssm_state_size": 16, "time_step_rank": 8, "mamba_dt_rank": 8, "laurel_rank": 8, "hidden_size_per_layer_input": 8,
              "n_positions": POSITIONS, "max_seq_len": POSITIONS, "max_position_embeddings": POSITIONS,
              "chunk_size": 8,
              "mamba_chunk_size": 8, "block_size": 8, "index_topk": 8, "latent_query_num": 4, "resampler_n_latents": 4,
              "num_random_blocks": 1, "subsampling_conv_channels": 16, "tdnn_dim": 32, "conv_dim": 32,
              "codebook_size": 64, "num_embeddings": 64, "mm_tokens_per_image": 4, "image_seq_length": 4,
              "num_image_tokens": 4, "num_kv_shared_layers": 0, "max_2d_position_embeddings": POSITIONS,
              "first_k_dense_replace": 1, "num_dense_layers": 1, "max_window_layers": LAYERS,
              "moe_num_shared_experts": 1, "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 2, "topk_group": 1,
              "num_expert_group": 2, "topk_group_size": 1, "num_nextn_predict_layers": 1, "linear_conv_kernel_dim": 4,
              "rotary_dim": 8, "rotary_emb_base": None, "output_dim": 32, "num_filters": 16, "num_latents": 8}
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_total"}
TOPK_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k", "num_selected_experts"}
CONV_LIST_KEYS = {"conv_kernel", "conv_stride", "conv_dim", "tdnn_kernel", "tdnn_dilation", "tdnn_dim", "strides",
                  "kernel_sizes", "patch_sizes", "patch_stride", "patch_padding", "upsampling_ratios",
                  "downsampling_ratios", "channel_multiplier", "mlp_ratios", "mlp_ratio"}
ZERO_KEYS = {"mask_time_prob", "mask_feature_prob", "router_jitter_noise", "jitter_noise", "router_z_loss_coef_noise",
             "layerdrop", "encoder_layerdrop", "decoder_layerdrop", "drop_path_rate", "stochastic_depth_prob",
             "drop_connect_rate", "mask_time_min_masks"}
SPECIAL_SUFFIXES = ("token_id", "token_index", "token_ids", "_token", "_index")


def _is_drop(key: str) -> bool:
    return "dropout" in key or "drop_prob" in key or key.endswith("pdrop") or key in ZERO_KEYS


def _special(key: str) -> bool:
    return isinstance(key, str) and key.endswith(SPECIAL_SUFFIXES) and key not in ("vision_feature_layer", "image_token_index_offset")


def _mapped_layers(types: list, n: int) -> list[int]:
    """Indices of `n`-ish layers of a per-layer list that keep every distinct value (first occurrence each)."""
    keep, firsts = [], {}
    for i, t in enumerate(types):
        firsts.setdefault(repr(t), i)
    keep = sorted(firsts.values())
    i = 0
    while len(keep) < n and i < len(types):
        if i not in keep:
            keep.append(i)
        i += 1
    return sorted(keep)


def _rescale(values: list[int], total: int) -> list[int]:
    """Positive integers proportional to `values` summing to `total` (mrope sections of a smaller head)."""
    s = sum(values)
    out = [max(1, v * total // s) for v in values]
    out[-1] += total - sum(out)
    return out


class Shrinker:
    """Shrinks one config dict (and, recursively, its sub-config dicts) in place."""

    def __init__(self):
        self.tokens: dict[int, int] = {}      # original special token id -> small id

    def token(self, v):
        """Special ids map below N_SPECIAL (ids that are already there stay): a RoBERTa-style model counts
        positions from its pad id, so a pad id near the top of the vocabulary would overrun the positions."""
        if isinstance(v, list):
            return [self.token(x) for x in v]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return v
        if v not in self.tokens:
            used = set(self.tokens.values())
            self.tokens[v] = v if v < N_SPECIAL else next((i for i in range(4, N_SPECIAL) if i not in used
                                                          and i not in self.tokens), N_SPECIAL - 1)
        return self.tokens[v]

    def collect(self, d: dict):
        """Reserve the small special ids of `d` (and sub-configs) first, so that no large id takes them."""
        for k, v in d.items():
            if isinstance(v, dict):
                self.collect(v)
            elif _special(k):
                for x in (v if isinstance(v, list) else [v]):
                    if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < N_SPECIAL:
                        self.tokens[x] = x

    def __call__(self, d: dict) -> dict:
        orig = dict(d)
        for k, v in list(d.items()):
            if isinstance(v, dict) and ("model_type" in v or k.endswith("config") or k in ("encoder", "decoder")):
                self(v)
        layers0 = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                                       "decoder_layers") if isinstance(d.get(k), int)), None)
        keep = self._layer_selection(d, layers0)
        self.cnn = any(isinstance(v, list) and ("channels" in k or k == "hidden_sizes") for k, v in d.items())
        heads0 = next((d[k] for k in HEAD_KEYS if isinstance(d.get(k), int)), None)
        for k, v in list(d.items()):
            d[k] = self.value(k, v, d, layers0, keep, heads0)
        self._rope(d)
        self._fill(d, orig, keep, heads0, layers0)
        return d

    def _fill(self, d: dict, orig: dict, keep, heads0, layers0):
        """Values a default config leaves None that its model needs, and relations between sizes."""
        if "vocab_size" in d and d.get("model_type"):
            if d["vocab_size"] is None:
                d["vocab_size"] = VOCAB
            if d.get("pad_token_id", 0) is None:           # sequence classification of a batch needs a pad id
                eos = d.get("eos_token_id")
                d["pad_token_id"] = eos if isinstance(eos, int) else 0
        for k in ("image_token_id", "image_token_index"):    # a VLM default without one cannot place images
            if k in d and d[k] is None and "vision_config" in d:
                d[k] = self.token(10 ** 9 + 1)
        if d.get("is_encoder_decoder") and d.get("decoder_start_token_id") is None:
            d["decoder_start_token_id"] = d.get("pad_token_id") or 0
        if heads0 is not None:
            if "head_dim" in d and d["head_dim"] is None:
                d["head_dim"] = HEAD_DIM
            for k in KV_KEYS & d.keys():
                if d[k] is None:
                    d[k] = HEADS
        for k in (EXPERT_KEYS | TOPK_KEYS) & d.keys():
            if d[k] is None and (d.get("num_experts") or d.get("n_routed_experts") or d.get("num_local_experts")
                                 or k in ("n_routed_experts", "num_experts_per_tok")):
                d[k] = EXPERTS if k in EXPERT_KEYS else TOP_K
        rope0, nope0 = orig.get("qk_rope_head_dim"), orig.get("qk_nope_head_dim")
        if isinstance(rope0, int):       # MLA: head sizes defined as the rotary part, or rotary + rest
            for k in HEAD_DIM_KEYS | {"qk_head_dim"}:
                if isinstance(orig.get(k), int) and orig[k] == rope0:
                    d[k] = d["qk_rope_head_dim"]
                elif isinstance(orig.get(k), int) and isinstance(nope0, int) and orig[k] == rope0 + nope0:
                    d[k] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
        if isinstance(d.get("n_routed_experts"), int) and "n_shared_experts" in d and d["n_shared_experts"] is None:
            d["n_shared_experts"] = 1
        if isinstance(d.get("expand"), int) and isinstance(d.get("num_heads"), int) \
                and isinstance(d.get("head_dim"), int) and isinstance(d.get("hidden_size"), int):
            d["num_heads"] = d["expand"] * d["hidden_size"] // d["head_dim"]    # Mamba-2: heads x head = expand x hidden
        types = d.get("layer_types")
        if isinstance(types, list) and any("sliding" in str(t) for t in types) and d.get("sliding_window") is None \
                and "sliding_window" in d:
            d["sliding_window"] = 8
        hidden0, hidden = orig.get("hidden_size"), d.get("hidden_size")
        for k, v in d.items():      # sizes that must add up to the hidden size (Reformer's axial embeddings)
            if isinstance(v, list) and len(v) > 1 and all(isinstance(x, int) for x in v) and hidden0 \
                    and sum(orig[k]) == hidden0 and hidden != hidden0 and "section" not in k:
                d[k] = _rescale(orig[k], hidden)
            if isinstance(v, dict) and v and keep and all(str(x).isdigit() for x in v):   # {layer index: ...}
                d[k] = {str(keep.index(int(x))).zfill(len(str(x))) if isinstance(x, str) else keep.index(x): y
                        for x, y in v.items() if int(x) in keep}
        for k in ("stage_names", "out_features", "out_indices"):   # backbones: recomputed from the depth
            if "stage_names" in d or layers0:
                d.pop(k, None)
        if self.cnn and isinstance(d.get("num_groups"), int):
            d["num_groups"] = min(d["num_groups"], 4)    # GroupNorm groups must divide the narrower channels
        for k in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"):
            if isinstance(d.get(k), int):
                d[k] = 2 * HIDDEN // HEAD_DIM

    def _layer_selection(self, d, layers0) -> list[int] | None:
        if not layers0:
            return None
        lists = [v for k, v in d.items() if isinstance(v, list) and len(v) == layers0 and k not in CONV_LIST_KEYS]
        keep = list(range(min(LAYERS, layers0)))
        for lst in lists:
            keep = sorted(set(keep) | set(_mapped_layers(lst, LAYERS)))
        return keep[:4] if len(keep) > 4 else keep

    def value(self, k: str, v: Any, d: dict, layers0, keep, heads0):
        n_layers = len(keep) if keep else LAYERS
        if isinstance(v, bool) or v is None or isinstance(v, (dict, str)):
            return v
        if _is_drop(k) and isinstance(v, (int, float)):
            return 0.0 if isinstance(v, float) else 0
        if _special(k):
            return self.token(v)
        if isinstance(v, list):
            return self.list_value(k, v, layers0, keep, heads0)
        if not isinstance(v, int):
            return v
        if k in LAYER_KEYS:
            return min(v, n_layers) if k != "depth" or v > 4 else v
        if k in HIDDEN_KEYS:
            if self.cnn:            # a CNN's stem and head widths follow its stage widths
                return v // 8 if v >= 64 and v % 8 == 0 else v
            return min(v, HIDDEN)
        if k in HEAD_KEYS:
            return min(v, HEADS)
        if k in KV_KEYS:
            return v if v <= 1 else (HEADS if heads0 is not None and v >= heads0 else min(v, 2))
        if k in HEAD_DIM_KEYS:
            return min(v, HEAD_DIM)
        if k in SMALL_DIMS:
            small = SMALL_DIMS[k]
            return v if small is None else min(v, small)
        if "intermediate_size" in k or k.endswith("ffn_dim") or k in ("n_inner", "d_ff", "ffn_hidden_size", "d_inner",
                                                                      "mlp_dim", "intermediate_dim"):
            return min(v, FFN if "moe" not in k and "expert" not in k else 32)
        if k in EXPERT_KEYS:
            return min(v, EXPERTS)
        if k in TOPK_KEYS:
            return min(v, TOP_K)
        if "vocab_size" in k and k != "type_vocab_size":
            return min(v, VOCAB)
        if k == "image_size":
            return min(v, IMAGE)
        if k == "patch_size":
            return min(v, PATCH)
        return v

    def list_value(self, k, v: list, layers0, keep, heads0):
        if not v or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            if layers0 and keep and len(v) == layers0 and k not in CONV_LIST_KEYS:
                return [v[i] for i in keep]
            return v
        if k in ("image_size", "patch_size", "input_size"):
            return [min(x, IMAGE if "image" in k or "input" in k else PATCH) for x in v]
        if k == "depths":
            return [1] * len(v)
        if "channels" in k or k in ("hidden_sizes", "embed_dims", "dims", "widths", "embed_dim", "hidden_dims",
                                    "neck_hidden_sizes"):
            # one factor for every stage (stage i's output is stage i+1's input) that keeps head divisibility
            heads = heads0 if isinstance(heads0, int) else 1
            f = next((f for f in (8, 4, 2) if all(x % f == 0 and (x // f) % heads == 0 for x in v if x >= 64)), 1)
            return [x // f if isinstance(x, int) and x >= 64 else x for x in v]
        if k in ("num_heads", "num_attention_heads", "attention_heads"):
            return [min(x, 2 ** i) for i, x in enumerate(v)]
        if k in ("conv_dim", "tdnn_dim"):
            return [min(x, 32) for x in v[:-1]] + [min(v[-1], 32)]
        if layers0 and keep and len(v) == layers0 and k not in CONV_LIST_KEYS:
            return [v[i] for i in keep]
        n_layers = len(keep) if keep else LAYERS
        if layers0 and all(isinstance(x, int) and 0 <= x < layers0 for x in v) and (
                "layer" in k or "index" in k or "idx" in k or "indices" in k):
            kept = [keep.index(x) for x in v if keep and x in keep]
            return kept or [n_layers - 1]
        if k == "out_indices" and layers0:
            return [min(x, n_layers) for x in v]
        if "intermediate_size" in k:
            return [min(x, FFN) for x in v]
        return v

    def _rope(self, d: dict):
        fix_rope(d, d.get("head_dim") or (d["hidden_size"] // d["num_attention_heads"]
                                          if isinstance(d.get("hidden_size"), int)
                                          and isinstance(d.get("num_attention_heads"), int) else None))


def fix_rope(d, head: int | None):
    """mrope sections must sum to the (smaller) rotary half; long/short rope factors follow it. `d` is a
    config dict or object; its rope parameters may be one dict or one per layer type."""
    get = d.get if isinstance(d, dict) else lambda k, default=None: getattr(d, k, default)
    if not head:
        return
    for key in ("rope_parameters", "rope_scaling"):
        rope = get(key)
        if not isinstance(rope, dict):
            continue
        for r in [x for x in rope.values() if isinstance(x, dict)] or [rope]:
            half = int(head * (r.get("partial_rotary_factor") or get("partial_rotary_factor") or 1.0) // 2)
            if isinstance(r.get("mrope_section"), list) and sum(r["mrope_section"]) != half:
                r["mrope_section"] = _rescale(r["mrope_section"], half)
            for f in ("long_factor", "short_factor"):
                if isinstance(r.get(f), list):
                    r[f] = r[f][:half]
            if isinstance(r.get("original_max_position_embeddings"), int):
                r["original_max_position_embeddings"] = min(r["original_max_position_embeddings"], POSITIONS // 2)


def _sub_configs(config) -> Iterator:
    from transformers import PretrainedConfig
    yield config
    for v in vars(config).values():
        if isinstance(v, PretrainedConfig):
            yield from _sub_configs(v)


def shrunk_config(model_type: str):
    """The default config of `model_type`, shrunk; and the map of special token ids it was given."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    shrink = Shrinker()
    d = cls().to_dict()
    for k, sub in getattr(cls, "sub_configs", {}).items():     # a sub-config left None: its default, to shrink
        if d.get(k) is None and isinstance(sub, type) and hasattr(sub, "model_type") and sub.model_type:
            try:
                d[k] = sub().to_dict()
            except Exception:           # noqa: BLE001 - the parent builds it then
                pass
    shrink.collect(d)
    d = shrink(d)
    for k in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(k, None)
    config = cls.from_dict(d)
    # sub-configs a default leaves None are made by the config's __init__, at full size: shrink those too
    again = {k: v for k, v in config.to_dict().items() if isinstance(v, dict) and "model_type" in v
             and not isinstance(d.get(k), dict)}
    if again:
        d.update({k: shrink(v) for k, v in again.items()})
        config = cls.from_dict(d)
    for c in _sub_configs(config):      # values the config's own __init__ derived from defaults
        c.use_cache = False
        heads, hidden = getattr(c, "num_attention_heads", None), getattr(c, "hidden_size", None)
        head = getattr(c, "qk_rope_head_dim", None) or getattr(c, "head_dim", None) or (
            hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
        rope = getattr(c, "rope_parameters", None)
        if isinstance(rope, dict) and "mrope_section" in getattr(type(c), "ignore_keys_at_rope_validation", ()) \
                and "mrope_section" not in rope and head:
            rope["mrope_section"] = _rescale([2, 3, 3], head // 2)   # the models' default split, 1 : 1.5 : 1.5
        fix_rope(c, head)
    return config, sorted(set(shrink.tokens.values()))


# ---- batches ----------------------------------------------------------------------------------------
def _get(config, *names, default=None):
    """The first attribute of `names` found on the config or one of its sub-configs."""
    subs = [config] + [getattr(config, s) for s in ("text_config", "vision_config", "audio_config", "encoder",
                                                    "decoder") if getattr(config, s, None) is not None]
    for c in subs:
        for n in names:
            v = getattr(c, n, None)
            if v is not None and not isinstance(v, bool):
                return v
    return default


def _ids(config, specials, shape, gen) -> torch.Tensor:
    vocab = min(int(_get(config, "vocab_size", default=VOCAB)), VOCAB)
    allowed = torch.tensor([i for i in range(N_SPECIAL, vocab) if i not in specials] or list(range(vocab)))
    return allowed[torch.randint(len(allowed), shape, generator=gen)]


def _mask(shape) -> torch.Tensor:
    mask = torch.ones(shape, dtype=torch.long)
    mask[-1, -3:] = 0                       # the last row right-padded by 3
    return mask


def _labels(config, n, gen) -> torch.Tensor:
    return torch.randint(max(1, int(getattr(config, "num_labels", 2) or 2)), (n,), generator=gen)


def _side(v) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v)


def candidate_batches(model: torch.nn.Module, head: str, specials: list[int]) -> Iterator[tuple[str, dict]]:
    """(description, kwargs) for `model`'s head, most likely first; every batch carries labels."""
    config, gen = model.config, torch.Generator().manual_seed(0)
    params = inspect.signature(model.forward).parameters
    takes_mask = "attention_mask" in params
    B, S = BATCH, SEQ
    if head == "vlm":
        yield from _image_text_batches(model, config, specials, takes_mask, gen)
    if head in ("causal_lm", "masked_lm", "seq_cls", "vlm", "seq2seq"):
        ids = _ids(config, specials, (B, S), gen)
        batch = {"input_ids": ids}
        if takes_mask:
            batch["attention_mask"] = _mask((B, S))
        if head == "seq_cls":
            batch["labels"] = _labels(config, B, gen)
            eos = _get(config, "eos_token_id")
            if isinstance(eos, int):
                ids[:, -1] = eos        # encoder-decoder classifiers read the hidden state at <eos>
        elif head == "masked_lm":
            labels = ids.clone()
            labels[:, ::2] = -100
            batch["labels"] = labels
        elif head == "seq2seq":
            batch["labels"] = _ids(config, specials, (B, S // 2), gen)
        else:
            batch["labels"] = ids.clone()
        yield "tokens", batch
        if head == "seq2seq":
            yield "tokens+decoder_input_ids", dict(batch, decoder_input_ids=_ids(config, specials, (B, S // 2), gen))
            yield "tokens, causal labels", dict(batch, labels=ids.clone())     # decoder-only "seq2seq" heads
        if takes_mask:
            yield "tokens, no mask", {k: v for k, v in batch.items() if k != "attention_mask"}
        return
    if head == "image_cls":
        side = _side(_get(config, "image_size", "input_size", default=IMAGE))
        chans = int(_get(config, "num_channels", "in_channels", default=3))
        for s in dict.fromkeys((side, IMAGE, 64, 224)):
            yield f"image {s}", {"pixel_values": torch.randn(B, chans, s, s, generator=gen),
                                 "labels": _labels(config, B, gen)}
        return
    yield from _audio_batches(model, config, head, specials, takes_mask, gen)


def _image_features_per_image(model, pixel_values) -> int | None:
    """How many embeddings the model puts in place of one image's tokens (None: cannot tell)."""
    get = getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None), "get_image_features",
                                                                None)
    if get is None:
        return None
    try:
        with torch.no_grad():
            out = get(pixel_values=pixel_values)
    except Exception:                   # noqa: BLE001 - this model wants more than pixel values
        return None
    if not isinstance(out, (torch.Tensor, list, tuple)):
        out = getattr(out, "pooler_output", None) if getattr(out, "pooler_output", None) is not None \
            else getattr(out, "last_hidden_state", None)
    if isinstance(out, (list, tuple)):
        return int(out[0].shape[0]) if out and isinstance(out[0], torch.Tensor) else None
    if not isinstance(out, torch.Tensor):
        return None
    b = pixel_values.shape[0]
    return int(out.shape[1]) if out.dim() == 3 and out.shape[0] == b else int(out.shape[0]) // b if out.dim() == 2 \
        else None


def _image_text_batches(model, config, specials, takes_mask, gen) -> Iterator[tuple[str, dict]]:
    """An image-text-to-text model with one fixed-size image per sample: image tokens first, then text."""
    B, S = BATCH, SEQ
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return
    side = _side(getattr(vision, "image_size", None) or IMAGE)
    pixels = torch.randn(B, int(getattr(vision, "num_channels", 3) or 3), side, side, generator=gen)
    text = _ids(config, specials, (B, S), gen)
    image_id = _get(config, "image_token_id", "image_token_index")
    n = _image_features_per_image(model, pixels)
    if isinstance(image_id, int) and n:
        ids = torch.cat([torch.full((B, n), image_id), text], 1)
        labels = ids.clone()
        labels[:, :n] = -100
        batch = {"input_ids": ids, "pixel_values": pixels, "labels": labels}
        if takes_mask:
            batch["attention_mask"] = torch.ones_like(ids)
        yield f"image ({n} tokens) + text", batch
    batch = {"input_ids": text, "pixel_values": pixels, "labels": text.clone()}
    if "qformer_input_ids" in inspect.signature(model.forward).parameters:
        batch["qformer_input_ids"] = text
    yield "image + text (no image tokens)", batch


def _audio_batches(model, config, head, specials, takes_mask, gen) -> Iterator[tuple[str, dict]]:
    B, S = BATCH, SEQ
    if head == "ctc":
        vocab = int(_get(config, "vocab_size", default=32))
        pad = getattr(config, "pad_token_id", None)
        pool = [i for i in range(1, vocab) if i != pad and i not in specials] or [1]
        labels = torch.tensor(pool)[torch.randint(len(pool), (B, 4), generator=gen)]
    elif head == "audio_cls":
        labels = _labels(config, B, gen)
    else:
        labels = _ids(config, specials, (B, S // 2), gen)
    feats = [_get(config, n) for n in ("num_mel_bins", "feature_size", "feature_projection_input_dim", "input_dim",
                                       "n_mels")]
    if getattr(config, "input_channels", None) and getattr(config, "input_feat_per_channel", None):
        feats.insert(0, config.input_feat_per_channel * config.input_channels)
    feats = list(dict.fromkeys(int(f) for f in feats if isinstance(f, int) and f > 0)) or [16]
    frames = [2 * int(getattr(config, "max_source_positions", None) or 32), getattr(config, "max_length", None), 64, 128]
    frames = list(dict.fromkeys(int(t) for t in frames if isinstance(t, int) and 0 < t <= 1024))
    stride = math.prod(getattr(config, "conv_stride", None) or [1])
    main = getattr(model, "main_input_name", "input_values")
    main = main if main in ("input_values", "input_features") else "input_features"

    def with_mask(batch, shape):
        return dict(batch, attention_mask=torch.ones(shape, dtype=torch.long)) if takes_mask else batch

    wave = {"input_values": torch.randn(B, max(4000, 16 * stride), generator=gen), "labels": labels}
    if main == "input_values":
        yield "waveform", with_mask(wave, wave["input_values"].shape)
    for t in frames:
        for f in feats:
            for layout, shape in (("B, T, F", (B, t, f)), ("B, F, T", (B, f, t))):
                x = torch.randn(*shape, generator=gen)
                batch = {main: x, "labels": labels}     # a spectrogram passed as input_values (AST) has no frame mask
                yield f"{main} ({layout}) = {shape}", with_mask(batch, (B, t)) if main == "input_features" else batch
    if main != "input_values":
        yield "waveform", with_mask(wave, wave["input_values"].shape)
