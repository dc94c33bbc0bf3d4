"""The built-in rules over real files of the installed transformers: no crash, the output parses,
a second run changes nothing, the expected locations are found, and rewritten modules compute the
same as the originals."""
import functools
import importlib
import os

import pytest
import torch

from kiln.adopt import rewrite_source
from tests.adopt.helpers import assert_same_training

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(transformers.__file__)

# file -> expected (rule, class, method, rewritten) locations; the rest are reported with a reason
EXPECTED = {
    "activations.py": [
        ("gelu_tanh", "GELUTanh", "_gelu_tanh_python", True),
        ("gelu_tanh", "NewGELUActivation", "forward", True),
        ("gelu_erf", "GELUActivation", "_gelu_python", True),
        ("gelu_tanh", "FastGELUActivation", "forward", True),
    ],
    "models/llama/modeling_llama.py": [
        ("rms_norm", "LlamaRMSNorm", "forward", True),
        ("rope", None, "apply_rotary_pos_emb", True),
        ("swiglu", "LlamaMLP", "forward", True),
        ("sdpa", None, "eager_attention_forward", False),
        ("fused_qkv", "LlamaAttention", "forward", False),
    ],
    "models/t5/modeling_t5.py": [
        ("rms_norm", "T5LayerNorm", "forward", True),
        ("sdpa", None, "eager_attention_forward", False),
        ("fused_qkv", "T5Attention", "forward", False),     # k/v of `kv if cross else hidden_states`
        ("cross_entropy", "T5ForConditionalGeneration", "forward", True),
        ("linear_cross_entropy", "T5ForConditionalGeneration", "forward", False),
        ("cross_entropy", "T5ForSequenceClassification", "forward", True),
        ("cross_entropy", "T5ForTokenClassification", "forward", True),
        ("cross_entropy", "T5ForQuestionAnswering", "forward", True),
        ("cross_entropy", "T5ForQuestionAnswering", "forward", True),
    ],
    "models/gemma/modeling_gemma.py": [
        ("rms_norm", "GemmaRMSNorm", "_norm", True),
        ("linear_gelu", "GemmaMLP", "forward", True),
        ("rope", None, "apply_rotary_pos_emb", True),
        ("sdpa", None, "eager_attention_forward", False),
        ("fused_qkv", "GemmaAttention", "forward", False),
    ],
    "models/gpt2/modeling_gpt2.py": [
        ("sdpa", None, "eager_attention_forward", False),
        ("sdpa", "GPT2Attention", "_upcast_and_reordered_attn", False),
        ("linear_gelu", "GPT2MLP", "forward", True),
        ("cross_entropy", "GPT2DoubleHeadsModel", "forward", True),
        ("cross_entropy", "GPT2DoubleHeadsModel", "forward", True),
        ("linear_cross_entropy", "GPT2DoubleHeadsModel", "forward", False),
        ("cross_entropy", "GPT2ForSequenceClassification", "forward", True),
        ("cross_entropy", "GPT2ForTokenClassification", "forward", True),
        ("cross_entropy", "GPT2ForQuestionAnswering", "forward", True),
        ("cross_entropy", "GPT2ForQuestionAnswering", "forward", True),
    ],
    "models/bert/modeling_bert.py": [
        ("sdpa", None, "eager_attention_forward", False),
        ("fused_qkv", "BertSelfAttention", "forward", False),
        ("dropout_add_layernorm", "BertSelfOutput", "forward", False),
        ("linear_gelu", "BertIntermediate", "forward", True),
        ("dropout_add_layernorm", "BertOutput", "forward", False),
        ("linear_gelu", "BertPredictionHeadTransform", "forward", True),
        ("cross_entropy", "BertForPreTraining", "forward", True),
        ("cross_entropy", "BertForPreTraining", "forward", True),
        ("cross_entropy", "BertForMaskedLM", "forward", True),
        ("cross_entropy", "BertForNextSentencePrediction", "forward", True),
        ("cross_entropy", "BertForSequenceClassification", "forward", True),
        ("cross_entropy", "BertForMultipleChoice", "forward", True),
        ("cross_entropy", "BertForTokenClassification", "forward", True),
        ("cross_entropy", "BertForQuestionAnswering", "forward", True),
        ("cross_entropy", "BertForQuestionAnswering", "forward", True),
    ],
    "models/gpt_neo/modeling_gpt_neo.py": [
        ("sdpa", "GPTNeoSelfAttention", "_attn", False),
        ("fused_qkv", "GPTNeoSelfAttention", "forward", False),
        ("linear_gelu", "GPTNeoMLP", "forward", True),
        ("cross_entropy", "GPTNeoForSequenceClassification", "forward", True),
        ("cross_entropy", "GPTNeoForTokenClassification", "forward", True),
        ("cross_entropy", "GPTNeoForQuestionAnswering", "forward", True),
        ("cross_entropy", "GPTNeoForQuestionAnswering", "forward", True),
    ],
    "models/codegen/modeling_codegen.py": [
        ("sdpa", None, "eager_attention_forward", False),
        ("linear_gelu", "CodeGenMLP", "forward", True),
    ],
}


