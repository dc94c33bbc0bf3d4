"""Kiln's compiler knows every kernel as one op: a model calling them trains under kiln.compile
exactly as eager PyTorch trains it, with the kernels (and their fused backwards) kept as single nodes."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln
import kiln.kernels as K
from kiln.dialects import registry as dialect_registry
from kiln.ops.registry import Cast, Kind, by_name, lookup
from tests.kernels.test_export_compile import FORWARD_OPS, Block, _unfused_block, block_inputs

TOL = dict(rtol=1e-4, atol=1e-6)


def _train_eager(model, loss_fn, args, steps, seeds=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        if seeds:
            torch.manual_seed(seeds[i])
        opt.zero_grad()
        loss = loss_fn(model, *args)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _train_kiln(model, args, steps, seeds=None, **kw):
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), **kw)
    losses = []
    for i in range(steps):
        if seeds:
            torch.manual_seed(seeds[i])
        losses.append(step(*args))
    return step, losses


def test_trains_like_the_unfused_pytorch_model():
    """Kiln + fused kernels vs the same weights trained eagerly with plain PyTorch ops (no kernels)."""
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    args = block_inputs()
    step, got = _train_kiln(model, args, steps=3)
    want = _train_eager(ref, _unfused_block, args, steps=3)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")

    names = [n.op.name for n in step.graph.nodes]
    assert "kiln.fallback_forward" not in names
    for op in FORWARD_OPS:
        assert names.count(f"kiln.{op}") == 1, (op, names)
    for bwd in ("rms_norm_backward", "swiglu_linear_backward", "linear_gelu_backward", "swiglu_backward",
                "rope_backward", "dropout_add_layer_norm_backward", "linear_cross_entropy_backward"):
        assert f"kiln.{bwd}" in names, bwd
    assert names.count("kiln.rms_norm_backward") == 2          # rms_norm and add_rms_norm
    # the saved-for-backward outputs feed the backward ops; nothing is recomputed by unfused ATen ops
    assert not any(n in names for n in ("aten.native_layer_norm_backward", "aten.silu_backward", "aten.gelu_backward"))
    kernels = {n.op.name: n.impl.dialect.name for n in step.graph.nodes if n.op.name.startswith("kiln.")
               and n.op.kind is not Kind.OPTIMIZER}
    assert set(kernels.values()) == {"kiln"}, kernels


def test_dropout_trains_like_eager_with_the_same_seed():
    """p > 0: the mask drawn by the compiled forward is the one its backward uses, and with the RNG
    reseeded per step Kiln draws what eager draws (eager runs the same kernel under autograd)."""
    torch.manual_seed(0)
    model = Block(p=0.3)
    ref = copy.deepcopy(model)
    args, seeds = block_inputs(), [11, 12, 13]
    _, got = _train_kiln(model, args, steps=3, seeds=seeds)
    want = _train_eager(ref, lambda m, *a: m(*a), args, steps=3, seeds=seeds)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")


def test_aten_only_dialects_still_run_the_kernels():
    """Kiln cannot take an opaque custom op apart: with only `aten` enabled each kernel node runs the
    custom op as its generic kernel, with the same result."""
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    _, got = _train_kiln(model, block_inputs(), steps=2, dialects=["aten"])
    want = _train_eager(ref, _unfused_block, block_inputs(), steps=2)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)


def test_amp_bf16_follows_the_cast_classes():
    torch.manual_seed(0)
    step = kiln.compile(Block(), optimizer=kiln.optim.SGD(lr=0.1), amp="bf16")
    losses = [step(*block_inputs()).item() for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    fwd = {n.op.name: n for n in step.graph.nodes if n.phase.name == "FORWARD"}
    assert fwd["kiln.swiglu_linear"].outputs[0].meta.dtype == torch.bfloat16     # LOWER
    norm = fwd["kiln.rms_norm"]                                                   # FP32: reads and computes fp32;
    assert norm.args[0].meta.dtype == torch.float32                              # its output is rounded to bf16
    assert norm.kwargs.get("out_dtype") is torch.bfloat16 and norm.outputs[0].meta.dtype == torch.bfloat16  # inside
    assert not any(n.target is torch.ops.aten._to_copy.default and n.args[0] is norm.outputs[0]
                   for n in step.graph.nodes)                                    # (the cast folded, fold_casts)
    assert fwd["kiln.linear_cross_entropy"].args[1].meta.dtype == torch.bfloat16  # the vocab matmul is LOWER
    assert fwd["kiln.linear_cross_entropy"].outputs[0].meta.dtype == torch.float32


EXPECTED = {  # op: (kind, cast)
    "rms_norm": (Kind.NORM, Cast.FP32), "add_rms_norm": (Kind.NORM, Cast.FOLLOW),
    "dropout_add_layer_norm": (Kind.RANDOM, Cast.FP32), "swiglu": (Kind.POINTWISE, Cast.FOLLOW),
    "swiglu_linear": (Kind.MATMUL, Cast.LOWER), "linear_gelu": (Kind.MATMUL, Cast.LOWER),
    "rope": (Kind.POINTWISE, Cast.FOLLOW), "linear_cross_entropy": (Kind.LOSS, Cast.LOWER),
    "linear_cross_entropy_grads": (Kind.LOSS, Cast.LOWER),
    "ctc_loss": (Kind.LOSS, Cast.FP32), "softmax_cross_entropy": (Kind.LOSS, Cast.FP32),
}


@pytest.mark.parametrize("name", list(K.OPS))
def test_registered_as_one_op_with_a_kernel(name):
    target = K.OPS[name]
    op = lookup(target)
    assert op is by_name(f"kiln.{name}") and op.targets == (target,)
    if name.endswith(("_backward", "_backward_sums")):
        assert not op.differentiable and op.vjp is None
    else:
        assert op.vjp is not None and (op.kind, op.cast) == EXPECTED[name]
    impls = {i.dialect.name: i for i in dialect_registry.impls_for(target)}
    # the op's Python body, called without the dispatcher (`kiln.kernels._common.direct`; test_opcheck compares
    # the two on every sample); no run-time fallback, which would run the same body again
    assert impls["kiln"].kernel is not target and callable(impls["kiln"].kernel) and not impls["kiln"].fallback
    # the only other providers: fp32-copy kernels for low-precision matmul-class ops (`upcast` dialect), and the
    # fused loss on oneDNN's fp32 products (`onednn`, measured)
    others = ({"upcast"} if op.cast is Cast.LOWER else set()) | ({"onednn"} if name == "linear_cross_entropy_grads"
                                                                else set())
    assert set(impls) - {"kiln"} <= others
    assert dialect_registry.DIALECTS["kiln"].priority == 5


class _TanhGeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.up(x), approximate="tanh")
        return torch.nn.functional.mse_loss(self.down(h), y)


@pytest.mark.parametrize("dialects", [None, ["aten"]], ids=["kiln", "aten-only"])
def test_tanh_gelu_runs_the_native_loop_and_trains_like_eager(dialects):
    """aten.gelu(approximate="tanh") and its backward take the `kiln` dialect's single-pass loops (where the
    native library builds) and train as eager PyTorch does; with the dialect off, ATen's kernels run."""
    from kiln.kernels import native
    torch.manual_seed(0)
    model = _TanhGeluMLP()
    ref = copy.deepcopy(model)
    args = (torch.randn(32, 16), torch.randn(32, 16))
    step, got = _train_kiln(model, args, steps=3, dialects=dialects)
    want = _train_eager(ref, lambda m, *a: m(*a), args, steps=3)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    chosen = {n.op.name: n.impl.label for n in step.graph.nodes if n.op.name in ("aten.gelu", "aten.gelu_backward")}
    assert set(chosen) == {"aten.gelu", "aten.gelu_backward"}, chosen
    if dialects is None and native.library() is not None:
        assert chosen == {"aten.gelu": "kiln:gelu", "aten.gelu_backward": "kiln:gelu_backward"}, chosen
    elif dialects is not None:
        assert set(chosen.values()) == {"aten"}, chosen
