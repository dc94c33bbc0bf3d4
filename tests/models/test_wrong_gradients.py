"""Architectures that trained with silently wrong gradients, bisected to the op, and checked both ways:
op by op against torch.autograd, and as tiny models against eager PyTorch.

- FNet mixes tokens with `torch.fft.fftn(h).real`: the complex intermediate was taken for a value that
  carries no gradient, so everything below the Fourier mixing lost that path (complex values and the
  FFT / complex <-> real ops, kiln/ops/spectral.py).
- HRM runs most of its recurrence under `torch.no_grad()`: the export keeps such a block as a
  higher-order op, which the decomposition inlines, so Kiln differentiated through it (the embedding,
  added at every cycle, got 28 % too much gradient). Also `.detach()` and `type_as` fell back.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import kiln.autodiff
from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Phase, Role, TensorMeta
from kiln.passes.dispatch import dispatch
from kiln.runtime.codegen import generate
from tests.models.test_user_models import check_training
from tests.ops.helpers import check_vjp

aten = torch.ops.aten


# ---- op level: gradients through complex values -------------------------------------------------
def _as_real_output(o):
    """The op's output as what the test loss reads: real, (..., 2) for a complex one."""
    return torch.view_as_real(o.resolve_conj().resolve_neg()) if o.is_complex() else o


def _emit_as_real_output(b, o, concrete):
    if concrete.is_conj():
        o = b(aten.resolve_conj.default, o)
    if concrete.is_neg():
        o = b(aten.resolve_neg.default, o)
    return b(aten.view_as_real.default, o) if concrete.is_complex() else o


def complex_vjp(target, args, kwargs=None, *, fallback=False, direct=False, rtol=1e-6, atol=1e-8):
    """Check Kiln's gradients of L = sum_i sum(as_real(out_i) * cot_i) (+ sum(p * c) per parameter
    with `direct`) against torch.autograd. Every floating and complex tensor in (args, kwargs) is a
    parameter; a complex one is held as its (..., 2) real view and turned complex by view_as_complex,
    in both Kiln's graph and torch's. `fallback`: whether Kiln is expected to use the autograd fallback."""
    kwargs = kwargs or {}
    gen = torch.Generator().manual_seed(7)
    leaves = []                                            # the real parameters

    def leaf(t):
        if t.is_complex():
            leaves.append(torch.view_as_real(t).clone())
        elif t.is_floating_point():
            leaves.append(t.clone())
        return t

    pytree.tree_map_only(torch.Tensor, leaf, (args, kwargs))
    with torch.no_grad():
        outs = target(*args, **kwargs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    differentiable = [o.is_floating_point() or o.is_complex() for o in outs]
    cots = [torch.randn(_as_real_output(o).shape, generator=gen, dtype=torch.float64).to(_as_real_output(o).dtype)
            if d else None for o, d in zip(outs, differentiable)]
    direct_cots = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in leaves]

    # torch
    want_leaves = [p.clone().requires_grad_() for p in leaves]
    it = iter(want_leaves)

    def torch_arg(t):
        if t.is_complex():
            return torch.view_as_complex(next(it))
        return next(it) if t.is_floating_point() else t

    with torch.enable_grad():
        targs, tkwargs = pytree.tree_map_only(torch.Tensor, torch_arg, (args, kwargs))
        touts = target(*targs, **tkwargs)
        touts = list(touts) if isinstance(touts, (list, tuple)) else [touts]
        loss = sum((_as_real_output(o) * c).sum() for o, c in zip(touts, cots) if c is not None)
        if direct:
            loss = loss + sum((p * c).sum() for p, c in zip(want_leaves, direct_cots))
        want = torch.autograd.grad(loss, want_leaves, allow_unused=True)

    # Kiln
    graph = Graph()
    b = Builder(graph, Phase.FORWARD)
    concrete, params = [], []
    it = iter(leaves)

    def kiln_arg(t):
        name = f"x{len(concrete)}"
        if not (t.is_complex() or t.is_floating_point()):
            concrete.append(t)
            return graph.add_input(name, TensorMeta.of(t), Role.INPUT, name)
        p = next(it)
        v = graph.add_input(name, TensorMeta.of(p), Role.PARAM, name)
        concrete.append(p)
        params.append(v)
        return b(aten.view_as_complex.default, v) if t.is_complex() else v

    vargs, vkwargs = pytree.tree_map_only(torch.Tensor, kiln_arg, (tuple(args), dict(kwargs)))
    vouts = b.emit(target, vargs, vkwargs)
    vouts = list(vouts) if isinstance(vouts, (list, tuple)) else [vouts]
    kloss = None
    terms = [(_emit_as_real_output(b, vo, o), c) for vo, o, c in zip(vouts, outs, cots) if c is not None]
    if direct:
        terms += list(zip(params, direct_cots))
    for i, (r, c) in enumerate(terms):
        cv = graph.add_input(f"cot{i}", TensorMeta.of(c), Role.INPUT, f"cot{i}")
        concrete.append(c)
        term = b(aten.sum.default, b(aten.mul.Tensor, r, cv))
        kloss = term if kloss is None else b(aten.add.Tensor, kloss, term)
    graph.outputs = [kloss]
    grads = kiln.autodiff.differentiate(graph, kloss, params)
    have = [p for p in params if p in grads]
    graph.outputs = [kloss] + [grads[p] for p in have]
    dispatch(graph, ("aten",))
    source, fn = generate(graph, "complex_vjp_step", return_all=True)
    used_fallback = any(n.op.name.startswith("kiln.fallback") for n in graph.nodes)
    assert used_fallback == fallback, \
        f"{target}: expected {'the fallback' if fallback else 'the VJP rules'}, got the other:\n{source}"
    with torch.no_grad():
        result = fn(*concrete)
    got = dict(zip(have, result[1:]))
    torch.testing.assert_close(result[0], loss.detach(), rtol=rtol, atol=atol)
    for i, (p, w) in enumerate(zip(params, want)):
        g = got.get(p)
        g = torch.zeros_like(leaves[i]) if g is None else g
        w = torch.zeros_like(leaves[i]) if w is None else w
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{target}: gradient of input {i}: {m}")


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _c(*shape, seed=0):
    return torch.complex(_r(*shape, seed=seed), _r(*shape, seed=seed + 100))


