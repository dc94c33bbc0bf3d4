"""Widening casts folded into the ops that promote by themselves (kiln/passes/casts.py): dropped only where
the op computes the same from the narrow value, checked against PyTorch on the same tensors."""
from __future__ import annotations

import torch

import kiln
from kiln.passes.casts import fold_widening_casts
from tests.passes.graphs import aten, count, graph_with_inputs, run


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8).bfloat16(), torch.randn(4, 8), torch.randn(4, 8).bfloat16()


def test_a_widening_cast_read_by_an_op_that_promotes_is_dropped_and_the_result_is_exact():
    x, y, _ = _inputs()
    g, b, (xv, yv, _zv) = graph_with_inputs(*_inputs())
    wide = b(aten._to_copy.default, xv, dtype=torch.float32)
    g.outputs = [b(aten.mul.Tensor, b(aten.add.Tensor, wide, yv), wide)]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 0
    assert all(n.args[0] is xv for n in g.nodes if n.target is aten.add.Tensor)
    got = run(g, *_inputs())
    want = (x.float() + y) * x.float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_cast_reaching_the_op_through_views_is_dropped_and_the_views_taken_of_the_narrow_value():
    x, y, _ = _inputs()
    g, b, (xv, yv, _zv) = graph_with_inputs(*_inputs())
    wide = b(aten._to_copy.default, b(aten.t.default, xv), dtype=torch.float32)      # (8, 4), not contiguous
    flat = b(aten.unsqueeze.default, b(aten.view.default, wide, [32]), 0)
    g.outputs = [b(aten.add.Tensor, flat, b(aten.view.default, yv, [1, 32]))]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 0
    got = run(g, *_inputs())
    torch.testing.assert_close(got, x.t().float().reshape(1, 32) + y.reshape(1, 32), rtol=0, atol=0)


def test_of_two_widening_casts_into_one_op_only_one_is_dropped():
    """add(cast(x), cast(z)) computes in fp32 from one narrow input, not from two (segformer's gradient sum of
    two bf16 branches went into LayerNorm's fp32 backward as bf16 when both were dropped)."""
    x, _, z = _inputs()
    g, b, (xv, _yv, zv) = graph_with_inputs(*_inputs())
    total = b(aten.add.Tensor, b(aten._to_copy.default, xv, dtype=torch.float32),
              b(aten.view.default, b(aten._to_copy.default, zv, dtype=torch.float32), [4, 8]))
    g.outputs = [b(aten.mul.Tensor, total, 2.0)]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 1
    got = run(g, *_inputs())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (x.float() + z.float()) * 2, rtol=0, atol=0)


def test_casts_are_kept_where_dropping_them_would_change_the_result():
    g, b, (xv, yv, zv) = graph_with_inputs(*_inputs())
    both_low = b(aten.mul.Tensor, b(aten._to_copy.default, xv, dtype=torch.float32), zv)   # would compute in bf16
    softmaxed = b(aten._softmax.default, b(aten._to_copy.default, zv, dtype=torch.float32), -1, False)  # no promotion
    shared = b(aten._to_copy.default, b(aten.neg.default, xv), dtype=torch.float32)
    mixed = b(aten.add.Tensor, b(aten.exp.default, shared), b(aten.add.Tensor, shared, yv))   # one reader does not promote
    narrowed = b(aten.add.Tensor, b(aten._to_copy.default, yv, dtype=torch.bfloat16), zv)     # rounds: never dropped
    out = b(aten._to_copy.default, zv, dtype=torch.float32)                                   # a step output
    viewed = b(aten.exp.default, b(aten.view.default, b(aten._to_copy.default, xv, dtype=torch.float32), [32]))
    g.outputs = [b(aten.add.Tensor, b(aten.add.Tensor, both_low, softmaxed), mixed), narrowed, out, viewed]
    before = count(g, aten._to_copy.default)
    assert fold_widening_casts(g) == 0 and count(g, aten._to_copy.default) == before


