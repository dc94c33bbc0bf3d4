"""Residual gradients' sums folded into rms_norm_backward (kiln/passes/accumulate.py): the same bits as the
add it replaces, checked on hand-built graphs against PyTorch and on whole Llama steps."""
from __future__ import annotations

import copy

import torch

import kiln
import kiln.kernels  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.passes.accumulate import fold_accumulation
from tests.passes.graphs import aten, count, graph_with_inputs, run

kiln_ops = torch.ops.kiln


def _graph(dtype=torch.float32, broadcast=False, other_after=False, read_alone=False):
    torch.manual_seed(0)
    g_out, x = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    w, other = torch.rand(32) + 0.5, torch.randn(6, 32) if broadcast else torch.randn(4, 6, 32)
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    tensors = (g_out, x, w, rstd, other.to(dtype))
    g, b, (gv, xv, wv, rv, ov) = graph_with_inputs(*tensors)
    gi, _gw, _low = b(kiln_ops.rms_norm_backward.default, gv, None, xv, wv, rv)
    if other_after:
        ov = b(aten.mul.Tensor, ov, 1.0)                    # computed after the kernel
    s = b(aten.add.Tensor, gi, ov)
    g.outputs = [s, gi] if read_alone else [s]
    return g, tensors


def test_the_sum_becomes_the_kernels_grad_sum_with_the_same_bits():
    g, tensors = _graph()
    g_out, x, w, rstd, other = tensors
    gi_ref = torch.ops.kiln.rms_norm_backward(g_out, None, x, w, rstd)[0]
    assert fold_accumulation(g) == 1 and count(g, aten.add.Tensor) == 0
    (n,) = [n for n in g.nodes if n.target is kiln_ops.rms_norm_backward.default]
    assert n.args[1] is g.inputs[4]
    got = run(g, *tensors)
    assert torch.equal(got, gi_ref + other)


def test_the_sum_stays_where_folding_would_change_bits_or_order():
    for kwargs in (dict(dtype=torch.bfloat16), dict(broadcast=True), dict(other_after=True), dict(read_alone=True)):
        g, _ = _graph(**kwargs)
        assert fold_accumulation(g) == 0, kwargs
        assert count(g, aten.add.Tensor) == 1


def test_llama_steps_fold_every_residual_sum_and_train_bit_for_bit_as_with_the_adds(monkeypatch):
    """fp32 and bf16 Llama: the residual gradients' adds after a norm's backward go into the kernel (and in
    bf16 their casts into its bf16 copy); losses and parameters after 3 steps are the same bits as the
    program with the adds (the program's parity with eager is tests/models)."""
    import kiln.passes.pipeline as pipeline
    from tests.models import zoo
    model, _args, batch, _loss = zoo.llama()
    real = pipeline.fold_accumulation

    def train(fold: bool, amp):
        monkeypatch.setattr(pipeline, "fold_accumulation", real if fold else (lambda graph, dialects=None: 0))
        m = copy.deepcopy(model)
        step = kiln.compile(m, optimizer=kiln.optim.AdamW(lr=1e-3), amp=amp, dialects=["kiln", "sdpa", "aten"])
        losses = [step(**batch).item() for _ in range(3)]
        return step.last.graph, losses, [p.detach().clone() for p in m.parameters()]

    for amp in (None, "bf16"):
        g1, l1, p1 = train(True, amp)
        g0, l0, p0 = train(False, amp)
        assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0)), amp
        taking = [n for n in g1.nodes if n.target is kiln_ops.rms_norm_backward.default and n.args[1] is not None]
        norms = [n for n in g1.nodes if n.target is kiln_ops.rms_norm_backward.default]
        assert len(taking) >= len(norms) - 1 >= 1, (len(taking), len(norms))
        casts = lambda g: sum(n.target is aten._to_copy.default and n.phase.name == "BACKWARD" for n in g.nodes)  # noqa
        assert casts(g1) <= casts(g0), amp


# ---- bias gradients' sums into the GELU backward (fold_column_sums) ------------------------------------
def _gelu_graph(dims=(0,), keepdim=False, dtype=None, flatten=True, approximate="none", fp32=False):
    torch.manual_seed(0)
    g_out, x = torch.randn(4, 6, 32).bfloat16(), (torch.randn(4, 6, 32) * 2).bfloat16()
    if fp32:                        # fp32 steps keep ATen's ops (eager's bits)
        g_out, x = g_out.float(), x.float()
    g, b, (gv, xv) = graph_with_inputs(g_out, x)
    d = b(aten.gelu_backward.default, gv, xv, approximate=approximate)
    src = b(aten.view.default, d, [24, 32]) if flatten else d
    extra = {"dtype": dtype} if dtype is not None else {}
    s = b(aten.sum.dim_IntList, src, list(dims), keepdim, **extra)
    g.outputs = [s, d]
    return g, (g_out, x)