FFT_CASES = [
    # (id, op, args, kwargs)
    ("fftn-real-fnet", aten.fft_fftn.default, (_r(2, 4, 6), None, [1, 2]), {}),
    ("fftn-complex-ortho", aten.fft_fftn.default, (_c(3, 4),), {"norm": "ortho"}),
    ("fft-real-forward", aten.fft_fft.default, (_r(3, 8),), {"norm": "forward"}),
    ("fft-complex", aten.fft_fft.default, (_c(3, 5),), {}),
    ("ifft-complex-dim0", aten.fft_ifft.default, (_c(3, 5),), {"dim": 0}),
    ("ifft-real", aten.fft_ifft.default, (_r(4, 6),), {}),
    ("fft2-ortho", aten.fft_fft2.default, (_c(2, 4, 6),), {"norm": "ortho"}),
    ("ifft2", aten.fft_ifft2.default, (_c(4, 6),), {}),
    ("ifftn-dims-forward", aten.fft_ifftn.default, (_c(2, 3, 4),), {"dim": [0, 2], "norm": "forward"}),
    ("fft-n-equal", aten.fft_fft.default, (_c(3, 5), 5), {}),
    ("rfft-even", aten.fft_rfft.default, (_r(3, 8),), {}),
    ("rfft-odd-ortho", aten.fft_rfft.default, (_r(3, 7),), {"norm": "ortho"}),
    ("rfft-dim0", aten.fft_rfft.default, (_r(6, 3),), {"dim": 0}),
    ("rfft2", aten.fft_rfft2.default, (_r(2, 4, 6),), {}),
    ("rfftn-dims-forward", aten.fft_rfftn.default, (_r(2, 4, 5),), {"dim": [0, 2], "norm": "forward"}),
    ("irfft", aten.fft_irfft.default, (_c(3, 5),), {}),
    ("irfft-odd-n", aten.fft_irfft.default, (_c(3, 5), 9), {}),
    ("irfft-dim0-ortho", aten.fft_irfft.default, (_c(5, 3),), {"dim": 0, "norm": "ortho"}),
    ("irfft2", aten.fft_irfft2.default, (_c(2, 4, 4),), {}),
    ("irfftn-s", aten.fft_irfftn.default, (_c(3, 4), [3, 7]), {}),
    ("_fft_c2c", aten._fft_c2c.default, (_c(3, 4), [0, 1], 1, True), {}),
    ("_fft_c2c-inverse", aten._fft_c2c.default, (_c(3, 4), [1], 2, False), {}),
    ("_fft_r2c-onesided", aten._fft_r2c.default, (_r(3, 6), [1], 0, True), {}),
    ("_fft_r2c-full", aten._fft_r2c.default, (_r(3, 5), [0, 1], 2, False), {}),
    ("_fft_c2r", aten._fft_c2r.default, (_c(3, 5), [1], 2, 8), {}),
    ("_fft_c2r-odd", aten._fft_c2r.default, (_c(3, 5), [0, 1], 0, 9), {}),
]


