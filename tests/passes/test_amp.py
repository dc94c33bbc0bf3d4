"""Mixed precision: where casts go, how many, and what dtype each op computes in."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.ir.graph import Role, TensorMeta
from kiln.ops.registry import Cast
from kiln.passes.amp import AmpPolicy, autocast
from tests.passes.graphs import aten, count, graph_with_inputs, run


def _mlp_graph():
    x, w1, w2, w3 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16, 16), torch.randn(3, 16)
    g, b, (xv, w1v, w2v, w3v) = graph_with_inputs(x, w1, w2, w3)
    for v in (w1v, w2v, w3v):
        v.role = Role.PARAM
    h = b(aten.gelu.default, b(aten.linear.default, xv, w1v))
    h3 = b(aten.linear.default, b(aten.linear.default, h, w2v), w2v)        # w2 used twice: cast once
    s = b(aten._softmax.default, b(aten.linear.default, b(aten.add.Tensor, h, h3), w3v), -1, False)
    g.outputs = [b(aten.sum.default, s)]
    return g, (x, w1, w2, w3)


def dtype_of(g, target, i=0):
    return [n for n in g.nodes if n.target is target][i].outputs[0].meta.dtype


def test_cast_placement_bf16():
    g, tensors = _mlp_graph()
    inserted = autocast(g, AmpPolicy(torch.bfloat16))
    # x, w1, w2, w3 -> bf16 once each; the softmax input -> fp32
    assert inserted == 5 and count(g, aten._to_copy.default) == 5
    assert dtype_of(g, aten.linear.default) == torch.bfloat16
    assert dtype_of(g, aten.gelu.default) == torch.bfloat16                # follows its input
    assert dtype_of(g, aten._softmax.default) == torch.float32             # never low precision
    x, w1, w2, w3 = tensors
    lin = torch.nn.functional.linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.gelu(lin(x, w1))
        want = torch.softmax(lin(h + lin(lin(h, w2), w2), w3).float(), -1).sum()
    torch.testing.assert_close(run(g, *tensors), want)


def test_no_cast_chains_or_duplicates_and_no_cast_before_an_op_that_promotes():
    x = torch.randn(4, 8)
    g, b, (xv,) = graph_with_inputs(x)
    w = g.add_input("w", TensorMeta.of(torch.randn(8, 8)), Role.PARAM, "w")
    y = b(aten.linear.default, xv, w)                   # x -> bf16
    z = b(aten._softmax.default, xv, -1, False)         # x stays fp32 (no bf16 -> fp32 chain)
    y2 = b(aten.linear.default, xv, w)                  # reuses the casts of x and w
    cond = b(aten.gt.Scalar, z, 0.0)
    # where does not promote by itself: the bf16 sum y + y2 goes up to fp32 to meet z; add does (it reads
    # the bf16 sum as it is)
    picked = b(aten.where.self, cond, b(aten.add.Tensor, y, y2), z)
    total = b(aten.add.Tensor, b(aten.add.Tensor, y, y2), z)
    g.outputs = [b(aten.sum.default, b(aten.add.Tensor, picked, total))]
    autocast(g, AmpPolicy(torch.bfloat16))
    casts = [n for n in g.nodes if n.target is aten._to_copy.default]
    # x and w to bf16 once each, and one bf16 sum up to fp32 for where
    assert len(casts) == 3
    assert [n.args[0].name for n in casts[:2]] == [xv.name, "w"]
    assert casts[2].args[0].producer.target is aten.add.Tensor and casts[2].outputs[0].meta.dtype == torch.float32
    assert [u.target for u in g.users()[casts[2].outputs[0]]] == [aten.where.self]
    mixed = [n for n in g.nodes if n.target is aten.add.Tensor and n.args[1] is z]
    assert len(mixed) == 1 and mixed[0].args[0].meta.dtype == torch.bfloat16
    assert mixed[0].outputs[0].meta.dtype == torch.float32
    softmax = next(n for n in g.nodes if n.target is aten._softmax.default)
    assert softmax.args[0] is xv


def test_overrides_per_op_and_per_module():
    g, _ = _mlp_graph()
    autocast(g, AmpPolicy(torch.bfloat16, op_overrides={"aten._softmax": Cast.FOLLOW}))
    assert dtype_of(g, aten._softmax.default) == torch.bfloat16
    g, _ = _mlp_graph()
    for n in g.nodes:
        n.scope = "model.head"
    policy = AmpPolicy.make("bf16", {"model": "lower", "model.head": "fp32"})   # most specific wins
    autocast(g, policy)
    assert count(g, aten._to_copy.default) == 0
    assert dtype_of(g, aten.linear.default) == torch.float32


def test_bad_amp_settings():
    with pytest.raises(kiln.KilnError, match="amp must be"):
        AmpPolicy.make("int8")
    with pytest.raises(kiln.KilnError, match="no op named"):
        AmpPolicy.make("bf16", {"aten.not_an_op": "fp32"})
    with pytest.raises(kiln.KilnError, match="use 'lower'"):
        AmpPolicy.make("bf16", {"model.x": "half"})


def test_parameters_cast_once_per_step_in_a_compiled_model():
    from tests.models import zoo
    model, args, kwargs, _ = zoo.llama()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), amp="bf16")
    step(*args, **kwargs)
    g = step.graph
    param_casts = [n for n in g.nodes if n.target is aten._to_copy.default and n.args[0].role is Role.PARAM]
    sources = [n.args[0].source for n in param_casts]
    assert len(sources) == len(set(sources))                           # each parameter at most once
    linear_weights = {n.args[1].producer.args[0].source for n in g.nodes
                      if n.target is aten.linear.default and n.args[1].producer is not None}
    assert linear_weights <= set(sources)
    # the backward reuses the forward's bf16 weights: no cast in the backward reads a parameter
    assert not [n for n in param_casts if n.phase.value == "backward"]
    text = step.explain()
    assert "bfloat16" in text and "amp bfloat16" in text


class _MaskedScores(torch.nn.Module):
    """Scores masked with the largest negative value of their dtype (as Hugging Face models write it): in
    the fp32 capture that is float32's, which bf16 cannot hold (masked_fill would refuse it)."""

    def __init__(self, fill):
        super().__init__()
        self.q, self.k, self.fill = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), fill

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        fill = torch.finfo(scores.dtype).min if self.fill is None else self.fill
        scores = scores.masked_fill(mask, fill).clamp(min=fill)
        return (scores.softmax(-1).float() @ x).square().mean()


