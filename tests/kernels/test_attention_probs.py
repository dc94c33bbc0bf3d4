"""Attention's probabilities kept from the forward for the backward (kiln/kernels/attention.py
`forward_keeping_probs` / `backward_from_probs`, placed by kiln/passes/keep_probs.py): against float64 autograd
of the same rounded inputs and ATen's CPU flash kernels; the fallbacks where none are kept; the pass's choices
in a compiled step and the step against eager."""
from __future__ import annotations

import pytest
import torch

from kiln.kernels import attention, native
from tests.kernels.test_attention_backward import _truth
from tests.kernels.test_attention_forward import EDGES, _materialized_causal

aten = torch.ops.aten
EPS = torch.finfo(torch.bfloat16).eps
needs_products = pytest.mark.skipif(native.bf16_products() is None,
                                    reason="no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")


def _inputs(b, h, t, s, d, dv, kv_heads=None, seed=3):
    torch.manual_seed(seed)
    hk = kv_heads or h
    q = (torch.randn(b, t, h, d) * 2).bfloat16().transpose(1, 2)         # as projections lay them out
    k = (torch.randn(b, s, hk, d) * 2).bfloat16().transpose(1, 2)
    v = torch.randn(b, s, hk, dv).bfloat16().transpose(1, 2)
    return q, k, v


def _mask(kind, b, h, t, s):
    return {None: None, "bcast": torch.randn(t, s).bfloat16().expand(b, h, t, s),
            "per-head": torch.randn(b, h, t, s).bfloat16(),
            "bool": torch.rand(b, h, t, s) > 0.3}[kind]


def _check_against_truth(got, g, q, k, v, causal, mask, flash=None):
    truth = _truth(g, q, k, v, causal, mask)
    scale = max(x.abs().max().item() for x in truth)
    for i, (name, mine, exact, x) in enumerate(zip("qkv", got, truth, (q, k, v))):
        assert mine.shape == x.shape and mine.dtype == torch.bfloat16 and mine.stride() == x.stride(), name
        err = (mine.double() - exact).abs().max().item()
        bound = (flash[i].double() - exact).abs().max().item() + 2 * EPS * scale if flash else 8 * EPS * scale
        assert err <= bound, f"d{name}: {err:.3g} against {bound:.3g}"


@needs_products
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", EDGES + [dict(t=300, s=300, d=64, dv=64)],
                         ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
def test_kept_probabilities_at_the_edges_of_the_tiles(shape, causal):
    """The forward with P kept gives the plain forward's output and log-sum-exp bit for bit, P itself within one
    bf16 rounding of float64's softmax (0 past each row's keys, up to the even width), and the backward reading P
    is as close to float64 as ATen's flash backward (within a few roundings where flash cannot run: d != dv)."""
    b, h, t, s, d, dv = 2, 3, shape["t"], shape["s"], shape["d"], shape["dv"]
    q, k, v = _inputs(b, h, t, s, d, dv)
    mask = _mask(shape.get("mask") if not causal else None, b, h, t, s)
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, causal, attn_mask=mask)
    plain = attention.flash_forward_math(q, k, v, 0.0, causal, attn_mask=mask)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    assert probs.shape == attention.probs_shape(q.shape, k.shape) and probs.dtype == torch.bfloat16
    z = (q.double() @ k.double().transpose(-1, -2)) / d ** 0.5
    if mask is not None:
        z = z + (torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool
                 else mask.double())
    if causal:
        z = z.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(z, -1)
    torch.testing.assert_close(probs[..., :s].double(), want, rtol=2 * EPS, atol=1e-30)
    assert probs[..., s:].abs().max().item() == 0 if probs.shape[-1] > s else True
    g = torch.randn(out.shape).bfloat16()
    got = attention.backward_from_probs(g, q, k, v, out, lse, probs, 0.0, causal, attn_mask=mask)
    flash = (aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal,
                                                                        attn_mask=mask) if d == dv else None)
    _check_against_truth(got, g, q, k, v, causal, mask, flash)


@needs_products
def test_kept_probabilities_under_a_materialized_causal_mask_with_padding():
    """The mask an exported model passes (causal, materialized; padded keys in one sequence): P is kept for the
    keys each query sees, and the backward from it is as close to float64 as ATen's flash backward."""
    q, k, v = _inputs(2, 3, 40, 40, 16, 16)
    mask = _materialized_causal(2, 40, 40)
    mask[1, :, :, 33:] = float("-inf")
    mask = mask.bfloat16()
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, False, attn_mask=mask)
    assert probs.numel() and torch.triu(probs[..., :40].float(), 1).abs().max().item() == 0
    g = torch.randn(out.shape).bfloat16()
    got = attention.backward_from_probs(g, q, k, v, out, lse, probs, 0.0, False, attn_mask=mask)
    flash = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    _check_against_truth(got, g, q, k, v, False, mask, flash)