@pytest.mark.parametrize("op,args,kwargs", [c[1:] for c in FFT_CASES], ids=[c[0] for c in FFT_CASES])
def test_fft_vjp(op, args, kwargs):
    complex_vjp(op, args, kwargs)


@pytest.mark.parametrize("op,args,kwargs", [
    (aten.fft_fft.default, (_r(3, 6), 8), {}),                       # zero-padded signal
    (aten.fft_rfft.default, (_r(3, 8), 6), {}),                      # trimmed signal
    (aten.fft_irfftn.default, (_c(3, 4), [3, 9]), {}),
], ids=["fft-padded", "rfft-trimmed", "irfftn-padded"])
def test_fft_with_padding_or_trimming_uses_the_fallback(op, args, kwargs):
    complex_vjp(op, args, kwargs, fallback=True)


COMPLEX_CASES = [
    ("view_as_complex", aten.view_as_complex.default, (_r(3, 4, 2),), {}),
    ("complex", aten.complex.default, (_r(3, 4), _r(3, 4, seed=1)), {}),
    ("real", aten.real.default, (_c(3, 4),), {}),
    ("imag", aten.imag.default, (_c(3, 4),), {}),
    ("_conj", aten._conj.default, (_c(3, 4),), {}),
    ("conj_physical", aten.conj_physical.default, (_c(3, 4),), {}),
    ("_neg_view", aten._neg_view.default, (_c(3, 4),), {}),
    ("mul-complex", aten.mul.Tensor, (_c(3, 4), _c(3, 4, seed=1)), {}),
    ("mul-real-complex", aten.mul.Tensor, (_r(3, 4), _c(3, 4, seed=1)), {}),
    ("mul-complex-scalar", aten.mul.Tensor, (_c(3, 4), 1.5 - 2j), {}),
    ("div-complex", aten.div.Tensor, (_c(3, 4), _c(3, 4, seed=1)), {}),
    ("div-real-by-complex", aten.div.Tensor, (_r(3, 4), _c(3, 4, seed=1)), {}),
    ("add-alpha", aten.add.Tensor, (_c(3, 4), _c(3, 4, seed=1)), {"alpha": 2}),
    ("sub-real-complex", aten.sub.Tensor, (_c(3, 4), _r(3, 4, seed=1)), {}),
    ("exp", aten.exp.default, (_c(3, 4),), {}),
    ("log", aten.log.default, (_c(3, 4),), {}),
    ("log1p", aten.log1p.default, (_c(3, 4),), {}),
    ("sqrt", aten.sqrt.default, (_c(3, 4),), {}),
    ("rsqrt", aten.rsqrt.default, (_c(3, 4),), {}),
    ("reciprocal", aten.reciprocal.default, (_c(3, 4),), {}),
    ("sin", aten.sin.default, (_c(3, 4),), {}),
    ("cos", aten.cos.default, (_c(3, 4),), {}),
    ("tanh", aten.tanh.default, (_c(3, 4),), {}),
    ("sigmoid", aten.sigmoid.default, (_c(3, 4),), {}),
    ("pow2", aten.pow.Tensor_Scalar, (_c(3, 4), 2), {}),
    ("pow3", aten.pow.Tensor_Scalar, (_c(3, 4), 3), {}),
    ("abs", aten.abs.default, (_c(3, 4),), {}),
    ("mm", aten.mm.default, (_c(3, 4), _c(4, 5, seed=1)), {}),
    ("bmm", aten.bmm.default, (_c(2, 3, 4), _c(2, 4, 5, seed=1)), {}),
    ("addmm", aten.addmm.default, (_c(3, 5, seed=2), _c(3, 4), _c(4, 5, seed=1)), {"alpha": 0.5}),
    ("linear", aten.linear.default, (_c(3, 4), _c(5, 4, seed=1), _c(5, seed=2)), {}),
    ("sum", aten.sum.default, (_c(3, 4),), {}),
    ("to-complex", aten._to_copy.default, (_r(3, 4),), {"dtype": torch.complex128}),
    ("to-real", aten._to_copy.default, (_c(3, 4),), {"dtype": torch.float64}),
]


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("op,args,kwargs", [c[1:] for c in COMPLEX_CASES], ids=[c[0] for c in COMPLEX_CASES])
def test_complex_vjp(op, args, kwargs):
    complex_vjp(op, args, kwargs)