@pytest.mark.parametrize("amp,fill", [("bf16", None), ("fp16", None), ("fp16", -1e9)])
def test_a_mask_value_the_low_dtype_cannot_hold_saturates_to_its_largest(amp, fill):
    torch.manual_seed(0)
    model = _MaskedScores(fill)
    x, mask = torch.randn(2, 8, 16), torch.rand(2, 8, 8) > 0.5
    mask[..., 0] = False                                      # every row keeps one key
    ref = _MaskedScores(fill)
    ref.load_state_dict(model.state_dict())
    loss_ref = ref(x, mask)                                   # fp32 eager: the truth
    loss_ref.backward()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), amp=amp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = step(x, mask)
    assert torch.allclose(loss, loss_ref, rtol=2e-2)
    for n, p in model.named_parameters():
        if n == "k.bias":
            continue                                          # analytically zero: softmax ignores it
        g = before[n] - p.detach()
        want = dict(ref.named_parameters())[n].grad
        assert (g - want).norm() <= 0.05 * want.norm(), n
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    fills = [n.args[2] for n in step.graph.nodes if n.target is aten.masked_fill.Scalar and n.phase.value == "forward"]
    assert fills == [-torch.finfo(low).max]


class _ComplexRotary(torch.nn.Module):
    """Meta-llama-style rotary embedding through complex numbers, after a projection that amp runs in bf16:
    the model's `.float()` is a no-op in the fp32 capture, so amp itself must give view_as_complex fp32."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        angles = torch.outer(torch.arange(8.0), 1.0 / 100 ** (torch.arange(0, 16, 2) / 16))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        q = torch.view_as_complex(self.proj(x).float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(q * self.freqs).flatten(-2).square().mean()


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_complex_views_compute_in_fp32_under_amp(amp):
    torch.manual_seed(0)
    model, x = _ComplexRotary(), torch.randn(2, 8, 16)
    ref = _ComplexRotary()
    ref.load_state_dict(model.state_dict())
    loss_ref = ref(x)
    loss_ref.backward()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), amp=amp)
    before = model.proj.weight.detach().clone()
    assert torch.allclose(step(x), loss_ref, rtol=2e-2)
    assert ((before - model.proj.weight.detach()) - ref.proj.weight.grad).norm() <= 0.05 * ref.proj.weight.grad.norm()
    complex_in = [n.args[0].meta.dtype for n in step.graph.nodes if n.target is aten.view_as_complex.default]
    assert complex_in and set(complex_in) == {torch.float32}


def test_a_large_constant_in_arithmetic_is_kept_under_fp16():
    """`x / 1e6` under fp16: the constant is an operand ATen computes with in fp32, never a fill value to
    saturate (65504 would divide by the wrong number)."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return (self.lin(x) / 1e6 * 1e5).square().mean()

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8)
    want = Scaled()
    want.load_state_dict(model.state_dict())
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.0), amp="fp16")
    assert torch.allclose(step(x), want(x), rtol=1e-2)