def test_a_bias_sum_of_the_gelu_backward_becomes_its_twins_output():
    from kiln.passes.accumulate import fold_column_sums
    for kw in (dict(), dict(keepdim=True), dict(flatten=False, dims=(0, 1)), dict(flatten=False, dims=(-3, -2)),
               dict(approximate="tanh")):
        g, (g_out, x) = _gelu_graph(**kw)
        want_d = aten.gelu_backward(g_out, x, approximate=kw.get("approximate", "none"))
        want_s = want_d.double().reshape(-1, 32).sum(0)
        assert fold_column_sums(g, ("kiln", "aten")) == 1, kw
        assert count(g, aten.sum.dim_IntList) == 0 and count(g, aten.gelu_backward.default) == 0
        from kiln.passes.dispatch import dispatch
        from kiln.runtime.codegen import generate
        dispatch(g, ("kiln", "aten"))
        s, d = generate(g, return_all=True)[1](g_out, x)
        torch.testing.assert_close(d, want_d, rtol=2 ** -7, atol=1e-6)     # a bf16 rounding at most
        assert s.shape == ((1, 32) if kw.get("keepdim") else (32,)) and s.dtype == torch.bfloat16
        torch.testing.assert_close(s.double().reshape(-1), d.double().reshape(-1, 32).sum(0), rtol=2 ** -8, atol=1e-6)
        torch.testing.assert_close(s.double().reshape(-1), want_s, rtol=2 ** -6, atol=1e-2)


def test_other_sums_and_other_dialects_stay_as_they_are():
    from kiln.passes.accumulate import fold_column_sums
    for kw in (dict(flatten=False, dims=(0,)), dict(dims=(1,)), dict(dtype=torch.float64), dict(fp32=True)):
        g, _ = _gelu_graph(**kw)
        assert fold_column_sums(g, ("kiln", "aten")) == 0, kw
    g, _ = _gelu_graph()
    assert fold_column_sums(g, ("aten",)) == 0          # no dialect runs the twin


def test_gpt2_and_bert_steps_fold_their_mlp_bias_sums_and_train_like_eager():
    """The MLPs' bias gradients come from the GELU backward's twin in bf16 steps (fp32 ones keep ATen's ops), and
    both track eager (autocast in bf16) as the unfolded program does."""
    from tests.models.reference import sgd_like_eager
    for name in ("gpt2", "bert"):
        for amp in (None, "bf16"):
            step = sgd_like_eager(name, amp)
            twins = [n for n in step.graph.nodes if n.op.name == "kiln.gelu_backward_sums"]
            assert (bool(twins) == (amp is not None)) and all(len(n.outputs) == 2 for n in twins), (name, amp)


# ---- a tied embedding's two gradients (embedding_dense_backward's `accumulating` twin) ---------------------
def _embedding_graph(dtype=torch.float32, other_after=False, read_alone=False, swap=False, padding_idx=-1):
    torch.manual_seed(0)
    grad, ids = torch.randn(3, 40, 16) * 100, torch.randint(0, 12, (3, 40))
    other = torch.randn(12, 16)
    other[0, :4] = -0.0                                     # -0 + an unnamed row's 0 is +0, as ATen's add makes it
    tensors = (grad.to(dtype), ids, other.to(dtype))
    g, b, (gv, iv, ov) = graph_with_inputs(*tensors)
    e = b(aten.embedding_dense_backward.default, gv, iv, 12, padding_idx, False)
    if other_after:
        ov = b(aten.mul.Tensor, ov, 1.0)                    # computed after the embedding's backward
    s = b(aten.add.Tensor, *((ov, e) if swap else (e, ov)))
    g.outputs = [s, e] if read_alone else [s]
    return g, tensors


def test_a_tied_embeddings_sum_becomes_the_twin_with_the_same_bits():
    from kiln.passes.dispatch import dispatch
    from kiln.runtime.codegen import generate
    for kw in (dict(), dict(swap=True), dict(padding_idx=3)):
        g, (grad, ids, other) = _embedding_graph(**kw)
        want = aten.embedding_dense_backward(grad, ids, 12, kw.get("padding_idx", -1), False) + other
        assert fold_accumulation(g, ("kiln", "aten")) == 1, kw
        assert count(g, aten.add.Tensor) == 0 and count(g, aten.embedding_dense_backward.default) == 0
        (n,) = [n for n in g.nodes if n.op.name == "kiln.embedding_backward_acc"]
        assert n.args[-1] is g.inputs[2]
        dispatch(g, ("kiln", "aten"))
        assert n.impl.label == "kiln:embedding_backward_acc"
        got = generate(g)[1](grad, ids, other)
        assert torch.equal(got, want) and torch.equal(got.view(torch.int32), want.view(torch.int32)), kw