@functools.lru_cache(maxsize=None)
def _rewrite(relpath):
    path = os.path.join(ROOT, relpath)
    src = open(path).read()
    new, matches = rewrite_source(src, filename=path)
    return src, new, matches


@pytest.mark.parametrize("relpath", sorted(EXPECTED))
def test_real_file(relpath):
    src, new, matches = _rewrite(relpath)
    compile(new, relpath, "exec")
    assert [(m.rule, m.cls, m.method, m.applied) for m in matches] == EXPECTED[relpath]
    assert all(m.reason for m in matches if not m.applied)
    assert (new == src) == (not any(m.applied for m in matches))
    assert rewrite_source(new, filename=os.path.join(ROOT, relpath))[0] == new


def _tiny(model_type, **overrides):
    config = transformers.AutoConfig.for_model(model_type)
    for name, value in dict(hidden_size=16, intermediate_size=24, **overrides).items():
        setattr(config, name, value)
    return config


def _module_from(relpath, text):
    """Execute `text` as the transformers module at `relpath` (so its relative imports work)."""
    name = "transformers." + relpath[:-3].replace("/", ".")
    real = importlib.import_module(name)      # registered, so `inspect` finds the classes' file
    namespace = {"__name__": name, "__package__": real.__package__, "__file__": real.__file__}
    exec(compile(text, real.__file__, "exec"), namespace)
    return type("Namespace", (), namespace)


@pytest.mark.parametrize("relpath, build", [
    ("models/llama/modeling_llama.py", lambda m: m.LlamaRMSNorm(16, eps=1e-6)),
    ("models/t5/modeling_t5.py", lambda m: m.T5LayerNorm(16)),
    ("models/gemma/modeling_gemma.py", lambda m: m.GemmaRMSNorm(16)),
    ("activations.py", lambda m: m.NewGELUActivation()),
    ("activations.py", lambda m: m.FastGELUActivation()),
    ("activations.py", lambda m: m.GELUActivation(use_gelu_python=True)),
    ("activations.py", lambda m: m.GELUTanh(use_gelu_tanh_python=True)),
    # run-time guarded rewrites: act_mul (SiLU by config), linear_act (GELU by config; GPT-2's Conv1D)
    ("models/llama/modeling_llama.py", lambda m: m.LlamaMLP(_tiny("llama"))),
    ("models/llama/modeling_llama.py", lambda m: m.LlamaMLP(_tiny("llama", hidden_act="relu"))),
    ("models/bert/modeling_bert.py", lambda m: m.BertIntermediate(_tiny("bert"))),
    ("models/gpt2/modeling_gpt2.py", lambda m: m.GPT2MLP(32, _tiny("gpt2", n_embd=16, resid_pdrop=0.0))),
    ("models/gemma/modeling_gemma.py", lambda m: m.GemmaMLP(_tiny("gemma"))),
])
def test_rewritten_modules_compute_the_same(relpath, build):
    src, new, _ = _rewrite(relpath)
    ref, rew = build(_module_from(relpath, src)), build(_module_from(relpath, new))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    rew.load_state_dict(ref.state_dict())
    assert_same_training(ref, rew, torch.randn(2, 7, 16), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("relpath", ["models/llama/modeling_llama.py", "models/gpt2/modeling_gpt2.py"])
def test_show_dsl_parses_back(relpath):
    """What --show-dsl prints is DSL text: every structure parses and prints identically."""
    from kiln.adopt.analysis import analyze
    from kiln.adopt.dsl import format_structure, parse

    for fn in analyze(open(os.path.join(ROOT, relpath)).read()).functions:
        text = fn.show()
        [structure] = parse(text, f"{relpath}:{fn.title}")
        assert format_structure(structure.name, structure.params, structure.items) == text