def test_a_bf16_llama_step_keeps_no_widening_cast_before_the_residual_adds_and_rotary_kernels():
    from tests.models import zoo                       # the zoo's Llama (rope kernel, residual adds)
    model, _args, batch, _loss = zoo.llama()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.01), amp="bf16", dialects=["kiln", "aten"])
    step(**batch)
    g = step.last.graph
    users = g.users()
    widening = [n for n in g.nodes if n.target is aten._to_copy.default and n.args[0].meta.dtype == torch.bfloat16
                and n.outputs[0].meta.dtype == torch.float32]
    readers = {u.op.name for n in widening for u in users.get(n.outputs[0], ())}
    assert not readers & {"kiln.rope", "kiln.rope_backward", "aten.add.Tensor"}, readers
    assert any(n.op.name == "kiln.rope_backward" and n.inputs[0].meta.dtype == torch.bfloat16 for n in g.nodes)


# ---- narrowing casts folded into the kernel that makes their input ---------------------------------
def _rms_graph(cast_through_view: bool, extra_reader: bool):
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, 32), torch.rand(32) + 0.5
    g, b, (xv, wv) = graph_with_inputs(x, w)
    out, _rstd = b(torch.ops.kiln.rms_norm.default, xv, wv, 1e-6)
    src = b(aten.reshape.default, out, [24, 32]) if cast_through_view else out
    low = b(aten._to_copy.default, src, dtype=torch.bfloat16)
    g.outputs = [b(aten.mul.Tensor, low, low)] + ([out] if extra_reader else [])
    return g, (x, w)


def test_a_narrowing_cast_of_a_kernel_output_becomes_its_out_dtype_with_the_same_bits():
    from kiln.passes.casts import fold_narrowing_casts
    for through_view in (False, True):
        g, inputs = _rms_graph(through_view, extra_reader=False)
        want = run(g, *inputs)
        assert fold_narrowing_casts(g) == 1 and count(g, aten._to_copy.default) == 0
        node = next(n for n in g.nodes if n.target is torch.ops.kiln.rms_norm.default)
        assert node.kwargs.get("out_dtype") is torch.bfloat16 and node.outputs[0].meta.dtype == torch.bfloat16
        got = run(g, *inputs)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_narrowing_cast_stays_where_the_wide_output_is_read_elsewhere():
    from kiln.passes.casts import fold_narrowing_casts
    g, _ = _rms_graph(False, extra_reader=True)
    assert fold_narrowing_casts(g) == 0 and count(g, aten._to_copy.default) == 1


def test_a_bf16_llama_step_has_no_cast_around_its_kernels_and_trains_bit_for_bit_as_with_the_casts(monkeypatch):
    """The folded program (kernels writing bf16 themselves) gives the same bits as the casts did: losses and
    parameters after 3 steps equal, with the native loops and with the ATen compositions."""
    import copy
    import kiln.passes.pipeline as pipeline
    from tests.models import zoo
    model, _args, batch, _loss = zoo.llama()
    real = pipeline.fold_narrowing_casts

    def train(fold: bool):
        monkeypatch.setattr(pipeline, "fold_narrowing_casts", real if fold else (lambda graph: 0))
        m = copy.deepcopy(model)
        step = kiln.compile(m, optimizer=kiln.optim.AdamW(lr=1e-3), amp="bf16", dialects=["kiln", "sdpa", "aten"])
        losses = [step(**batch).item() for _ in range(3)]
        return step, losses, [p.detach().clone() for p in m.parameters()]

    from kiln.passes import casts
    for native_on in ("1", "0"):
        monkeypatch.setenv("KILN_NATIVE", native_on)
        folded, l1, p1 = train(True)
        _, l0, p0 = train(False)
        assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0))
        g = folded.last.graph
        kernels = [n for n in g.nodes if n.op.name in ("kiln.rms_norm", "kiln.rope", "kiln.rope_backward")]
        assert kernels and all(n.outputs[0].meta.dtype == torch.bfloat16 for n in kernels if "out_dtype" in n.kwargs)
        # a kernel rebuilt with its cast folded in keeps the record of the fusion that made it (explain's "fused:")
        rebuilt = [n for n in kernels if n.op.name in ("kiln.rms_norm", "kiln.rope") and "out_dtype" in n.kwargs]
        assert rebuilt and all(n.fused is not None and n.fused.fusion == "kiln:" + n.op.name[5:] for n in rebuilt)
        users = g.users()
        narrowing = [u for n in kernels for o in n.outputs for u in users.get(o, ()) if casts._narrowing(u)]
        assert not narrowing, narrowing