@pytest.mark.parametrize("op,args", [
    (aten.sgn.default, (_c(3, 4),)),                 # z / |z|: no complex rule in Kiln
    (aten.angle.default, (_c(3, 4),)),
    (aten.polar.default, (_r(3, 4).abs(), _r(3, 4, seed=1))),
    (aten.pow.Tensor_Tensor, (_c(3, 4), _c(3, 4, seed=1))),
    (aten.exp.default, (_r(3, 4),)),                 # (a real one for contrast: no fallback)
], ids=["sgn", "angle", "polar", "pow-tensor", "exp-real"])
def test_complex_ops_without_a_complex_rule_take_the_autograd_fallback(op, args):
    complex_vjp(op, args, fallback=op is not aten.exp.default)


# ---- op level: no-gradient ops ------------------------------------------------------------------
def test_detach_has_no_gradient_and_no_fallback():
    complex_vjp(aten.detach.default, (_r(3, 4),), direct=True)


def test_type_as_rule():
    check_vjp(aten.type_as.default, (_r(3, 4).float(), _r(2, seed=1)), rtol=1e-6, atol=1e-7)
    check_vjp(aten.type_as.default, (_r(3, 4), _r(2, seed=1).float()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,args", [
    (aten.broadcast_tensors.default, ([_r(3, 1), _r(1, 4, seed=1), _r(4, seed=2)],)),
    (aten.mse_loss.default, (_r(3, 4), _r(3, 4, seed=1))),
    (aten.smooth_l1_loss.default, (_r(3, 4), _r(3, 4, seed=1), 0, 0.5)),
    (aten.huber_loss.default, (_r(3, 4), _r(3, 4, seed=1), 2, 0.7)),
], ids=["broadcast_tensors", "mse_loss", "smooth_l1_loss", "huber_loss"])
def test_rules_that_user_models_need(op, args):
    """F.mse_loss & co. broadcast their operands first; the target's gradient is the input's negative."""
    check_vjp(op, args, rtol=1e-6, atol=1e-7)


def covered_ops() -> set[str]:
    """The ops whose VJP rules this file checks against torch.autograd (for test_every_rule_is_checked)."""
    from kiln.ops.registry import lookup
    ops = [c[1] for c in FFT_CASES + COMPLEX_CASES] + [
        aten.view_as_real.default, aten.resolve_conj.default, aten.type_as.default, aten.broadcast_tensors.default]
    return {lookup(t).name for t in ops}


# ---- tiny models ------------------------------------------------------------------------------
def _tokens(vocab=100, shape=(2, 8), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_fnet_trains_like_eager():
    from transformers import FNetConfig, FNetForMaskedLM
    cfg = FNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     hidden_dropout_prob=0.0, max_position_embeddings=64)
    ids = _tokens()
    check_training(lambda: FNetForMaskedLM(cfg), input_ids=ids, labels=ids, steps=0)


def test_hrm_text_trains_like_eager():
    from transformers import HrmTextConfig, HrmTextForCausalLM
    # L_cycles=2, L_bp_cycles=[1]: the first low cycle runs under torch.no_grad(), the second with
    # gradients, then the high cycle; the embedding is added to the input of all three
    cfg = HrmTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, head_dim=16, max_position_embeddings=64, H_cycles=1, L_cycles=2,
                        L_bp_cycles=[1])
    ids = _tokens()
    check_training(lambda: HrmTextForCausalLM(cfg), input_ids=ids, labels=ids, steps=0)


