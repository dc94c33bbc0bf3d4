"""linear_cross_entropy (chunked) and linear_cross_entropy_grads (the gradient in the forward) vs F.linear +
F.cross_entropy, the tokens they skip, and what they keep for the backward."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels as K
from kiln.kernels import native
from kiln.kernels.cross_entropy import chunk_rows
from tests.kernels import refs
from tests.kernels.refs import BF16, FP32, FP64, LAYOUTS, check


def _labels(shape, vocab, ignored=0.25, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignored] = ignore_index
    return y


def _fused(y, **kw):
    return lambda h, w: K.linear_cross_entropy(h, w, y, **kw)


def _grads(y, ignore_index=-100, reduction="mean", chunk=0):
    return lambda h, w: torch.ops.kiln.linear_cross_entropy_grads(h, w, y, ignore_index, reduction, chunk)[0]


def _ref(y, **kw):
    return lambda h, w: refs.linear_cross_entropy(h, w, y, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [0, 1, 5, 64], ids=lambda c: f"chunk{c}")
def test_reductions_and_chunks_fp32(reduction, chunk):
    """Chunk sizes that divide the tokens, do not, are 1 token, or exceed all tokens (0 = automatic)."""
    h, w, y = torch.randn(2, 13, 24), torch.randn(37, 24) * 0.5, _labels((2, 13), 37)
    check(_fused(y, reduction=reduction, chunk_size=chunk), _ref(y, reduction=reduction), [h, w], FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [0.0, 0.25, 0.9])
def test_grads_reductions(reduction, ignored):
    h, w, y = torch.randn(3, 11, 24), torch.randn(37, 24) * 0.5, _labels((3, 11), 37, ignored=ignored)
    check(_grads(y, reduction=reduction), _ref(y, reduction=reduction), [h, w], FP32)


def test_grads_needs_one_incoming_gradient():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), _labels((4,), 10)
    with pytest.raises(ValueError, match="mean or a sum"):
        _grads(y, reduction="none")(h, w)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 7, 128])
def test_grads_in_chunks(dtype, chunk):
    """Chunks of 1 row, a number that does not divide the tokens, and whole (bf16 sums grad_weight in fp32)."""
    h, w, y = torch.randn(30, 16), torch.randn(37, 16) * 0.5, _labels((30,), 37)
    if dtype == "fp32":
        check(_grads(y, reduction="sum", chunk=chunk), _ref(y, reduction="sum"), [h, w], FP32)
    else:
        check(_grads(y, chunk=chunk), _ref(y), [h.bfloat16(), w.bfloat16()], BF16, ref_dtype=torch.float32)


def test_grads_scale_after_the_loss():
    """The forward's gradients are of the sum, scaled in the backward: a mean over 4096 tokens in fp16 under
    a loss scale of 2**16 has the fp64 reference's gradients (no entry flushed to 0 on the way)."""
    h, w = torch.randn(4096, 8, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64) * 0.1
    y = _labels((4096,), 64, ignored=0.0)
    hf, wf = h.half().requires_grad_(), w.half().requires_grad_()
    (_grads(y)(hf, wf) * 2 ** 16).backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    (refs.linear_cross_entropy(hr, wr, y) * 2 ** 16).backward()
    assert (hf.grad != 0).float().mean() > 0.99
    torch.testing.assert_close(hf.grad.double(), hr.grad, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(wf.grad.double(), wr.grad, rtol=2e-2, atol=1e-1)


def _mm_flops(fn, h, w) -> int:
    """FLOPs of every matrix product run by forward + backward, inside the custom ops too (the profiler
    records the ATen calls their implementations make, with their shapes)."""
    from torch.profiler import profile
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with profile(record_shapes=True) as prof:
        fn(h, w).backward()
    total = 0
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::addmm_"):
            (m, k), (_, n) = e.input_shapes[:2] if e.name == "aten::mm" else e.input_shapes[1:3]
            total += 2 * m * k * n
    return total


@pytest.mark.parametrize("variant", ["chunked", "grads"])
def test_ignored_tokens_cost_no_matmul(variant):
    """Half the labels ignored: half the vocabulary matmuls, forward and backward (eager computes them all)."""
    h, w = torch.randn(64, 16), torch.randn(500, 16)
    every, half = _labels((64,), 500, ignored=0.0), _labels((64,), 500, ignored=0.0)
    half[::2] = -100
    kernel = (lambda y: _fused(y, chunk_size=24)) if variant == "chunked" else _grads
    flops = {name: _mm_flops(kernel(y), h, w) for name, y in (("every", every), ("half", half))}
    assert flops["every"] > 0 and flops["half"] == flops["every"] // 2, flops
    assert _mm_flops(_ref(half), h, w) == _mm_flops(_ref(every), h, w)


def test_nonfinite_hidden_at_an_ignored_token_stays_out_of_the_gradients():
    """An ignored token's hidden row never meets the weight: a padding row of inf gives finite gradients
    (the rows that count are unchanged)."""
    h, w, y = torch.randn(10, 8), torch.randn(30, 8), _labels((10,), 30, ignored=0.0)
    y[3] = -100
    bad = h.clone()
    bad[3] = float("inf")
    for kernel in (_fused(y, chunk_size=4), _grads(y)):
        grads = []
        for x in (h, bad):
            x, wx = x.clone().requires_grad_(), w.clone().requires_grad_()
            kernel(x, wx).backward()
            grads.append((x.grad, wx.grad))
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_hidden_and_weight(layout):
    h, w, y = LAYOUTS[layout](torch.randn(6, 4, 16)), LAYOUTS[layout](torch.randn(50, 16)), _labels((6, 4), 50)
    check(_fused(y, chunk_size=7), _ref(y), [h, w], FP32)


def test_fp64_formula_and_custom_ignore_index():
    h, w = torch.randn(20, 12, dtype=torch.float64), torch.randn(30, 12, dtype=torch.float64)
    y = _labels((20,), 30, ignore_index=3)          # 3 is both a class and the ignored label
    for reduction in ("mean", "sum", "none"):
        check(_fused(y, ignore_index=3, reduction=reduction, chunk_size=6),
              _ref(y, ignore_index=3, reduction=reduction), [h, w], FP64)
        if reduction != "none":
            check(_grads(y, ignore_index=3, reduction=reduction, chunk=6),
                  _ref(y, ignore_index=3, reduction=reduction), [h, w], FP64)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_labels_ignored(reduction):
    """PyTorch: mean is nan (0/0) with zero gradients; sum is 0; none is all zeros."""
    h, w, y = torch.randn(9, 8), torch.randn(11, 8), torch.full((9,), -100)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = refs.linear_cross_entropy(hr, wr, y, reduction=reduction)
    want.sum().backward()
    kernels = [_fused(y, reduction=reduction, chunk_size=4)] + ([_grads(y, reduction=reduction)] if reduction != "none" else [])
    for kernel in kernels:
        hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
        got = kernel(hf, wf)
        torch.testing.assert_close(got, want, equal_nan=True)
        got.sum().backward()
        torch.testing.assert_close(hf.grad, hr.grad, equal_nan=True)
        torch.testing.assert_close(wf.grad, wr.grad, equal_nan=True)
        assert not hf.grad.isnan().any() and not wf.grad.any()


@pytest.mark.parametrize("chunk", [5, 0], ids=["fp32-accumulated-chunks", "one-chunk"])
def test_bf16_loss_is_fp32(chunk):
    h, w, y = torch.randn(12, 16).bfloat16(), (torch.randn(40, 16) * 0.5).bfloat16(), _labels((12,), 40)
    out = check(_fused(y, chunk_size=chunk), _ref(y), [h, w], BF16, ref_dtype=torch.float32)
    assert out[0].dtype == torch.float32
    out = check(_grads(y, chunk=chunk), _ref(y), [h, w], BF16, ref_dtype=torch.float32)
    assert out[0].dtype == torch.float32


def test_chunk_rows_do_not_grow_with_tokens():
    assert chunk_rows(10 ** 6, 32000, 0) == chunk_rows(10 ** 4, 32000, 0) < 10 ** 4
    assert chunk_rows(10 ** 6, 128000, 0) * 128000 <= max(chunk_rows(10 ** 6, 32000, 0) * 32000, 128 * 128000)
    assert chunk_rows(100, 32000, 0) == 100 and chunk_rows(100, 32000, 7) == 7


def test_saves_only_lse():
    h, w, y = torch.randn(64, 16, requires_grad=True), torch.randn(1000, 16, requires_grad=True), _labels((64,), 1000)
    assert refs.saved_bytes(lambda h, w, y: K.linear_cross_entropy(h, w, y), [h, w, y]) == 64 * 4


def test_grads_saves_the_gradients_not_the_logits():
    h, w, y = torch.randn(64, 16, requires_grad=True), torch.randn(1000, 16, requires_grad=True), _labels((64,), 1000)
    fn = lambda h, w, y: torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)[0]   # noqa: E731
    assert refs.saved_bytes(fn, [h, w, y]) == (64 * 16 + 1000 * 16 + 1) * 4
    assert refs.saved_bytes(lambda h, w, y: refs.linear_cross_entropy(h, w, y), [h, w, y]) >= 64 * 1000 * 4