@needs_products
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_kept_probabilities_with_fewer_key_value_heads(kv_heads, causal):
    """Grouped- and multi-query attention: P per query head, dK and dV summed back to k's and v's heads."""
    q, k, v = _inputs(2, 4, 20, 20, 16, 16, kv_heads=kv_heads)
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, causal)
    assert probs.shape == (2, 4, 20, 20)
    g = torch.randn(out.shape).bfloat16()
    got = attention.backward_from_probs(g, q, k, v, out, lse, probs, 0.0, causal)
    flash = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal)
    rep = 4 // kv_heads
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    z = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) / 4.0
    if causal:
        z = z.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(z, -1) @ vd.repeat_interleave(rep, 1)).backward(g.double())
    for name, mine, theirs, exact in zip("qkv", got, flash, (qd.grad, kd.grad, vd.grad)):
        assert mine.shape == exact.shape, name
        err, flash_err = ((x.double() - exact).abs().max().item() for x in (mine, theirs))
        assert err <= flash_err + 4 * EPS * exact.abs().max().item(), f"d{name}: {err:.3g} against {flash_err:.3g}"


@needs_products
def test_a_row_with_nothing_to_attend_to_keeps_zeros():
    """Every key masked for one query: its P row is 0 (as its output and log-sum-exp, ATen's convention), and no
    gradient flows through it."""
    q, k, v = _inputs(2, 3, 24, 24, 16, 16)
    mask = torch.zeros(2, 1, 24, 24)
    mask[0, :, 5, :] = float("-inf")
    mask = mask.bfloat16()
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, False, attn_mask=mask)
    assert probs[0, :, 5].abs().max().item() == 0 and lse[0, :, 5].abs().max().item() == 0
    g = torch.randn(out.shape).bfloat16()
    dq, dk, dv = attention.backward_from_probs(g, q, k, v, out, lse, probs, 0.0, False, attn_mask=mask)
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv)) and dq[0, :, 5].abs().max().item() == 0