class SpectralFilter(nn.Module):
    """A learned filter in the frequency domain (FNO / GFNet style): complex weights from real ones."""

    def __init__(self, t=8, d=6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(t // 2 + 1, d, 2) * 0.3)
        self.wr, self.wi = nn.Parameter(torch.randn(t, d) * 0.3), nn.Parameter(torch.randn(t, d) * 0.3)
        self.out = nn.Linear(d, 1)

    def forward(self, x):                                   # x: (B, T, D)
        h = self.inp(x)
        h = torch.fft.irfft(torch.fft.rfft(h, dim=1) * torch.view_as_complex(self.w), n=h.shape[1], dim=1)
        z = torch.fft.fft(h, dim=1, norm="ortho") * torch.complex(self.wr, self.wi)
        h = h + torch.fft.ifft(z, dim=1, norm="ortho").real + z.abs()
        return self.out(torch.tanh(h)).pow(2).mean()


def test_spectral_filter_with_complex_weights():
    check_training(SpectralFilter, torch.randn(3, 8, 6))


class PhaseNet(nn.Module):
    """Ops with no complex rule in Kiln (angle, polar): the autograd fallback must take them, right."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):
        z = torch.fft.fft(self.a(x), dim=-1)
        h = torch.view_as_real(torch.polar(z.abs(), z.angle() * 0.5)).sum(-1)
        return self.b(h).pow(2).mean()


def test_complex_ops_without_rules_train_like_eager():
    check_training(PhaseNet, torch.randn(4, 6), fallbacks=True)


class NoGradRecurrence(nn.Module):
    """HRM's trick in a few lines: the first iterations run without gradients, the last with them."""

    def __init__(self, d=8):
        super().__init__()
        self.emb, self.cell, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x, loops: int = 3):
        e = self.emb(x)
        z = torch.zeros_like(e)
        with torch.no_grad():
            for _ in range(loops - 1):
                z = torch.tanh(self.cell(z + e))
        z = torch.tanh(self.cell(z + e))
        return self.out(z).pow(2).mean() + 0.1 * (z.detach() * e).mean()


def test_no_grad_block_and_detach():
    check_training(NoGradRecurrence, torch.randn(4, 8))


class NestedGradModes(nn.Module):
    """enable_grad inside no_grad: only the inner block carries gradient, also out of the outer block."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        with torch.no_grad():
            h = torch.tanh(self.a(x))                 # no gradient
            with torch.enable_grad():
                k = torch.tanh(self.b(h))             # gradient to b only
            m = k * 2.0                               # no gradient
        return k.pow(2).mean() + (m * self.c(x)).mean()


def test_enable_grad_inside_no_grad():
    check_training(NestedGradModes, torch.randn(4, 8))


class EinsumAttention(nn.Module):
    """XLNet / CvT style: scores and mixing by einsum, a squared penalty; no Kiln rule for einsum or
    square, which PyTorch defines as composites: written out at capture, eager's own backward."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads) for f in (self.q, self.k, self.v))
        scores = torch.einsum("bind,bjnd->bnij", q, k).softmax(-1)
        out = torch.einsum("bnij,bjnd->bind", scores, v).reshape(b, t, d)
        return out.square().mean()


def test_composites_without_rules_are_written_out_not_fallen_back():
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    step = check_training(EinsumAttention, x, loss_fn=lambda m, x: m(x))
    names = {n.op.name for n in step.graph.nodes}
    assert "kiln.fallback_forward" not in names and "aten.einsum" not in names and "aten.bmm" in names


class DetachedPositions(nn.Module):
    """Kosmos-2.5: sinusoidal positions are `.detach()`ed, then a learned segment embedding is added in
    place; in eager the embedding gets a gradient (functionalization replayed the detach and cut it)."""

    def __init__(self, into_view=False, read_base_later=False):
        super().__init__()
        self.segment = nn.Embedding(2, 4)
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(16, 4))
        self.into_view, self.read_base_later = into_view, read_base_later

    def forward(self, ids):
        base = self.table.index_select(0, ids.view(-1)).view(*ids.shape, 4)
        pos = base.detach()
        if self.into_view:
            pos[:, 0] += self.segment(torch.zeros(ids.shape[0], dtype=torch.long))
        else:
            pos += self.segment(torch.zeros(ids.shape[0], 1, dtype=torch.long))
        out = self.proj(pos).square().mean()
        return out + base.mean() if self.read_base_later else out


@pytest.mark.parametrize("into_view", [False, True])
def test_in_place_update_of_a_detached_tensor_keeps_its_gradient(into_view):
    ids = _tokens(vocab=16, shape=(2, 5))
    check_training(lambda: DetachedPositions(into_view), ids, loss_fn=lambda m, x: m(x))


def test_in_place_update_of_a_detached_alias_read_later_is_refused():
    model = DetachedPositions(read_base_later=True)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=lambda m, x: m(x))
    with pytest.raises(kiln.KilnError, match=r"detach\(\)`ed tensor.*DetachedPositions.*test_wrong_gradients.py"):
        step(_tokens(vocab=16, shape=(2, 5)))
