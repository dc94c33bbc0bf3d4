"""The CI sample of the mixed-precision coverage sweep (`python benchmarks/coverage.py --amp bf16`,
docs/model-coverage-bf16.md): Kiln's amp="bf16" first-step gradients must be as close to eager's float64
gradients as eager's own `torch.autocast(bfloat16)` gradients are (`kiln.bench.coverage_amp`). The judge
itself is tested below against hand-made errors of the kinds a mixed-precision bug makes."""
from __future__ import annotations

import pytest
import torch

from kiln.bench import coverage, coverage_amp
from kiln.bench.coverage_configs import Entry

SAMPLE = [
    "llama/LlamaForCausalLM",
    "gpt2/GPT2LMHeadModel",
    "bert/BertForMaskedLM",
    "t5/T5ForConditionalGeneration",
    "vit/ViTForImageClassification",
    "resnet/ResNetForImageClassification",
    "whisper/WhisperForConditionalGeneration",
    "mixtral/MixtralForCausalLM",
]


@pytest.mark.parametrize("key", SAMPLE, ids=[k.split("/")[1] for k in SAMPLE])
def test_sample_architecture_under_bf16(key):
    from kiln.bench.coverage_configs import entries
    entry = next(e for e in entries() if e.key == key)
    r = coverage_amp.run_entry_amp(entry)
    assert r.outcome == "close", f"{key}: {r.outcome} ({r.exception}) {r.why}\n{r.traceback}"
    assert r.param_err <= 1.0


# ---- the judge catches what it must -------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    model, batch, _, loss_fn = coverage.build(Entry("llama", "LlamaForCausalLM", "causal_lm"))
    loss32, truth = coverage_amp._eager_grads(model, batch, loss_fn, autocast=None)
    ref = coverage_amp._eager_grads(model, batch, loss_fn, autocast="bf16")
    return truth, loss32, ref


def _as_kiln(grads: dict, change=None):
    """Gradients as the Kiln side hands them to the judge (delta, spacing), after `change(name, g)`."""
    return {n: ((change(n, g) if change else g) if g is not None else torch.zeros(1, dtype=torch.float64),
                torch.zeros(1, dtype=torch.float64)) for n, g in grads.items()}


def test_autocast_itself_is_close(llama):
    truth, loss32, ref = llama
    err, ratio, why, unjudged = coverage_amp.judge(truth, loss32, ref, (ref[0], _as_kiln(ref[1])))
    assert why == "" and not unjudged and ratio <= 1 / coverage_amp.FACTOR + 1e-9 and err > 0


@pytest.mark.parametrize("kind", ["doubled", "sign", "dropped term", "one layer zero"])
def test_wrong_gradients_of_one_parameter_are_caught(llama, kind):
    truth, loss32, ref = llama
    names = [n for n, t in truth.items() if t is not None and t.norm() > coverage_amp.SMALL * 10]
    victim = names[len(names) // 2]
    other = names[len(names) // 2 + 1]

    def change(n, g):
        if n != victim:
            return g
        if kind == "doubled":
            return 2 * g
        if kind == "sign":
            return -g
        if kind == "dropped term":          # half of the true gradient goes missing
            return g - 0.5 * truth[victim]
        return torch.zeros_like(g)
    _, ratio, why, _ = coverage_amp.judge(truth, loss32, ref, (ref[0], _as_kiln(ref[1], change)))
    assert ratio > 1 and why.startswith(f"gradient of {victim}"), why
    assert other not in why


def test_a_parameter_without_gradient_must_not_move_and_a_wrong_loss_is_caught(llama):
    truth, loss32, ref = llama
    name = next(iter(truth))
    no_grad = dict(truth, **{name: None})
    _, ratio, why, _ = coverage_amp.judge(no_grad, loss32, ref, (ref[0], _as_kiln(ref[1])))
    assert ratio == float("inf") and name in why
    _, _, why, _ = coverage_amp.judge(truth, loss32, ref, (loss32 * 1.1, _as_kiln(ref[1])))
    assert why.startswith("loss")


def test_another_rounding_moves_new_low_precision_results_by_at_most_one_unit():
    torch.manual_seed(0)
    a, b = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    plain = a @ b
    with coverage_amp._Reround(torch.bfloat16, 1):
        moved = a @ b
        view = plain.t()
    ulp = torch.ldexp(torch.ones(()), torch.frexp(plain.float()).exponent - 8)     # bf16: 8 significant bits
    diff = (moved.float() - plain.float()).abs()
    assert (diff <= ulp).all() and (diff > 0).float().mean() > 0.2
    assert view.data_ptr() == plain.data_ptr()                # views are left alone


def test_what_other_roundings_move_autocast_by_is_allowed(llama):
    """A model whose discrete choices flip under another rounding (MoE routing over a few tokens): Kiln's
    gradient, off by as much as autocast's own under another rounding, passes only with that spread."""
    truth, loss32, ref = llama
    victim = max((n for n, t in truth.items() if t is not None), key=lambda n: truth[n].norm())
    flipped = dict(ref[1], **{victim: ref[1][victim] + 0.5 * truth[victim]})
    kiln_side = (ref[0], _as_kiln(flipped))
    assert coverage_amp.judge(truth, loss32, ref, kiln_side)[2].startswith(f"gradient of {victim}")
    calm = (ref[0], dict(ref[1]))
    assert coverage_amp.judge(truth, loss32, ref, kiln_side, [calm, calm])[2].startswith(f"gradient of {victim}")
    assert coverage_amp.judge(truth, loss32, ref, kiln_side, [calm, (ref[0], flipped)])[2] == ""