def test_without_kept_probabilities_the_backward_computes_them(monkeypatch):
    """Where the one-pass kernels do not run (fewer (batch, head) slices than threads, fp32, KILN_NATIVE=0) the
    forward keeps an empty tensor, and the backward given that, or probabilities of another shape, computes them
    as `flash_backward_math` does: the same gradients, bit for bit."""
    q, k, v = _inputs(1, 1, 16, 16, 8, 8)
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, True)
    assert probs.numel() == 0 or native.threads() == 1
    g = torch.randn(out.shape).bfloat16()
    want = attention.flash_backward_math(g, q, k, v, out, lse, 0.0, True)
    for kept in (q.new_empty(0), torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16)):
        got = attention.backward_from_probs(g, q, k, v, out, lse, kept, 0.0, True)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    qf, kf, vf = (x.float() for x in _inputs(2, 3, 16, 16, 8, 8))
    out, lse, probs = attention.forward_keeping_probs(qf, kf, vf, 0.0, False)
    assert probs.numel() == 0
    monkeypatch.setenv("KILN_NATIVE", "0")
    q, k, v = _inputs(2, 3, 16, 16, 8, 8)
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, False)
    assert probs.numel() == 0
    got = attention.backward_from_probs(g.expand(2, 3, 16, 8), q, k, v, out, lse, probs, 0.0, False)
    want = attention.flash_backward_math(g.expand(2, 3, 16, 8), q, k, v, out, lse, 0.0, False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---- the pass, in a compiled step -------------------------------------------------------------------
KEEP, FROM = "attention:keep_probs", "attention:from_probs"


def _labels(step) -> set:
    return {n.impl.label for n in step.graph.nodes if n.op.name.startswith(("kiln.attention", "aten._scaled_dot"))}


@needs_products
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
@pytest.mark.parametrize("kept,kv_heads", [(True, None), (False, None), (True, 1)])
def test_packed_gradients_are_the_concatenation_of_the_transposed_gradients(order, kept, kv_heads):
    """`backward_packed` gives, bit for bit, the concatenation a joined q/k/v projection's model makes of the three
    gradients (each transposed to (batch, tokens, heads x d)) in any order: written in place by the one-pass
    kernel, copied in where another path runs (fewer key/value heads)."""
    b, h, t, d = 2, 4, 40, 16
    q, k, v = _inputs(b, h, t, t, d, d, kv_heads=kv_heads)
    g = torch.randn(b, t, h, d).bfloat16().transpose(1, 2)
    out, lse, probs = attention.forward_keeping_probs(q, k, v, 0.0, True)
    if not kept:
        probs = probs.new_empty(0)
    grads = attention.backward_from_probs(g, q, k, v, out, lse, probs, 0.0, True)
    want = torch.cat([grads[i].transpose(1, 2).reshape(b, t, -1) for i in order], -1)
    (packed,) = attention.backward_packed(g, q, k, v, out, lse, probs, 0.0, True, order=order)
    assert packed.shape == want.shape and packed.is_contiguous()
    assert torch.equal(packed.view(torch.int16), want.view(torch.int16))


def test_a_gpt2_bf16_step_writes_its_attention_gradients_into_the_projections_concatenation():
    """GPT-2's attention splits one joined projection (c_attn): where this machine keeps the probabilities, the
    backward writes its three gradients into that projection's output gradient (no concatenation left in the
    backward), and the step tracks eager autocast as closely as before."""
    from tests.models.reference import sgd_like_eager
    step = sgd_like_eager("gpt2", "bf16")
    packed = [n for n in step.graph.nodes if n.op.name == "kiln.attention_backward_packed"]
    if not attention.keeps_probs_here():
        assert not packed
        return
    assert packed and all(n.impl.label == "attention:packed" for n in packed)
    assert not [n for n in step.graph.nodes if n.target is aten.cat.default and n.phase.value == "backward"]


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_bf16_step_with_kept_probabilities_trains_like_eager(name):
    """Where this machine keeps them, a bf16 step's attention pairs keep their probabilities (the tiny models'
    are small), and the step tracks eager autocast as closely as without them."""
    from tests.models.reference import sgd_like_eager
    step = sgd_like_eager(name, "bf16")
    labels = _labels(step)
    if attention.keeps_probs_here():
        assert labels == {KEEP, FROM}, labels
    else:
        assert not labels & {KEEP, FROM}, labels


class _Attention(torch.nn.Module):
    """One self-attention layer over token embeddings, written with F.scaled_dot_product_attention (no Hugging Face)."""

    def __init__(self, heads=4, head=8, vocab=50):
        super().__init__()
        self.heads, self.head = heads, head
        self.emb = torch.nn.Embedding(vocab, heads * head)
        self.qkv = torch.nn.Linear(heads * head, 3 * heads * head)
        self.out = torch.nn.Linear(heads * head, vocab)

    def forward(self, ids, labels):
        b, t = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, t, 3, self.heads, self.head).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(y.transpose(1, 2).reshape(b, t, -1))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _attention_step(tokens, **kw):
    import kiln
    torch.manual_seed(0)
    model = _Attention()
    ids, labels = torch.randint(0, 50, (2, tokens)), torch.randint(0, 50, (2, tokens))
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), amp="bf16", **kw)
    step(ids, labels)
    return step


@pytest.mark.skipif(not attention.keeps_probs_here(), reason="this machine does not keep attention probabilities")
def test_no_kept_probabilities_under_a_budget_without_the_dialect_or_at_long_sequences():
    """Kept at 32 tokens of head size 8 (P no larger than q, k, v and the output); not under a memory budget,
    with a dialect list without `attention`, or at 40 tokens (P larger): there the pair stays flash's and its
    backward computes P."""
    assert _labels(_attention_step(32)) == {KEEP, FROM}
    assert not _labels(_attention_step(32, memory_budget=0.99)) & {KEEP, FROM}
    assert not _labels(_attention_step(32, dialects=["kiln", "inductor", "sdpa"])) & {KEEP, FROM}
    assert not _labels(_attention_step(40)) & {KEEP, FROM}


@pytest.mark.skipif(not attention.keeps_probs_here(), reason="this machine does not keep attention probabilities")
def test_the_memory_model_counts_the_kept_probabilities(monkeypatch):
    """P is a value of the graph: the activations the prediction keeps for the backward grow by exactly its
    bytes, and a measured replay's peak agrees with the prediction."""
    from kiln.passes import keep_probs
    kept = _attention_step(32)
    probs = [v for n in kept.graph.nodes if n.op.name == "kiln.attention_keeping_probs" for v in n.outputs[2:]]
    assert len(probs) == 1 and probs[0].meta.dtype == torch.bfloat16
    monkeypatch.setattr(keep_probs, "keeps_probs_here", lambda: False)
    plain = _attention_step(32)
    assert not _labels(plain) & {KEEP, FROM}
    assert kept.memory().saved - plain.memory().saved == probs[0].meta.nbytes
    report = kept.memory(measure=True)
    assert abs(report.predicted_peak - report.measured_peak) <= 0.1 * report.measured_peak, str(report)
