"""`kiln adopt --verify transformers:<model_type>`: does the rewritten modeling file compute the same?

The rules are checked one pattern at a time by the unit tests; this checks them where they are used.
``transformers/models/<t>/modeling_<t>.py`` of the *installed* transformers is rewritten with
``rewrite_source`` into a temporary directory and loaded from there as
``transformers.models.<t>.modeling_<t>_kiln_adopted`` (so its relative imports resolve in the real
package; the installed files are never touched).  Then, from one seed:

* **Equivalence.**  A tiny config of that model type (hidden 64, 2 layers, 4 heads, 2 kv heads,
  vocab 256, ...) builds the LM / classification class (else the base model) from both modules; the
  rewritten one gets the original's ``state_dict`` (a strict load: a rewrite that renames parameters
  is reported as such).  Both run one forward and backward in fp32, in ``train()`` mode so the
  training code paths run, with every dropout probability of the config set to 0 so the two runs
  are deterministic, and with ``attn_implementation="eager"`` so the hand-written attention (the code
  the rules rewrite) runs instead of SDPA.  Compared: the main output (logits / last_hidden_state),
  the loss, and the gradient of every parameter.  Each tensor passes when
  ``max|rewritten - original| <= ATOL + RTOL * max|original|`` with ``ATOL = RTOL = 1e-4``: fp32
  kernels that only reorder sums differ by ~1e-6 relative, a wrong rewrite by far more; where that
  fails, the original's own float32-vs-float64 error is allowed too (verify_compare.py).  Parameters
  initialized to a constant (norm weights of 1, biases of 0) get noise first, so a rewrite that
  drops or misplaces them shows.  A profile hook records which functions of the rewritten file ran:
  a rewritten function the small model never calls is listed as ``rewrites_not_run`` (the
  comparison says nothing about it).  Everything runs on the CPU.
* **Cost** (unless ``--no-timing``).  A bigger config (hidden 256, 2 layers, batch 4, sequence 128)
  runs eager training steps (forward, backward, ``torch.optim.AdamW``) in two fresh worker
  processes, one per module, started together and stepped alternately so that load on the machine
  hits both alike: 2 warm-up steps, then the median of 5.  Peak RSS is the high-water mark of each
  worker over its measured steps (``kiln.bench.memory.PeakTracker``).

``verify(spec, rules)`` returns the result dict that ``--json`` writes.  Problems that stop the check
(unknown model type, no transformers, no modeling file, the *original* model fails) raise
``VerifyError`` (exit 2); anything wrong with the *rewritten* model (it does not import, build, load
the weights or run) is a non-equivalence (exit 1) with a ``reason``.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path

from kiln.adopt.rewrite import AdoptError, rewrite_source
from kiln.adopt.verify_compare import ATOL, RTOL, compare, in_float64
from kiln.adopt.verify_locate import (VerifyError, load_overlay, modeling_path, module_names,
                                      parse_spec, resolve_type)

SEED = 0
WARMUP_STEPS = 2
MEASURED_STEPS = 5
WORKER_TIMEOUT_S = 600.0

# The directory holding the `kiln` package: workers must import this very copy.
_ROOT = str(Path(__file__).resolve().parents[2])

# Model sizes: small enough that fp32 rounding stays far below the tolerance and a check takes
# seconds; the timing size is big enough that the step, not Python overhead, dominates.
CHECK_SIZE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 256,
              "positions": 256, "image": 32, "patch": 8, "batch": 2, "seq": 16}
TIMING_SIZE = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 1024,
               "positions": 256, "image": 64, "patch": 8, "batch": 4, "seq": 128}
# `--timing-size bench`: the CPU-sized default of `kiln bench` (4 layers, hidden 512, batch 8, seq 256)
BENCH_SIZE = {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 1376, "vocab": 32000,
              "positions": 512, "image": 224, "patch": 16, "batch": 8, "seq": 256}
TIMING_SIZES = {"small": TIMING_SIZE, "bench": BENCH_SIZE}

# Config field names for one size, across model families (only the fields a config has are set).
_FIELDS = {
    "hidden": ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "word_embed_proj_dim",
               "embedding_size"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
               "encoder_layers", "decoder_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
              "decoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "intermediate": ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "hidden_dim", "encoder_ffn_dim",
                     "decoder_ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size"),
    "vocab": ("vocab_size",),
    "positions": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"),
    "image": ("image_size",),
    "patch": ("patch_size",),
}
# Fields that default to None ("derive it") but may be set; the rest are set only over an int.
_NONE_OK = {"num_key_value_heads", "n_inner", "head_dim", "d_kv"}

# Task heads in order of preference: each gives a loss from labels, so the whole model is trained.
# Masked LM before causal LM: encoders (bert, roberta) also list a causal head that wants is_decoder.
_HEADS = (("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
          ("masked", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
          ("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
          ("image", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
          ("base", "MODEL_MAPPING_NAMES"))


# -- building the models ---------------------------------------------------------------------------

def tiny_config(model_type: str, size: dict):
    """A small config of `model_type`: the size fields it has set from `size`, no dropout, no cache.

    Given to the config's constructor, not set afterwards, so derived fields (head_dim = hidden /
    heads) are derived from the small sizes."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    overrides = {}
    for key, names in _FIELDS.items():
        for name in names:
            if name in defaults and (isinstance(defaults[name], int) and not isinstance(defaults[name], bool)
                                     or defaults[name] is None and name in _NONE_OK):
                overrides[name] = size[key]
    head_dim = size["hidden"] // size["heads"]
    for name in ("head_dim", "d_kv", "kv_channels"):
        if name in defaults and (isinstance(defaults[name], int) or name in _NONE_OK):
            overrides[name] = head_dim
    if isinstance(defaults.get("rotary_dim"), int):         # gptj, codegen: rotary part of a head
        overrides["rotary_dim"] = head_dim // 2
    for name, value in defaults.items():                    # deterministic runs: see module docstring
        if any(w in name for w in ("dropout", "pdrop", "layerdrop")) and isinstance(value, float):
            overrides[name] = 0.0
    overrides.update(_per_layer(defaults, size["layers"]))
    overrides.update(_token_ids(defaults, size["vocab"]))
    if "use_cache" in defaults:
        overrides["use_cache"] = False
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        # T5 reads it from the config, where only a checkpoint's config.json sets it (to pad).
        overrides["decoder_start_token_id"] = overrides.get("pad_token_id", defaults.get("pad_token_id")) or 0
    try:
        return AutoConfig.for_model(model_type, **overrides)
    except Exception as exc:
        raise VerifyError(f"transformers:{model_type}: cannot make a small config "
                          f"({type(exc).__name__}: {exc})") from None


