"""Pattern-based dialect fusion: the pattern language, what is fused and what must not be, and the
numerics of fused graphs against the unfused ops run by PyTorch."""
from __future__ import annotations

import copy
import io
import logging
import math

import pytest
import torch

import kiln
from kiln.dialects import registry
from kiln.ir.builder import Builder
from kiln.ir.graph import Phase
from kiln.ir.pattern import Lit, Op, Opt, Seq, V, match
from kiln.passes.fuse import fuse
from tests.passes.graphs import aten, count, graph_with_inputs, run

kiln_ops = torch.ops.kiln
ALL = ("kiln", "sdpa", "aten")


def _root(g):
    return g.outputs[0].producer


# ---- the pattern language --------------------------------------------------------------------
def test_a_variable_used_twice_binds_the_same_value():
    x, y = torch.randn(3), torch.randn(3)
    g, b, (xv, yv) = graph_with_inputs(x, y)
    square, cross = b(aten.mul.Tensor, xv, xv), b(aten.mul.Tensor, xv, yv)
    pat = Op(aten.mul.Tensor, V("a"), V("a"))
    assert match(pat, square.producer)["a"] is xv
    assert match(pat, cross.producer) is None


def test_commutative_tries_both_orders_and_literals_compare_by_value():
    x = torch.randn(3)
    g, b, (xv,) = graph_with_inputs(x)
    v = b(aten.mul.Tensor, b(aten.add.Tensor, xv, 1.0), b(aten.silu.default, xv))
    silu_times = Op(aten.mul.Tensor, Op(aten.silu.default, V("g")), V("u"))
    assert match(silu_times, v.producer) is None
    m = match(Op(aten.mul.Tensor, Op(aten.silu.default, V("g")), V("u"), commutative=True), v.producer)
    assert m["g"] is xv and m["u"].producer.target is aten.add.Tensor
    assert len(m.nodes) == 2 and m.root is v.producer                 # the add is an argument, not covered
    plus_one = Op(aten.add.Tensor, V("x"), Lit(1))
    assert match(plus_one, m["u"].producer) is not None
    assert match(Op(aten.add.Tensor, V("x"), Lit(2)), m["u"].producer) is None
    # the omitted alpha argument compares against the schema default (1)
    assert match(Op(aten.add.Tensor, V("x"), Lit(1.0), Lit(1)), m["u"].producer) is not None
    assert match(Op(aten.add.Tensor, V("x"), Lit(1.0), Lit(2)), m["u"].producer) is None


def test_optional_wrapper_and_list_arguments():
    x = torch.randn(4, 6)
    g, b, (xv,) = graph_with_inputs(x)
    halves = [b(aten.slice.Tensor, xv, -1, 3, 6), b(aten.slice.Tensor, xv, -1, 0, 3)]
    cat = b(aten.cat.default, halves, -1)
    cast = b(aten._to_copy.default, cat, dtype=torch.float64)
    pat = Opt(aten._to_copy.default, Op(aten.cat.default, Seq(V("p"), V("q")), Lit(-1)), name="out")
    wrapped = Op(aten.neg.default, pat)            # Opt is never a root: match it as an argument
    for v, covered in ((cat, 2), (cast, 3)):       # neg + cat (+ the optional cast)
        got = match(wrapped, b(aten.neg.default, v).producer)
        assert got is not None and got["out"] is v and got["p"] is halves[0] and len(got.nodes) == covered
    assert match(Op(aten.cat.default, Seq(V("p")), Lit(-1)), cat.producer) is None   # wrong length


# ---- the fuse pass on small graphs -----------------------------------------------------------
def rms_graph(x, w, extra_use=None):
    g, b, (xv, wv) = graph_with_inputs(x, w)
    var = b(aten.mean.dim, b(aten.pow.Tensor_Scalar, xv, 2), [-1], True)
    rstd = b(aten.rsqrt.default, b(aten.add.Tensor, var, 1e-6))
    out = b(aten.mul.Tensor, wv, b(aten.mul.Tensor, xv, rstd))
    g.outputs = [out]
    if extra_use == "rstd":                 # a reduction result needed elsewhere too
        g.outputs = [b(aten.add.Tensor, out, rstd)]
    return g