def test_a_cast_of_a_gradient_read_in_both_dtypes_becomes_the_kernels_second_output():
    """rms_norm_backward's input gradient read as it is (the residual stream, fp32) and cast to bf16 (a bf16
    matmul's backward): the kernel writes the bf16 copy in the same pass, with the cast's bits."""
    from kiln.passes.casts import fold_narrowing_casts
    torch.manual_seed(0)
    g_out, x, w = torch.randn(4, 6, 32).bfloat16(), torch.randn(4, 6, 32), torch.rand(32) + 0.5
    rstd = x.pow(2).mean(-1, keepdim=True).add_(1e-6).rsqrt_()
    g, b, (gv, xv, wv, rv) = graph_with_inputs(g_out, x, w, rstd)
    gi, _gw, _low = b(torch.ops.kiln.rms_norm_backward.default, gv, None, xv, wv, rv)
    low = b(aten._to_copy.default, gi, dtype=torch.bfloat16)
    g.outputs = [b(aten.mul.Tensor, low, low), b(aten.add.Tensor, gi, xv)]
    want = run(g, g_out, x, w, rstd)
    assert fold_narrowing_casts(g) == 1 and count(g, aten._to_copy.default) == 0
    node = next(n for n in g.nodes if n.target is torch.ops.kiln.rms_norm_backward.default)
    assert node.kwargs.get("low_dtype") is torch.bfloat16 and node.outputs[2].meta.dtype == torch.bfloat16
    got = run(g, g_out, x, w, rstd)
    for a, b_ in zip(got, want):
        assert a.dtype == b_.dtype and torch.equal(a, b_)


def test_a_bf16_step_gives_the_optimizer_its_bf16_gradients_without_an_fp32_copy():
    """The gradients of the bf16 weight copies reach the multi-tensor AdamW and the non-finite guard as they
    are (both read narrow values: `OpDef.reads_narrow`): no widening cast is left whose readers are only
    those, and the step still trains as torch.autocast + torch.optim.AdamW does (the amp parity tests, at
    their tolerance, tests/models/test_amp_parity.py)."""
    from kiln import guards, optim
    from tests.models import zoo
    model, _args, batch, _loss = zoo.llama()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), amp="bf16", dialects=["kiln", "sdpa", "aten"])
    before = [p.detach().clone() for p in model.parameters()]
    step(**batch)
    g = step.last.graph
    users = g.users()
    update = next(n for n in g.nodes if n.op is optim.ADAMW_MULTI)
    grads = update.args[1]
    assert sum(v.meta.dtype == torch.bfloat16 for v in grads) >= len(grads) // 2, [v.meta.dtype for v in grads]
    readers = (optim.ADAMW_MULTI.name, guards.CHECK_FINITE.name)
    only_for_update = [n for n in g.nodes if n.target is aten._to_copy.default
                       and n.outputs[0].meta.dtype == torch.float32 and n.args[0].meta.dtype == torch.bfloat16
                       and all(u.op.name in readers for u in users.get(n.outputs[0], ()))]
    assert not only_for_update, only_for_update
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