def test_rejects_bad_arguments():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        K.linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="labels"):
        K.linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))


_PEAK = textwrap.dedent("""
    import json, re, sys, torch
    import torch.nn.functional as F
    import kiln.kernels as K
    torch.set_num_threads(1)
    tokens, vocab, chunk, fused = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "fused"
    def loss(h, w, y):
        return K.linear_cross_entropy(h, w, y, chunk_size=chunk) if fused else F.cross_entropy(F.linear(h, w), y)
    def inputs(t, v):
        w = (torch.randn(v, 64) * 0.05).requires_grad_()
        return torch.randn(t, 64, requires_grad=True), w, torch.randint(0, v, (t,))
    loss(*inputs(16, 100)).backward()                # library warm-up
    h, w, y = inputs(tokens, vocab)
    kib = lambda f: int(re.search(f + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    open("/proc/self/clear_refs", "w").write("5")
    base = kib("VmRSS")
    loss(h, w, y).backward()
    print(json.dumps((kib("VmHWM") - base) * 1024))
""")


def _peak(tokens, vocab, variant, chunk=256) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")      # freed buffers leave the process at once
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tokens), str(vocab), str(chunk), variant], env=env,
                         check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs a resettable RSS high-water mark")
def test_peak_memory_does_not_grow_with_tokens_times_vocab():
    """Measured RSS peak of forward+backward (fresh processes): the fused kernel holds a few
    256-token chunks of logits plus the parameter-sized weight gradient; eager holds whole
    (tokens x vocab) logits, their softmax and their gradient."""
    tokens, vocab = 2048, 8192
    logits, chunk, weight_grad = tokens * vocab * 4, 256 * vocab * 4, vocab * 64 * 4     # 64, 8 and 2 MiB
    fused, eager = _peak(tokens, vocab, "fused"), _peak(tokens, vocab, "unfused")
    assert eager > 2 * logits, eager
    assert fused < 3 * chunk + 2 * weight_grad + 4 * 2 ** 20, fused
    # twice the tokens: eager's logits double; the fused peak grows by grad_hidden (2048 x 64 floats) only
    assert _peak(2 * tokens, vocab, "fused") < fused + 3 * 2 ** 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [40, -1])