def rms_ref(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rms_norm_subgraph_becomes_one_kernel_with_the_same_values():
    x, w = torch.randn(4, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    g = rms_graph(x, w)
    assert fuse(g, ALL, "forward") == 1
    assert [n.target for n in g.nodes] == [kiln_ops.rms_norm.default]
    fused = g.nodes[0].fused
    assert fused.fusion == "kiln:rms_norm" and list(fused.ops) == [
        "aten.pow.Tensor_Scalar", "aten.mean", "aten.add.Tensor", "aten.rsqrt", "aten.mul.Tensor", "aten.mul.Tensor"]
    torch.testing.assert_close(run(g, x, w), rms_ref(x, w), rtol=1e-12, atol=1e-12)


def test_not_fused_when_an_inner_value_is_used_elsewhere():
    x, w = torch.randn(4, 16), torch.randn(16)
    g = rms_graph(x, w, extra_use="rstd")
    before = [n.target for n in g.nodes]
    assert fuse(g, ALL, "forward") == 0
    assert [n.target for n in g.nodes] == before
    torch.testing.assert_close(run(g, x, w), rms_ref(x, w) + torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def residual_rms_graph(x, r, w, use_before=False):
    """s = x + r; kiln.rms_norm(s); the sum used on afterwards (a pre-norm block's residual stream), or also
    before the norm (`use_before`)."""
    g, b, (xv, rv, wv) = graph_with_inputs(x, r, w)
    total = b(aten.add.Tensor, xv, rv)
    early = b(aten.mul.Tensor, total, 2.0) if use_before else None
    out, _rstd = b(kiln_ops.rms_norm.default, total, wv, 1e-6)
    later = b(aten.mul.Tensor, total, 3.0)
    g.outputs = [b(aten.add.Tensor, out, later)] + ([early] if early is not None else [])
    return g


def test_residual_add_and_rms_norm_fuse_and_the_sum_is_shared():
    """The add's sum has a user outside the match: the fusion names it shared, and that user reads the fused op's
    sum output instead. Bit for bit the unfused ops (float32 sum of a float32 and a bf16 input)."""
    x, r, w = torch.randn(4, 5, 32), torch.randn(4, 5, 32).bfloat16(), torch.rand(32) + 0.5
    g = residual_rms_graph(x, r, w)
    want = run(residual_rms_graph(x, r, w), x, r, w)
    assert fuse(g, ALL, "forward") == 1
    assert [n.target for n in g.nodes].count(kiln_ops.add_rms_norm.default) == 1
    assert count(g, kiln_ops.rms_norm.default) == 0
    fused = next(n for n in g.nodes if n.target is kiln_ops.add_rms_norm.default)
    later = next(n for n in g.nodes if n.target is aten.mul.Tensor)
    assert later.args[0] is fused.outputs[1]                     # the shared sum, from the fused op
    assert torch.equal(run(g, x, r, w), want)


def test_a_shared_value_used_before_the_fused_op_is_not_fused():
    """A user of the sum that comes before the norm (where the fused op would go) would read a value not yet
    made: the match is left alone."""
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32) + 0.5
    g = residual_rms_graph(x, r, w, use_before=True)
    before = [n.target for n in g.nodes]
    assert fuse(g, ALL, "forward") == 0 and [n.target for n in g.nodes] == before


def rms_backward_of_sum_graph(g1, g2, x, widen=False, cast_to=torch.float32):
    """kiln.rms_norm_backward of g1 + g2 (cast to `cast_to` first where `widen`: autocast's backward of an fp32
    norm whose output two bf16 projections read widens the sum), as the differentiated graph has it."""
    w = torch.linspace(0.5, 1.5, x.shape[-1])
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    tensors = (g1, g2, x, w, rstd)
    g, b, (v1, v2, xv, wv, rv) = graph_with_inputs(*tensors)
    total = b(aten.add.Tensor, v1, v2)
    if widen:
        total = b(aten._to_copy.default, total, dtype=cast_to)
    gi, gw, _low = b(kiln_ops.rms_norm_backward.default, total, None, xv, wv, rv)
    g.outputs = [gi, gw]
    return g, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_backward_reads_the_two_terms_of_its_output_gradient_with_the_adds_bits(dtype):
    """The add (and an exact widening cast after it) goes into the kernel, which sums the terms as the add did:
    the graph's bits. (The kernel's own numerics against float64 are tests/kernels/test_native.py's.)"""
    torch.manual_seed(0)
    x = torch.randn(64, 48)
    g1, g2 = torch.randn(64, 48, dtype=dtype), torch.randn(64, 48, dtype=dtype)
    widen = dtype != torch.float32
    unfused, tensors = rms_backward_of_sum_graph(g1, g2, x, widen)
    want = run(unfused, *tensors)
    g, _ = rms_backward_of_sum_graph(g1, g2, x, widen)
    assert fuse(g, ALL, "training") == 1
    assert count(g, aten.add.Tensor) == 0 and count(g, aten._to_copy.default) == 0
    (n,) = g.nodes
    assert n.fused.fusion == "kiln:rms_norm_backward_of_sum" and n.kwargs["grad_out2"] is g.inputs[1]
    assert all(torch.equal(a, b) for a, b in zip(run(g, *tensors), want))


def rms_backward_of_three_graph(g1, g2, g3, x, widen=False, inner_second=False, inner_read_too=False):
    """kiln.rms_norm_backward of (g1 + g2) + g3 (the inner sum as the outer add's second operand where
    `inner_second`; also a graph output where `inner_read_too`), widened to fp32 first where `widen`."""
    w = torch.linspace(0.5, 1.5, x.shape[-1])
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    tensors = (g1, g2, g3, x, w, rstd)
    g, b, (v1, v2, v3, xv, wv, rv) = graph_with_inputs(*tensors)
    inner = b(aten.add.Tensor, v1, v2)
    total = b(aten.add.Tensor, v3, inner) if inner_second else b(aten.add.Tensor, inner, v3)
    if widen:
        total = b(aten._to_copy.default, total, dtype=torch.float32)
    gi, gw, _low = b(kiln_ops.rms_norm_backward.default, total, None, xv, wv, rv)
    g.outputs = [gi, gw] + ([inner] if inner_read_too else [])
    return g, tensors


@pytest.mark.parametrize("inner_second", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_backward_reads_three_terms_with_both_adds_bits(dtype, inner_second):
    """(g1 + g2) + g3 in either operand order of the outer add (and the widening after it) goes into the
    kernel, which sums as the two adds did: the graph's bits."""
    torch.manual_seed(0)
    x = torch.randn(64, 48)
    g1, g2, g3 = (torch.randn(64, 48, dtype=dtype) for _ in range(3))
    widen = dtype != torch.float32
    unfused, tensors = rms_backward_of_three_graph(g1, g2, g3, x, widen, inner_second)
    want = run(unfused, *tensors)
    g, _ = rms_backward_of_three_graph(g1, g2, g3, x, widen, inner_second)
    assert fuse(g, ALL, "training") == 1
    assert count(g, aten.add.Tensor) == 0 and count(g, aten._to_copy.default) == 0
    (n,) = g.nodes
    assert n.fused.fusion == "kiln:rms_norm_backward_of_three"
    assert n.args[0] is g.inputs[0] and n.kwargs["grad_out2"] is g.inputs[1] and n.kwargs["grad_out3"] is g.inputs[2]
    assert all(torch.equal(a, b) for a, b in zip(run(g, *tensors), want))


@pytest.mark.parametrize("case", ["inner sum read elsewhere", "inner add promotes"])
def test_rms_norm_backward_leaves_the_inner_add_where_it_cannot_take_it(case):
    """Where the first sum is read by more than the second add, or that add promotes (fp32 + bf16: its sum is
    not rounded to the terms' dtype), the inner add stays and the kernel takes two terms: the graph's bits."""
    x = torch.randn(16, 32)
    g1, g2, g3 = (torch.randn(16, 32, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(widen=True, inner_read_too=True)
    if case == "inner add promotes":
        g1, g3, kw = g1.float(), g3.float(), {}
    unfused, tensors = rms_backward_of_three_graph(g1, g2, g3, x, **kw)
    want = run(unfused, *tensors)
    g, _ = rms_backward_of_three_graph(g1, g2, g3, x, **kw)
    assert fuse(g, ALL, "training") == 1 and count(g, aten.add.Tensor) == 1
    assert [n.fused.fusion for n in g.nodes if n.fused is not None] == ["kiln:rms_norm_backward_of_sum"]
    assert all(torch.equal(a, b) for a, b in zip(run(g, *tensors), want))


def test_rms_norm_backward_keeps_an_add_that_promotes_or_broadcasts_or_a_cast_that_rounds():
    x = torch.randn(8, 16)
    bf16 = torch.bfloat16
    for g1, g2, widen, to in ((torch.randn(8, 16), torch.randn(8, 16).to(bf16), False, None),  # promoting: fp32 sum
                              (torch.randn(8, 16), torch.randn(16), False, None),              # a broadcast addend
                              (torch.randn(8, 16).to(bf16), torch.randn(16).to(bf16), True, torch.float32),
                              (torch.randn(8, 16), torch.randn(8, 16), True, bf16)):          # a narrowing cast
        g, _ = rms_backward_of_sum_graph(g1, g2, x, widen, to)
        assert fuse(g, ALL, "training") == 0 and count(g, aten.add.Tensor) == 1, (g1.dtype, g2.shape, to)


def test_not_fused_when_the_dialect_is_disabled():
    x, w = torch.randn(4, 16), torch.randn(16)
    g = rms_graph(x, w)
    assert fuse(g, ("sdpa", "aten"), "forward") == 0 and count(g, kiln_ops.rms_norm.default) == 0


def test_rms_norm_statistics_over_another_dim_are_not_fused():
    x, w = torch.randn(4, 16), torch.randn(16)
    g, b, (xv, wv) = graph_with_inputs(x, w)
    var = b(aten.mean.dim, b(aten.pow.Tensor_Scalar, xv, 2), [0], True)
    g.outputs = [b(aten.mul.Tensor, wv, b(aten.mul.Tensor, xv, b(aten.rsqrt.default, b(aten.add.Tensor, var, 1e-6))))]
    assert fuse(g, ALL, "forward") == 0


def test_swiglu_fused_only_without_broadcasting():
    gate, up, row = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    g, b, (gv, uv, rv) = graph_with_inputs(gate, up, row)
    same = b(aten.mul.Tensor, uv, b(aten.silu.default, gv))
    bcast = b(aten.mul.Tensor, b(aten.silu.default, gv), rv)
    g.outputs = [b(aten.add.Tensor, same, b(aten.sum.dim_IntList, bcast, [0]))]
    assert fuse(g, ALL, "forward") == 1 and count(g, kiln_ops.swiglu.default) == 1
    torch.testing.assert_close(run(g, gate, up, row), torch.nn.functional.silu(gate) * up +
                               (torch.nn.functional.silu(gate) * row).sum(0))


def rotate(b, t, cos, sin):
    h = t.meta.shape[-1] // 2
    rot = b(aten.cat.default, [b(aten.neg.default, b(aten.slice.Tensor, t, 3, h, 2 ** 63 - 1)),
                               b(aten.slice.Tensor, t, 3, 0, h)], -1)
    return b(aten.add.Tensor, b(aten.mul.Tensor, t, cos), b(aten.mul.Tensor, rot, sin))


def rope_ref(t, cos, sin):
    h = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin


def test_rope_pairs_queries_and_keys_that_share_tables():
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    cos, sin = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    g, b, (qv, kv, cv, sv) = graph_with_inputs(q, k, cos, sin)
    qr, kr = rotate(b, qv, cv, sv), rotate(b, kv, cv, sv)
    g.outputs = [b(aten.add.Tensor, b(aten.sum.default, qr), b(aten.sum.default, kr))]
    assert fuse(g, ALL, "forward") == 2
    assert count(g, kiln_ops.rope.default) == 1 and count(g, aten.cat.default) == 0
    torch.testing.assert_close(run(g, q, k, cos, sin), rope_ref(q, cos, sin).sum() + rope_ref(k, cos, sin).sum())


def test_a_lone_rotation_is_left_alone():
    q, cos, sin = torch.randn(2, 4, 6, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    g, b, (qv, cv, sv) = graph_with_inputs(q, cos, sin)
    g.outputs = [rotate(b, qv, cv, sv)]
    assert fuse(g, ALL, "forward") == 0 and count(g, aten.cat.default) == 1


def gelu_tanh_graph(x, cubic=0.044715):
    g, b, (xv,) = graph_with_inputs(x)
    inner = b(aten.add.Tensor, xv, b(aten.mul.Tensor, b(aten.pow.Tensor_Scalar, xv, 3.0), cubic))
    t = b(aten.tanh.default, b(aten.mul.Tensor, inner, math.sqrt(2 / math.pi)))
    g.outputs = [b(aten.mul.Tensor, b(aten.mul.Tensor, xv, 0.5), b(aten.add.Tensor, t, 1.0))]
    return g


def test_gelu_tanh_formula_becomes_atens_fused_gelu():
    x = torch.randn(64, 32, dtype=torch.float64)
    g = gelu_tanh_graph(x)
    assert fuse(g, ALL, "forward") == 1
    assert [(n.target, n.kwargs) for n in g.nodes] == [(aten.gelu.default, {"approximate": "tanh"})]
    want = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
    torch.testing.assert_close(run(g, x), want, rtol=1e-12, atol=1e-12)


def test_a_fused_op_reading_another_fused_op_gets_its_replacement():
    x = torch.randn(16, dtype=torch.float64)
    g = gelu_tanh_graph(x)
    (xv,), inner = g.inputs, g.outputs[0]
    b = Builder(g, Phase.FORWARD)
    t = b(aten.tanh.default, b(aten.mul.Tensor, b(aten.add.Tensor, inner, b(aten.mul.Tensor, b(
        aten.pow.Tensor_Scalar, inner, 3.0), 0.044715)), math.sqrt(2 / math.pi)))
    g.outputs = [b(aten.mul.Tensor, b(aten.mul.Tensor, inner, 0.5), b(aten.add.Tensor, t, 1.0))]
    assert fuse(g, ALL, "forward") == 2
    assert [n.target for n in g.nodes] == [aten.gelu.default] * 2 and g.nodes[1].args[0] is g.nodes[0].outputs[0]
    gelu = torch.nn.functional.gelu
    torch.testing.assert_close(run(g, x), gelu(gelu(x, approximate="tanh"), approximate="tanh"))


def test_a_different_constant_is_not_gelu():
    g = gelu_tanh_graph(torch.randn(8), cubic=0.05)
    assert fuse(g, ALL, "forward") == 0 and count(g, aten.tanh.default) == 1


def test_random_and_side_effect_ops_are_never_inside_a_fusion():
    x = torch.randn(4, 8)
    g, b, (xv,) = graph_with_inputs(x)
    dropped = b(aten.native_dropout.default, xv, 0.5, True)[0]
    g.outputs = [b(aten.mul.Tensor, b(aten.silu.default, dropped), dropped)]
    d = registry.dialect("test_random", priority=1, devices=("cpu",))
    f = registry.fusion(d, "dropout_silu", Op(aten.mul.Tensor, Op(aten.silu.default, Op(
        aten.native_dropout.default, V("x"), V("p"), V("t"))), V("y")), lambda b, ms: pytest.fail("built"))
    try:
        assert fuse(g, ("test_random", "aten"), "forward") == 0
    finally:
        registry._FUSIONS.remove(f)
        del registry.DIALECTS["test_random"]


def _fuse_with_only(g, caplog, dialect: str, name: str, pattern, build, **kw) -> int:
    """`fuse` on g with a temporary dialect holding one fusion (removed afterwards), warnings captured."""
    d = registry.dialect(dialect, priority=1, devices=("cpu",))
    f = registry.fusion(d, name, pattern, build, priority=100, **kw)
    try:
        with caplog.at_level(logging.WARNING, logger="kiln"):
            return fuse(g, (dialect, "aten"), "forward")
    finally:
        registry._FUSIONS.remove(f)
        del registry.DIALECTS[dialect]


def test_a_failing_fusion_logs_a_warning_and_keeps_the_graph(caplog):
    x, w = torch.randn(4, 16), torch.randn(16)
    g = rms_graph(x, w)

    def broken(b, matches):
        raise RuntimeError("no kernel today")
    assert _fuse_with_only(g, caplog, "test_broken", "rms", registry.fusions(("kiln",), "forward")[0].pattern,
                           broken) == 0
    assert "fusion test_broken:rms failed" in caplog.text and "no kernel today" in caplog.text
    torch.testing.assert_close(run(g, x, w), rms_ref(x, w))


def test_a_shared_fusion_returning_the_wrong_form_logs_and_keeps_the_graph(caplog):
    """A fusion with shared values must return [(root's values, {name: value})]; anything else is logged and the
    ops stay, never a half-rewired graph."""
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32) + 0.5
    g = residual_rms_graph(x, r, w)
    want = run(residual_rms_graph(x, r, w), x, r, w)
    before = [n.target for n in g.nodes]
    shared = next(f for f in registry.fusions(("kiln",), "forward") if f.shared)

    def plain_list(b, matches):                  # the form of a fusion without shared values
        (m,) = matches
        out, s, rstd = b(kiln_ops.add_rms_norm.default, m["x"], m["r"], m["w"], m["eps"])
        return [[out, rstd]]
    assert _fuse_with_only(g, caplog, "test_shared", "add_rms", shared.pattern, plain_list, shared=("sum",)) == 0
    assert "fusion test_shared:add_rms returned" in caplog.text
    assert [n.target for n in g.nodes] == before and torch.equal(run(g, x, r, w), want)


# ---- whole models: fused where expected, trained like eager PyTorch --------------------------
def _llama(vocab=128):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=16)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg), torch.randint(0, vocab, (2, 12))


def _adamw():
    return kiln.optim.AdamW(lr=1e-3), lambda params: torch.optim.AdamW(params, lr=1e-3)


def _sgd():
    # SGD: its update is proportional to the gradient, so training checks gradients (AdamW's first steps are
    # sign(grad) * lr, which turns float-order differences at near-zero gradients into 1e-5 ones)
    return kiln.optim.SGD(lr=0.1, momentum=0.9), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_like_eager(model, batches, optimizers=_adamw, **compile_kw):
    """Kiln and eager PyTorch train copies of `model` on `batches`: equal losses, then equal parameters."""
    ref = copy.deepcopy(model)
    mine, theirs = optimizers()
    step = kiln.compile(model, optimizer=mine, **compile_kw)
    opt = theirs(ref.parameters())
    for batch in batches:
        got = step(**batch)
        opt.zero_grad()
        want = ref(**batch).loss
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5, msg=name)
    return step


def _train_both(model, ids, steps=3, labels=None, **compile_kw):
    labels = ids if labels is None else labels
    return _train_like_eager(model, [dict(input_ids=ids, labels=labels)] * steps, **compile_kw)


def test_llama_fuses_norms_rope_and_swiglu_and_trains_like_eager():
    model, ids = _llama()
    step = _train_both(model, ids)
    fused = [n.fused.fusion for n in step.graph.nodes if n.fused is not None]
    # the first norm reads the embedding; the four after it read a residual add, fused with it (`add_rms_norm`,
    # whose sum the next block reads on: no forward add is left)
    assert fused.count("kiln:rms_norm") == 1 and fused.count("kiln:add_rms_norm") == 4
    assert fused.count("kiln:rope") == 2 and fused.count("kiln:swiglu") == 2
    assert ("fused: aten:adamw_multi_tensor x1, aten:cross_entropy_backward x1, kiln:add_rms_norm x4, kiln:rms_norm x1, "
            "kiln:rms_norm_backward_of_sum x2, kiln:rms_norm_backward_of_three x2, kiln:rope x2, kiln:swiglu x2"
            ) in step.explain(file=io.StringIO())
    forward = [n for n in step.graph.nodes if n.phase.value == "forward"]
    # (one add is left: the position ids' arithmetic, a vector)
    assert not any(n.target is aten.add.Tensor and len(n.outputs[0].meta.shape) > 1 for n in forward)
    sums = [n.outputs[1] for n in forward if n.target is kiln_ops.add_rms_norm.default]
    users = step.graph.users()
    assert all(users.get(s) for s in sums[:-1])            # each residual sum is read on by the next block
    # the optimizer: the non-finite guard, then every parameter's AdamW update in one multi-tensor
    # kernel, still the last node
    updates = [n for n in step.graph.nodes if n.phase.value == "optimizer" and n.op.name != "kiln.check_finite"]
    assert [n.op.name for n in updates] == ["kiln.adamw_update_multi"] and updates[0] is step.graph.nodes[-1]
    assert len(updates[0].args[0]) == len(list(model.parameters()))


def test_vocabulary_projection_fuses_with_the_loss(monkeypatch):
    """Logits of LOGITS_BYTES_TO_FUSE or more (the tiny model takes the same code path with the threshold at
    0): one kernel computing the loss and its gradients in the forward; the backward only scales them.
    Padding (ignored labels) trains like eager."""
    from kiln.dialects import kiln_kernels
    monkeypatch.setattr(kiln_kernels, "LOGITS_BYTES_TO_FUSE", 0)
    model, ids = _llama()
    labels = ids.clone()
    labels[0, 7:] = -100                                   # a padded row
    step = _train_both(model, ids, labels=labels)
    targets = [n.target for n in step.graph.nodes]
    assert targets.count(kiln_ops.linear_cross_entropy_grads.default) == 1
    assert targets.count(kiln_ops.linear_cross_entropy_grads_backward.default) == 1
    assert aten._log_softmax.default not in targets


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_decoder_with_a_bias_fuses_with_the_loss_and_trains_like_eager(monkeypatch, dynamic):
    """BERT's masked-LM head (a decoder with a bias, 85 % of labels ignored): one fused loss, its bias
    carried as an extra weight column; loss and every parameter equal to eager, over sequence lengths that
    change (one dynamic program) too."""
    import transformers
    from kiln.dialects import kiln_kernels
    monkeypatch.setattr(kiln_kernels, "LOGITS_BYTES_TO_FUSE", 0)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=96, hidden_size=40, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_()                # a bias that matters
    g = torch.Generator().manual_seed(0)
    batches = []
    for length in ((12, 12, 12) if not dynamic else (12, 7, 15)):
        ids = torch.randint(0, 96, (3, length), generator=g)
        labels = ids.masked_fill(torch.rand(3, length, generator=g) > 0.15, -100)
        labels[0, 0] = ids[0, 0]                            # at least one counted token
        batches.append(dict(input_ids=ids, labels=labels))
    step = _train_like_eager(model, batches, _sgd, dynamic=dynamic)
    assert sum(n.target is kiln_ops.linear_cross_entropy_grads.default for n in step.graph.nodes) == 1
    assert aten._log_softmax.default not in [n.target for n in step.graph.nodes]


def test_fused_loss_with_dynamic_lengths_and_padding_trains_like_eager(monkeypatch):
    """One dynamic program over batches of other lengths, each padded differently (labels and input_ids
    are separate inputs, so their sizes are separate symbols): still one fused loss, equal to eager."""
    from kiln.dialects import kiln_kernels
    monkeypatch.setattr(kiln_kernels, "LOGITS_BYTES_TO_FUSE", 0)
    model, _ = _llama()
    g = torch.Generator().manual_seed(0)
    batches = []
    for length in (12, 7, 15, 9):
        ids = torch.randint(0, 128, (3, length), generator=g)
        mask = torch.arange(length)[None] < torch.randint(2, length + 1, (3, 1), generator=g)
        batches.append(dict(input_ids=ids, attention_mask=mask.long(), labels=ids.masked_fill(~mask, -100)))
    step = _train_like_eager(model, batches, dynamic=True)
    assert step.cache_info().compiles == 1
    assert sum(n.target is kiln_ops.linear_cross_entropy_grads.default for n in step.graph.nodes) == 1


def test_small_vocabulary_keeps_the_logits():
    model, ids = _llama()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3))
    step(input_ids=ids, labels=ids)
    assert not any(n.target is kiln_ops.linear_cross_entropy.default for n in step.graph.nodes)