def test_a_tied_embeddings_sum_stays_where_bits_order_or_dialects_say_so():
    for kw in (dict(dtype=torch.bfloat16), dict(other_after=True), dict(read_alone=True)):
        g, _ = _embedding_graph(**kw)
        assert fold_accumulation(g, ("kiln", "aten")) == 0, kw
        assert count(g, aten.add.Tensor) == 1
    g, _ = _embedding_graph()
    assert fold_accumulation(g, ("aten",)) == 0          # no enabled dialect runs the twin


def test_gpt2_steps_sum_their_tied_embedding_in_the_twin_bit_for_bit_as_with_the_add(monkeypatch):
    """GPT-2 ties its word embedding to the output projection: fp32 and bf16 steps sum the two gradients in one
    pass, and losses and parameters after 3 steps are the same bits as the program with ATen's two ops (the
    program's parity with eager is tests/models)."""
    import kiln.passes.pipeline as pipeline
    from tests.models import zoo
    model, _args, batch, _loss = zoo.gpt2()
    real = pipeline.fold_accumulation

    def train(fold: bool, amp):
        monkeypatch.setattr(pipeline, "fold_accumulation", real if fold else (lambda graph, dialects=None: 0))
        m = copy.deepcopy(model)
        step = kiln.compile(m, optimizer=kiln.optim.AdamW(lr=1e-3), amp=amp)
        losses = [step(**batch).item() for _ in range(3)]
        return step.last.graph, losses, [p.detach().clone() for p in m.parameters()]

    for amp in (None, "bf16"):
        g1, l1, p1 = train(True, amp)
        _g0, l0, p0 = train(False, amp)
        assert [n.op.name for n in g1.nodes].count("kiln.embedding_backward_acc") == 1, amp
        assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0)), amp


# ---- LayerNorm's backward between the residual stream's sums (the `kiln` dialect's training fusion) ---------
def test_gpt2_and_bert_bf16_steps_run_layer_norm_backward_as_one_kernel_and_train_like_eager():
    """In bf16 steps every LayerNorm backward becomes kiln.layer_norm_backward: BERT's (post-LN) with the
    residual stream's sum before it read as two inputs, GPT-2's (pre-LN) with the residual add after it taken
    as its grad_sum; the casts of its result fold in, so no activation cast is left. fp32 steps keep ATen's op
    (eager's bits), and so does a step without the `kiln` dialect. Both track eager as the ATen program does."""
    from tests.models.reference import sgd_like_eager
    for name in ("gpt2", "bert"):
        for amp in (None, "bf16"):
            step = sgd_like_eager(name, amp)
            fused = [n for n in step.graph.nodes if n.op.name in ("kiln.layer_norm_backward",
                                                                  "kiln.layer_norm_backward_sums")]
            aten_ln = count(step.graph, aten.native_layer_norm_backward.default)
            if amp is None:
                assert not fused and aten_ln > 0, name
                continue
            assert fused and aten_ln == 0, name
            if name == "bert":      # post-LN: the residual stream's gradient plus the branch's, added inside
                assert any(n.args[1] is not None for n in fused)
            else:                   # pre-LN: the residual add after it is its grad_sum
                assert any(n.args[7] is not None for n in fused)
            assert any(n.kwargs.get("low_dtype") == torch.bfloat16 for n in fused)
            assert all(n.impl.label in ("kiln:layer_norm_backward", "kiln:layer_norm_backward_sums") for n in fused)
            # the bias sums of the bf16 copies went into the kernels: no aten.sum reads one
            lows = {n.outputs[3] for n in fused}
            sums = [n for n in step.graph.nodes if n.target is aten.sum.dim_IntList]
            assert any(n.op.name == "kiln.layer_norm_backward_sums" for n in fused), name
            assert not [s for s in sums if s.args[0] in lows or (s.args[0].producer is not None and
                                                                 set(s.args[0].producer.inputs) & lows)], name
    step = sgd_like_eager("bert", "bf16", dialects=["aten", "attention"])
    assert not [n for n in step.graph.nodes if n.op.name == "kiln.layer_norm_backward"]