def test_grads_native_softmax_refuses_labels_outside_the_vocabulary(bad, dtype):
    """The chunks' softmax (bf16 and fp32) runs as the native loop; a label outside [0, vocab) that is not the
    ignore index raises (as ATen's gather does), never counts as ignored."""
    h, w, y = torch.randn(12, 16).to(dtype), (torch.randn(40, 16) * 0.5).to(dtype), _labels((12,), 40)
    y[3] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grads_native_and_aten_softmax_agree(dtype, monkeypatch):
    """Both dtypes' chunks go through the native loop (counted) and give ATen's composition's values."""
    from tests.kernels.test_native import _used
    if native.library() is None:
        pytest.skip("native.c is not built here")
    h, w = torch.randn(64, 16).to(dtype), (torch.randn(300, 16) * 0.5).to(dtype)
    y = _labels((64,), 300)
    calls = _used(monkeypatch, "kiln_ce_grads")
    native_out = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)
    assert calls, "the native softmax did not run"
    monkeypatch.setenv("KILN_NATIVE", "0")
    aten_out = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)
    for a, b in zip(native_out, aten_out):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-2 if a.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [300, 9001])
def test_grads_native_softmax_is_as_close_to_float64_as_aten(vocab, dtype, monkeypatch):
    """The one-call native softmax (max, exp into a row buffer, over the sum) against float64 of the same
    logits, no further than ATen's composition; a vocabulary past its 2048-logit blocks and past 8192 too."""
    torch.manual_seed(3)
    h, w = torch.randn(48, 16).to(dtype), (torch.randn(vocab, 16) * 0.7).to(dtype)
    y = _labels((48,), vocab)
    z = (h.double() @ w.double().t()).to(dtype).double()           # the logits as the product rounds them
    p = torch.softmax(z, -1)
    want_loss = (torch.logsumexp(z, -1) - z[torch.arange(48), y]).mean()
    p[torch.arange(48), y] -= 1
    want_gh, want_gw = p @ w.double(), p.t() @ h.double()
    errs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("KILN_NATIVE", mode)
        loss, gh, gw, scale, _ = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)
        errs[mode] = [(loss.double() - want_loss).abs().item(), (gh.double() * scale.item() * 48 - want_gh).abs().max().item(),
                      (gw.double() - want_gw).abs().max().item()]
    for mine, aten_err, what in zip(errs["1"], errs["0"], ("loss", "grad_hidden", "grad_weight")):
        assert mine <= 1.5 * aten_err + 1e-6, f"{what}: {mine:.3g} against ATen's {aten_err:.3g}"