@pytest.mark.parametrize("pad_value,moved", [(1.0, True), (1.001, False)])
def test_a_cast_of_moved_data_is_a_cast_of_what_was_moved(pad_value, moved):
    """A bias joined to its weight by unsqueeze, pad and cat, and the input padded with ones (one product for
    both: BERT's decoder as the linear + cross-entropy kernel takes it): the casts go to the parameters and
    the input, the joined values are built in bf16, and the result is the bits of the cast-after graph. A pad
    value bf16 cannot hold keeps its cast after the pad."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)

    def build():
        g, b, (xv, wv, bv) = graph_with_inputs(x, w, bias)
        wv.role = bv.role = Role.PARAM
        column = b(aten.constant_pad_nd.default, b(aten.unsqueeze.default, bv, 1), [0, 7], 0.0)
        joined = b(aten.cat.default, [wv, column], 1)
        padded = b(aten.constant_pad_nd.default, xv, [0, 8], pad_value)
        g.outputs = [b(aten.linear.default, padded, joined)]
        return g
    g = build()
    autocast(g, AmpPolicy(torch.bfloat16))
    cast_of = [n.args[0].producer for n in g.nodes if n.target is aten._to_copy.default]
    assert sum(p is None for p in cast_of) == (3 if moved else 2)          # graph inputs: x, w, bias
    assert (aten.constant_pad_nd.default in {p.target for p in cast_of if p is not None}) == (not moved)
    assert all(p.target is not aten.cat.default for p in cast_of if p is not None)
    lin = torch.nn.functional.linear
    want = lin(torch.nn.functional.pad(x, (0, 8), value=pad_value).bfloat16(),
               torch.cat([w, torch.nn.functional.pad(bias.unsqueeze(1), (0, 7))], 1).bfloat16())
    got = run(g, x, w, bias)
    assert torch.equal(got[0] if isinstance(got, (list, tuple)) else got, want)


def test_bert_masked_lm_has_no_activation_casts_and_trains_as_autocast():
    """BERT's MLM decoder (a bias) goes through the linear + cross-entropy kernel, the bias passed to it: no
    joined matrix or padded input (they were cast to bf16 each step, their gradients back), no cast of the
    weight's or the bias's gradient (AdamW reads them in bf16), and the losses of autocast. (The activation
    casts, the hidden state's gradient's among them, go into Inductor regions, off in this test run.)"""
    import copy

    import transformers

    from kiln.runtime.explain import cast_kinds
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 4096, (4, 64))                   # 256 x 4096 fp32 logits: 4 MiB, the kernel's size
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), amp="bf16")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(5):
        got = step(input_ids=ids, labels=ids)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        opt.step()
        assert abs(got.item() - want.item()) <= 0.02 * abs(want.item()), (got.item(), want.item())
    (lce,) = [n for n in step.graph.nodes if n.op.name == "kiln.linear_cross_entropy_grads"]
    assert len(lce.args) > 6 and lce.args[6] is not None                    # the bias
    assert not any(n.op.name in ("aten.cat", "aten.constant_pad_nd") for n in step.graph.nodes)
    (back,) = [n for n in step.graph.nodes if n.op.name == "kiln.linear_cross_entropy_grads_backward"]
    for n in cast_kinds(step.graph):
        assert n.args[0] not in back.outputs[1:], "a cast of the decoder's weight or bias gradient"
