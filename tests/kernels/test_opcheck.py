"""torch.library.opcheck on every kiln custom op: schema, fake (meta) implementation, autograd
registration and AOT dispatch (with dynamic shapes), a few samples each, fp32 and fp64."""
from __future__ import annotations

import pytest
import torch

import kiln.kernels as K
from kiln.kernels._common import direct
from tests.kernels.refs import strided, transposed

k = torch.ops.kiln
DETERMINISTIC = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# a random op gives different outputs on every call, which the AOT-dispatch test compares
RANDOM = ("test_schema", "test_autograd_registration", "test_faketensor")


def _r(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _plain(*ts):
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in ts]


def samples():
    """(id, op, args, test_utils)."""
    out = []
    for dt in (torch.float32, torch.float64):
        tag = str(dt).split(".")[-1]
        x, r, w, b = _r(3, 5, 16, dtype=dt), _r(3, 5, 16, dtype=dt), _r(16, dtype=dt), _r(16, dtype=dt)
        out += [(f"rms_norm-{tag}", k.rms_norm.default, (x, w, 1e-6), DETERMINISTIC),
                (f"add_rms_norm-{tag}", k.add_rms_norm.default, (x, r, w, 1e-6), DETERMINISTIC)]
        _, rstd = k.rms_norm(*_plain(x, w), 1e-6)
        g = torch.randn(3, 5, 16, dtype=dt)
        out += [(f"rms_norm_backward-{tag}", k.rms_norm_backward.default, (g, None, x.detach(), w.detach(), rstd),
                 DETERMINISTIC),
                (f"rms_norm_backward-residual-{tag}", k.rms_norm_backward.default,
                 (g, torch.randn_like(g), x.detach(), w.detach(), rstd), DETERMINISTIC),
                (f"rms_norm_backward-two-terms-{tag}", k.rms_norm_backward.default,
                 (g, None, x.detach(), w.detach(), rstd, None, torch.randn_like(g)), DETERMINISTIC),
                (f"rms_norm_backward-three-terms-{tag}", k.rms_norm_backward.default,
                 (g, None, x.detach(), w.detach(), rstd, None, torch.randn_like(g), torch.randn_like(g)),
                 DETERMINISTIC)]
        out += [(f"dal-p0-{tag}", k.dropout_add_layer_norm.default, (x, r, w, b, 0.0, 1e-5, True), DETERMINISTIC),
                (f"dal-eval-noaffine-{tag}", k.dropout_add_layer_norm.default, (x, r, None, None, 0.3, 1e-5, False),
                 DETERMINISTIC),
                (f"dal-p03-{tag}", k.dropout_add_layer_norm.default, (x, r, w, b, 0.3, 1e-5, True), RANDOM)]
        _, s, mean, rstd_ln, _ = k.dropout_add_layer_norm(*_plain(x, r, w, b), 0.0, 1e-5, True)
        out += [(f"dal_backward-{tag}", k.dropout_add_layer_norm_backward.default,
                 (g, torch.randn_like(g), s, w.detach(), b.detach(), mean, rstd_ln), DETERMINISTIC),
                (f"dal_backward-noaffine-{tag}", k.dropout_add_layer_norm_backward.default,
                 (g, None, s, None, None, mean, rstd_ln), DETERMINISTIC)]
        out += [(f"ln_backward-{tag}", k.layer_norm_backward.default,
                 (g, None, s, mean, rstd_ln, w.detach(), b.detach()), DETERMINISTIC),
                (f"ln_backward-sums-low-{tag}", k.layer_norm_backward.default,
                 (g, torch.randn_like(g), s, mean, rstd_ln, w.detach(), b.detach(), torch.randn_like(g),
                  torch.float32), DETERMINISTIC),
                (f"ln_backward-noaffine-{tag}", k.layer_norm_backward.default,
                 (g, None, s, mean, rstd_ln, None, None), DETERMINISTIC),
                (f"ln_backward_sums-{tag}", k.layer_norm_backward_sums.default,
                 (g, None, s, mean, rstd_ln, w.detach(), b.detach(), torch.randn_like(g), torch.bfloat16),
                 DETERMINISTIC)]
        gate, up = _r(4, 6, 10, dtype=dt), _r(4, 6, 10, dtype=dt)
        out += [(f"swiglu-{tag}", k.swiglu.default, (gate, up), DETERMINISTIC),
                (f"swiglu_backward-{tag}", k.swiglu_backward.default,
                 (torch.randn(4, 6, 10, dtype=dt), *_plain(gate, up)), DETERMINISTIC)]
        wg, wu = _r(12, 16, dtype=dt), _r(12, 16, dtype=dt)
        _, gate_up = k.swiglu_linear(*_plain(x, wg, wu))
        out += [(f"swiglu_linear-{tag}", k.swiglu_linear.default, (x, wg, wu), DETERMINISTIC),
                (f"swiglu_linear_backward-{tag}", k.swiglu_linear_backward.default,
                 (torch.randn(3, 5, 12, dtype=dt), *_plain(x, wg, wu), gate_up), DETERMINISTIC)]
        wl, bl = _r(20, 16, dtype=dt), _r(20, dtype=dt)
        out += [(f"linear_gelu-{tag}", k.linear_gelu.default, (x, wl, bl, "none"), DETERMINISTIC),
                (f"linear_gelu-tanh-nobias-{tag}", k.linear_gelu.default, (x, wl, None, "tanh"), DETERMINISTIC),
                (f"linear_gelu_backward-{tag}", k.linear_gelu_backward.default,
                 (torch.randn(3, 5, 20, dtype=dt), *_plain(x, wl, bl), "none"), DETERMINISTIC)]
        q, kk = _r(2, 4, 6, 8, dtype=dt), _r(2, 2, 6, 8, dtype=dt)
        cos, sin = torch.randn(2, 1, 6, 8, dtype=dt), torch.randn(2, 1, 6, 8, dtype=dt)
        out += [(f"rope-{tag}", k.rope.default, (q, kk, cos, sin), DETERMINISTIC),
                (f"rope-learned-table-{tag}", k.rope.default, (q, kk, _r(6, 8, dtype=dt), _r(6, 8, dtype=dt)),
                 DETERMINISTIC),
                (f"rope_backward-{tag}", k.rope_backward.default,
                 (torch.randn(2, 4, 6, 8, dtype=dt), torch.randn(2, 2, 6, 8, dtype=dt), cos, sin), DETERMINISTIC)]
        h, wv = _r(2, 7, 16, dtype=dt), _r(30, 16, dtype=dt)
        y = torch.randint(0, 30, (2, 7))
        y[0, :2] = -100
        for red in ("mean", "none"):
            loss, lse = k.linear_cross_entropy(*_plain(h, wv), y, -100, red, 4)
            out += [(f"lce-{red}-{tag}", k.linear_cross_entropy.default, (h, wv, y, -100, red, 4), DETERMINISTIC),
                    (f"lce_backward-{red}-{tag}", k.linear_cross_entropy_backward.default,
                     (torch.randn_like(loss), *_plain(h, wv), y, lse, -100, red, 4), DETERMINISTIC)]
        for red in ("mean", "sum"):
            loss, gh, gw, scale, _ = k.linear_cross_entropy_grads(*_plain(h, wv), y, -100, red, 4)
            out += [(f"lce_grads-{red}-{tag}", k.linear_cross_entropy_grads.default, (h, wv, y, -100, red, 4),
                     DETERMINISTIC),
                    (f"lce_grads_backward-{red}-{tag}", k.linear_cross_entropy_grads_backward.default,
                     (torch.randn_like(loss), gh, gw, scale, dt), DETERMINISTIC)]
            bias = _r(30, dtype=dt)                 # a decoder's bias (BERT's MLM head)
            loss, gh, gw, scale, gb = k.linear_cross_entropy_grads(*_plain(h, wv), y, -100, red, 4, *_plain(bias))
            out += [(f"lce_grads_bias-{red}-{tag}", k.linear_cross_entropy_grads.default,
                     (h, wv, y, -100, red, 4, bias), DETERMINISTIC),
                    (f"lce_grads_bias_backward-{red}-{tag}", k.linear_cross_entropy_grads_backward.default,
                     (torch.randn_like(loss), gh, gw, scale, dt, gb), DETERMINISTIC)]
        logits, yc = _r(7, 30, dtype=dt), y.reshape(-1)[:7]
        for red in ("mean", "sum", "none"):
            loss, lse = k.softmax_cross_entropy(*_plain(logits), yc, -100, red)
            out += [(f"ce-{red}-{tag}", k.softmax_cross_entropy.default, (logits, yc, -100, red), DETERMINISTIC),
                    (f"ce_backward-{red}-{tag}", k.softmax_cross_entropy_backward.default,
                     (torch.randn_like(loss), *_plain(logits), yc, lse, -100, red), DETERMINISTIC)]
        lp = _r(12, 3, 6, dtype=dt).log_softmax(-1).detach().requires_grad_()
        ctc = (torch.randint(1, 6, (3, 5)), torch.tensor([12, 10, 7]), torch.tensor([5, 3, 1]))
        out += [(f"ctc_loss-{red}-{tag}", k.ctc_loss.default, (lp, *ctc, 0, red, True), DETERMINISTIC)
                for red in ("mean", "sum", "none")]
        out += [(f"ctc_loss_backward-{tag}", k.ctc_loss_backward.default,
                 (torch.tensor(1.0, dtype=dt), lp.detach(), *ctc, 0, "mean", False), DETERMINISTIC)]
    # non-contiguous inputs (fp32)
    xs, ws = strided(torch.randn(6, 16)).requires_grad_(), transposed(torch.randn(16, 16)).requires_grad_()
    out += [("rms_norm-strided", k.rms_norm.default, (xs, _r(16), 1e-6), DETERMINISTIC),
            ("swiglu_linear-transposed", k.swiglu_linear.default, (xs, ws, _r(16, 16)), DETERMINISTIC),
            ("linear_gelu-transposed", k.linear_gelu.default, (transposed(torch.randn(5, 4, 16)).requires_grad_(),
                                                                ws, None, "none"), DETERMINISTIC),
            ("rope-transposed", k.rope.default, (_r(2, 6, 3, 8).transpose(1, 2), _r(2, 6, 1, 8).transpose(1, 2),
                                                 torch.randn(6, 8), torch.randn(6, 8)), DETERMINISTIC),
            ("lce-strided", k.linear_cross_entropy.default, (xs, _r(9, 16), torch.randint(0, 9, (6,)), -100,
                                                             "sum", 0), DETERMINISTIC)]
    return out