def test_bf16_grads_native_softmax_keeps_a_nonfinite_row_to_itself(monkeypatch):
    """A token whose logits hold inf (its hidden state overflowed) gets a NaN loss, as ATen's composition gives
    it, and NaN gradient only through its own row."""
    torch.manual_seed(4)
    h, w = torch.randn(12, 16).bfloat16(), (torch.randn(40, 16) * 0.5).bfloat16()
    y = _labels((12,), 40)
    h[5, 2] = float("inf")
    got = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "sum", 0)
    monkeypatch.setenv("KILN_NATIVE", "0")
    want = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "sum", 0)
    assert got[0].isnan() and want[0].isnan()
    assert torch.equal(got[1].isnan().any(-1), want[1].isnan().any(-1))
    assert got[1].isnan().any(-1).tolist() == [i == 5 for i in range(12)]


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_with_a_decoder_bias_against_float64(dtype, native_on, monkeypatch):
    """A decoder's bias (BERT's MLM head) added to the logits as the softmax reads them: loss and the gradients
    of hidden, weight and bias against float64, ignored labels contributing nothing; in bf16 no further from
    float64 than eager autocast's F.linear with the bias and F.cross_entropy."""
    monkeypatch.setenv("KILN_NATIVE", native_on)
    torch.manual_seed(6)
    h, w, bias = torch.randn(48, 16).to(dtype), (torch.randn(40, 16) * 0.5).to(dtype), torch.randn(40).to(dtype)
    y = _labels((48,), 40)
    y[:5] = -100
    loss, gh, gw, scale, gb = torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0, bias)
    s = scale.item()
    hd, wd, bd = (x.double().requires_grad_() for x in (h, w, bias))
    want = F.cross_entropy(hd @ wd.t() + bd, y, ignore_index=-100)
    want.backward()
    got = (loss.double(), gh.double() * s, gw.double() * s, gb.double() * s)
    truth = (want.detach(), hd.grad, wd.grad, bd.grad)
    assert gb.shape == (40,) and gb.dtype == torch.float32 and gh[:5].abs().max().item() == 0
    with pytest.raises(ValueError, match="bias"):
        torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0, bias[:-1])
    if dtype == torch.float32:
        for name, a, b in zip(("loss", "hidden", "weight", "bias"), got, truth):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        return
    he, we, be = (x.detach().clone().requires_grad_() for x in (h, w, bias))
    with torch.autocast("cpu", torch.bfloat16):
        eager = F.cross_entropy(F.linear(he, we, be), y, ignore_index=-100)
    eager.backward()
    theirs = (eager.double(), he.grad.double(), we.grad.double(), be.grad.double())
    for name, a, e, t in zip(("loss", "hidden", "weight", "bias"), got, theirs, truth):
        err, eager_err = (a - t).abs().max().item(), (e - t).abs().max().item()
        assert err <= 1.5 * eager_err + 2 ** -8 * t.abs().max().item(), f"{name}: {err:.3g} against eager's {eager_err:.3g}"


def test_the_bias_gradient_in_a_compiled_step_matches_eager():
    """BERT's MLM decoder: its bias goes into the fused loss (no padded column), and the step trains as eager
    does (fp32, half the labels ignored: tightly; the program holds no product of width hidden + 16)."""
    import kiln
    import transformers

    from tests.passes.test_fuse import _train_like_eager
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=8192, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)          # 128 tokens x 8192 logits: the fused loss's size
    ids = torch.randint(0, 8192, (2, 64))
    kwargs = dict(input_ids=ids, labels=ids.masked_fill(torch.rand(2, 64) < 0.5, -100))
    step = _train_like_eager(model, [kwargs, kwargs],
                             optimizers=lambda: (kiln.optim.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)))
    lce = [n for n in step.graph.nodes if n.op.name == "kiln.linear_cross_entropy_grads"]
    assert len(lce) == 1 and lce[0].args[6] is not None
    assert not any(n.target in (torch.ops.aten.constant_pad_nd.default, torch.ops.aten.cat.default)
                   for n in step.graph.nodes if n.phase.name == "FORWARD" and "cls" in n.scope)