def _per_layer(defaults: dict, layers: int) -> dict:
    """Lists with one entry per layer (layer_types, ...) cut to `layers` entries; gpt_neo's
    run-length `attention_types` made to cover `layers`."""
    counts = [defaults[n] for n in _FIELDS["layers"] if isinstance(defaults.get(n), int)]
    out = {}
    for name, value in defaults.items():
        if isinstance(value, list) and len(value) > layers and len(value) in counts:
            out[name] = value[:layers]
    kinds = defaults.get("attention_types")
    if isinstance(kinds, list) and kinds and isinstance(kinds[0], (list, tuple)) and len(kinds[0]) == 2:
        pattern = kinds[0][0]
        out["attention_types"] = [[pattern, max(1, layers // len(pattern))]]
    return out


def _token_ids(defaults: dict, vocab: int) -> dict:
    """Special token ids that would not fit the small vocabulary, moved to its top ids."""
    top = iter(range(vocab - 1, 0, -1))
    moved: dict[int, int] = {}

    def fit(i):
        if isinstance(i, int) and not isinstance(i, bool) and i >= vocab:
            return moved.setdefault(i, next(top))
        return i
    out = {}
    for name, value in defaults.items():
        if name.endswith("token_id") or name.endswith("token_ids"):
            new = [fit(v) for v in value] if isinstance(value, list) else fit(value)
            if new != value:
                out[name] = new
    return out


def special_ids(config) -> set[int]:
    ids = set()
    for name, value in config.to_dict().items():
        if name.endswith("token_id") or name.endswith("token_ids"):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int):
                    ids.add(v)
    return ids


def pick_class(model_type: str) -> tuple[str, str]:
    """(class name, kind) of the model to build: the first task head with a loss, else the base."""
    from transformers.models.auto import modeling_auto

    for kind, table in _HEADS:
        name = getattr(modeling_auto, table, {}).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name:
            return name, kind
    raise VerifyError(f"transformers:{model_type}: no model class in transformers' auto mappings")


def classes(model_type: str, original, overlay) -> tuple[str, str, type, type | None]:
    """(name, kind, original class, overlay class) for the preferred class defined in the file.

    A head class that lives in another file (imported into this one) would not be rewritten at
    all, so then the base model, which is defined here, is used."""
    from transformers.models.auto import modeling_auto

    name, kind = pick_class(model_type)
    if getattr(getattr(original, name, None), "__module__", None) != original.__name__:
        base = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        base = base[0] if isinstance(base, (tuple, list)) else base
        if getattr(getattr(original, base or "", None), "__module__", None) != original.__name__:
            raise VerifyError(f"transformers:{model_type}: neither {name} nor {base} is defined in "
                              f"{Path(original.__file__).name}")
        name, kind = base, "base"
    new = getattr(overlay, name, None) if overlay is not None else None
    return name, kind, getattr(original, name), new


def build(cls, config, seed: int = SEED):
    """`cls` from `config` with eager attention, in train mode; constant-initialized parameters
    (norm weights of 1, biases of 0) get noise so a rewrite that drops or misplaces them shows."""
    import torch

    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, attn_implementation="eager")
    except TypeError:        # transformers before 4.36: no attn_implementation, eager is all there is
        model = cls._from_config(config)
    model = model.float().train()
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_inputs(model, config, kind: str, size: dict, seed: int = SEED) -> dict:
    """Random inputs of the model's main input (token ids avoid special tokens), with labels
    whenever the class computes a loss from them."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    batch, seq = size["batch"], size["seq"]
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        image = getattr(config, "image_size", size["image"])
        image = image[0] if isinstance(image, (list, tuple)) else image
        inputs = {"pixel_values": torch.randn(batch, channels, image, image, generator=g)}
        if kind == "image":
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return inputs
    if main != "input_ids":
        raise VerifyError(f"{type(model).__name__}: main input {main!r} is not supported "
                          f"(token ids and images are)")
    allowed = torch.tensor(sorted(set(range(config.vocab_size)) - special_ids(config)))
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=g)]
    inputs = {"input_ids": ids}
    if kind in ("causal", "masked", "seq2seq"):
        labels = allowed[torch.randint(0, len(allowed), (batch, seq), generator=g)]
        inputs["labels"] = ids.clone() if kind == "causal" else labels
    return inputs


def loss_of(output):
    """The model's loss, else the sum of the means of its float outputs (so every output gets a
    gradient)."""
    import torch

    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    floats = [t for t in _tensors(values) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise VerifyError(f"{type(output).__name__}: no float output to take a loss from")
    return torch.stack([t.float().mean() for t in floats]).sum()


def _tensors(values):
    import torch

    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (tuple, list)):
        for v in values:
            yield from _tensors(v)


def main_output(output):
    """logits, else last_hidden_state, else the first float tensor of the output."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    return next(t for t in _tensors(values) if t.is_floating_point())