# ---- log_softmax + nll backward -> one buffer ---------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignored", ["some", "all"])
def test_cross_entropy_backward_kernel_matches_autograd(reduction, ignored):
    from kiln.ops.nn import cross_entropy_backward
    torch.manual_seed(0)
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (6,))
    y[::2 if ignored == "some" else 1] = -100
    lsm = torch.log_softmax(x, 1)
    loss, total = torch.ops.aten.nll_loss_forward(lsm, y, None, {"none": 0, "mean": 1, "sum": 2}[reduction], -100)
    g = torch.randn_like(loss)
    (want,) = torch.autograd.grad(loss, x, g)
    (got,) = cross_entropy_backward(g, lsm.detach(), y, {"none": 0, "mean": 1, "sum": 2}[reduction], -100, total)
    torch.testing.assert_close(got, torch.nan_to_num(want, nan=0.0) if ignored == "all" else want)


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y, ignore_index=3)


def test_classifier_loss_backward_is_one_kernel_and_trains_like_eager():
    torch.manual_seed(0)
    model, x, y = Classifier(), torch.randn(32, 16), torch.randint(0, 10, (32,))
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        got = step(x, y)
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6)
    names = [n.op.name for n in step.graph.nodes]
    assert "kiln.cross_entropy_backward" in names and "aten.nll_loss_backward" not in names