SAMPLES = samples()


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_opcheck(sample):
    _, op, args, utils = sample
    torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_direct_call_matches_the_dispatcher(sample):
    """What the generated step calls (the op's body, `direct`) returns what the op returns through the dispatcher,
    bit for bit (random ops from the same seed)."""
    _, op, args, _ = sample
    body = direct(op)
    assert body is not None
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.manual_seed(0)
    want = op(*detached)
    torch.manual_seed(0)
    got = body(*detached)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g)


def test_direct_call_refuses_an_aliased_output(monkeypatch):
    """A body returning an input (or one tensor twice) is an error, as it is through the dispatcher."""
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS["kiln::rope"]
    x = torch.randn(2, 3, 4)
    monkeypatch.setattr(opdef, "_init_fn", lambda q, k, cos, sin, out_dtype=None: (q, k.clone()))
    with pytest.raises(RuntimeError, match="kiln::rope: an output aliases an input"):
        direct(K.OPS["rope"])(x, x.clone(), x, x)
    monkeypatch.setattr(opdef, "_init_fn", lambda q, k, cos, sin, out_dtype=None: (q[0].clone(),) * 2)
    with pytest.raises(RuntimeError, match="aliases an input or another output"):
        direct(K.OPS["rope"])(x, x.clone(), x, x)
    monkeypatch.setattr(opdef, "_init_fn", lambda q, k, cos, sin, out_dtype=None: (q.clone(), k.clone()))
    a, b = direct(K.OPS["rope"])(x, x, x, x)
    assert torch.equal(a, x) and torch.equal(b, x)


def test_every_op_has_samples():
    assert {s[1] for s in SAMPLES} == set(K.OPS.values())