def functions_run(fn, filename: str) -> tuple[object, set[str]]:
    """(fn(), qualified names of the functions of `filename` that ran): an equivalence says nothing
    about a rewrite the tiny model never executes (another attention path, an unused class)."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == filename:
            seen.add(getattr(frame.f_code, "co_qualname", frame.f_code.co_name))   # co_qualname: 3.11+
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        value = fn()
    finally:
        sys.setprofile(previous)
    return value, seen


def _not_run(applied, ran: set[str]) -> list[str]:
    """The rewritten functions (`Class.method`) that are not in `ran`.  Python 3.10 code objects
    have no co_qualname, so there a bare method name that ran counts."""
    names = _unique(f"{m.cls}.{m.method}" if m.cls else m.method for m in applied)
    return [n for n in names if n not in ran and n.rpartition(".")[2] not in ran]


def run_once(model, inputs: dict, seed: int = SEED):
    """One forward and backward: (main output, loss, {parameter name: grad})."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed + 2)
    output = model(**inputs)
    loss = loss_of(output)
    loss.backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else None for n, p in model.named_parameters()}
    return main_output(output).detach(), loss.detach(), grads


# -- comparing ---------------------------------------------------------------------------------------

def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# -- the check ---------------------------------------------------------------------------------------

def verify(spec: str, rules=None, timing: bool = True, log=None, timing_size: str = "small") -> dict:
    """Rewrite, compare and (with `timing`) measure one transformers model type; the result dict.

    `rules` as for rewrite_source.  `log(text)` is told what is happening (the timing part takes a
    while)."""
    log = log or (lambda text: None)
    model_type = resolve_type(parse_spec(spec))
    path = modeling_path(model_type)
    text = path.read_text(encoding="utf-8")
    try:
        new_text, matches = rewrite_source(text, rules, filename=str(path))
    except AdoptError as exc:
        raise VerifyError(str(exc)) from None
    except Exception as exc:            # a bug in a rule: say where, not a traceback
        raise VerifyError(f"transformers:{model_type}: the rewriter crashed on {path} ({_short(exc)})") from None
    applied = [m for m in matches if m.applied]
    result = {"model_type": model_type, "rules_applied": _unique(m.rule for m in applied),
              "rule_counts": _counts(m.rule for m in applied),
              "not_applied": _counts(m.rule for m in matches if not m.applied),
              "matches": [m.to_json() for m in matches], "modeling_file": str(path),
              "equivalent": False, "reason": None, "failures": [], "rewrites_not_run": None,
              "max_output_diff": None, "max_grad_diff": None, "tolerance": {"atol": ATOL, "rtol": RTOL},
              "step_time_before": None, "step_time_after": None,
              "peak_memory_before": None, "peak_memory_after": None}
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp, _quiet_transformers():
        # Same file name as the original: tracebacks and anything keyed on the file name read right.
        overlay_path = os.path.join(tmp, path.name)
        with open(overlay_path, "w", encoding="utf-8") as f:
            f.write(new_text)
        log(f"comparing {model_type}: original vs rewritten ({len(applied)} rewrites)")
        try:
            result.update(_equivalence(model_type, overlay_path))
            ran = result.pop("functions_run", None)
            if ran is not None:
                result["rewrites_not_run"] = _not_run(applied, ran)
            if timing and result["equivalent"]:      # the cost of a wrong rewrite is beside the point
                log(f"timing {result['class']} training steps (2 worker processes)")
                try:
                    result.update(_timing(model_type, result["class"], result["kind"], overlay_path,
                                          TIMING_SIZES[timing_size]))
                except VerifyError as exc:    # keep the comparison; the caller reports this too
                    result["timing_error"] = str(exc)
        finally:
            sys.modules.pop(module_names(model_type)[1], None)
    return result


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' info/warning logging (about a tiny config's defaults) buries the summary."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _equivalence(model_type: str, overlay_path: str) -> dict:
    original_name, _ = module_names(model_type)
    try:
        original = importlib.import_module(original_name)
    except Exception as exc:
        raise VerifyError(f"transformers:{model_type}: the installed {original_name} does not import "
                          f"({_short(exc)})") from None
    try:
        overlay, reason = load_overlay(model_type, overlay_path), None
    except Exception as exc:
        overlay, reason = None, f"the rewritten modeling file does not import ({_short(exc)})"
    name, kind, ref_cls, new_cls = classes(model_type, original, overlay)
    out = {"class": name, "kind": kind}
    if reason is None and new_cls is None:
        reason = f"the rewritten modeling file no longer defines {name}"
    config = tiny_config(model_type, CHECK_SIZE)
    try:
        ref_model = build(ref_cls, config)
        inputs = make_inputs(ref_model, config, kind, CHECK_SIZE)
        ref = run_once(ref_model, inputs)
    except VerifyError:
        raise
    except Exception as exc:
        raise VerifyError(f"transformers:{model_type}: the original {name} fails on a small config "
                          f"({_short(exc)})") from None
    if reason is None:
        reason = _run_rewritten(new_cls, config, ref_model, inputs, out, ref)
    out["reason"] = reason
    out["equivalent"] = reason is None and not out.get("failures")
    if reason is None and out.get("failures"):
        out["reason"] = f"{len(out['failures'])} tensor(s) differ beyond the tolerance"
    return out


def _run_rewritten(new_cls, config, ref_model, inputs, out: dict, ref) -> str | None:
    """Fills `out` with the comparison; returns why the rewritten model could not be compared."""
    try:
        new_model = build(new_cls, config)
    except Exception as exc:
        return f"the rewritten {new_cls.__name__} fails to build ({_short(exc)})"
    state = ref_model.state_dict()
    got = new_model.state_dict()
    missing, extra = sorted(set(state) - set(got)), sorted(set(got) - set(state))
    if missing or extra:
        return (f"the rewrite changed parameter names: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, new {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    try:
        new_model.load_state_dict(state, strict=True)
    except Exception as exc:
        return f"the original weights do not load into the rewritten model ({_short(exc)})"
    try:
        new, ran = functions_run(lambda: run_once(new_model, inputs), sys.modules[new_cls.__module__].__file__)
    except Exception as exc:
        return f"the rewritten {new_cls.__name__} fails forward/backward ({_short(exc)})"
    out.update(compare(ref, new))
    if out["failures"]:         # beyond rounding, or a tensor that is all rounding? (verify_compare.py)
        out.update(compare(ref, new, in_float64(ref_model, inputs, run_once)))
    out["functions_run"] = ran
    return None


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def _counts(names) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return counts


# -- the summary ------------------------------------------------------------------------------------

def summary(result: dict) -> str:
    """What a person reads: which rules fired, whether the model still computes the same, the cost."""
    r = result
    lines = [f"transformers:{r['model_type']}: {r.get('class') or '?'} from {Path(r['modeling_file']).name}"]
    applied = ", ".join(f"{n} x{c}" for n, c in r["rule_counts"].items()) or "none (the file is unchanged)"
    lines.append(f"  rules applied:     {applied}")
    if r["not_applied"]:
        lines.append("  found, not rewritten: " + ", ".join(f"{n} x{c}" for n, c in r["not_applied"].items()))
    verdict = "yes" if r["equivalent"] else "NO"
    lines.append(f"  equivalent:        {verdict}  (fp32, train mode, dropout 0, eager attention; per tensor "
                 f"max|diff| <= {ATOL:g} + {RTOL:g} * max|original|)")
    if r["reason"]:
        lines.append(f"  why not:           {r['reason']}")
    if r.get("rewrites_not_run"):
        lines.append(f"  not covered:       {', '.join(r['rewrites_not_run'])} (rewritten, but the small model "
                     f"never ran it: the comparison says nothing about it)")
    if r["max_output_diff"] is not None:
        lines.append(f"  max output diff:   {r['max_output_diff']:.3g}  (logits or last hidden state, and the loss)")
        lines.append(f"  max grad diff:     {r['max_grad_diff']:.3g}  ({r.get('grads_compared', 0)} parameter grads)")
    if r.get("within_float32_noise"):
        lines.append(f"  within fp32 noise: {', '.join(r['within_float32_noise'][:5])} (all rounding: no further from "
                     f"the original than its own float32 error against float64)")
    for failure in r["failures"][:10]:
        lines.append(f"    {failure}")
    if len(r["failures"]) > 10:
        lines.append(f"    ... and {len(r['failures']) - 10} more")
    if r.get("timing_error"):
        lines.append(f"  timing failed:     {r['timing_error']}")
    if r["step_time_before"] is not None:
        steps = f"median of {MEASURED_STEPS} eager AdamW steps after {WARMUP_STEPS} warm-up"
        lines.append(f"  step time (ms):    before {r['step_time_before']:.1f}  after {r['step_time_after']:.1f}  "
                     f"({_ratio(r['step_time_after'], r['step_time_before'])}; {steps})")
    if r["peak_memory_before"] is not None:
        lines.append(f"  peak RSS (MiB):    before {r['peak_memory_before']:.1f}  after {r['peak_memory_after']:.1f}  "
                     f"({_ratio(r['peak_memory_after'], r['peak_memory_before'])})")
    if r.get("step_memory_before") is not None and r.get("step_memory_after") is not None:
        lines.append(f"  step memory (MiB): before {r['step_memory_before']:.1f}  after {r['step_memory_after']:.1f}  "
                     f"({_ratio(r['step_memory_after'], r['step_memory_before'])}; peak RSS over the built model)")
    if r.get("saved_for_backward_before") is not None and r.get("saved_for_backward_after") is not None:
        lines.append(f"  saved for bwd (MiB): before {r['saved_for_backward_before']:.1f}  after "
                     f"{r['saved_for_backward_after']:.1f}  ({_ratio(r['saved_for_backward_after'], r['saved_for_backward_before'])}; "
                     f"activations autograd keeps, counted exactly)")
    return "\n".join(lines)


def _ratio(after, before) -> str:
    return f"{after / before:.2f}x" if after is not None and before else "n/a"


def _timing(*args, **kwargs):
    """The timing of `verify_timing.py` (kept here under its old name for callers of this module)."""
    from kiln.adopt.verify_timing import timing
    return timing(*args, **kwargs)
