"""Dynamic shapes: which programs are compiled for which batches, the guards that keep a program to the sizes
it was compiled for, and the policy's options. Numerics are always checked against eager training."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from tests.models import zoo


def _train(step, ref, opt, batches, loss):
    for args in batches:
        got = step(*args)
        opt.zero_grad()
        want = loss(ref, *args)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(step.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def _gpt2():
    model = zoo.gpt2()[0]
    return model, copy.deepcopy(model)


def test_one_recompile_serves_every_length_and_the_smaller_last_batch():
    """dynamic=None: a static program for the first batch, one dynamic program for everything after, the
    smaller last batch included: at most 2 compiles, never one per size."""
    model, ref = _gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=_lm_loss)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    lengths = [12, 9, 15, 7, 12, 11]
    batches = [(torch.randint(0, zoo.VOCAB, (3, t)),) for t in lengths] + [(torch.randint(0, zoo.VOCAB, (2, 10)),)]
    _train(step, ref, opt, batches, _lm_loss)
    info = step.cache_info()
    assert info.compiles == 2, str(info)
    static, dynamic = sorted(info.programs, key=lambda p: p.dynamic)
    assert not static.dynamic and static.calls == 2          # the first batch and the repeated length 12
    assert dynamic.dynamic and dynamic.calls == 5
    assert "s" in dynamic.signature and "[3, 12]" in static.signature, str(info)
    assert info.compile_seconds > 0


def test_dynamic_true_compiles_once_and_its_source_reads_the_sizes():
    model, ref = _gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=_lm_loss, dynamic=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(step, ref, opt, [(torch.randint(0, zoo.VOCAB, (b, t)),) for b, t in [(2, 12), (3, 7), (4, 16)]], _lm_loss)
    assert step.cache_info().compiles == 1
    assert ".size(" in step.source()                       # the sizes come from the inputs at every call


def test_named_dimensions_keep_the_others_static():
    model, ref = _gpt2()
    spec = {"input_ids": {1: "seq"}, "labels": {1: "seq"}}
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), dynamic=spec)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss
    for b, t in [(2, 12), (2, 7), (2, 16)]:
        ids = torch.randint(0, zoo.VOCAB, (b, t))
        got = step(input_ids=ids, labels=ids)
        opt.zero_grad()
        want = loss(ref, ids)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    info = step.cache_info()
    assert info.compiles == 1 and "[2, s" in info.programs[0].signature, str(info)
    ids = torch.randint(0, zoo.VOCAB, (3, 8))            # another batch size: the spec keeps it static
    step(input_ids=ids, labels=ids)
    assert step.cache_info().compiles == 2


class SizeBranch(nn.Module):
    """A Python branch on a size: the program compiled for short inputs must never run a long one."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x) if x.shape[1] > 8 else self.b(x)
        return h.pow(2).mean()


def test_a_branch_on_a_size_is_a_guard_and_the_other_side_compiles_its_own_program():
    model = SizeBranch()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), dynamic=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [(torch.randn(2, t, 6),) for t in (4, 6, 12, 5, 16)]
    _train(step, ref, opt, batches, lambda m, x: m(x))
    info = step.cache_info()
    assert info.compiles == 2, str(info)                  # one program per side of the branch
    assert any("x.size(1)" in g or "arg0.size(1)" in g for p in info.programs for g in p.guards), str(info)
    text = kiln.explain(step, file=__import__("io").StringIO())
    assert "guards" in text


def test_past_max_programs_training_goes_on_with_one_warning(caplog):
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, x: m(x).square().mean(),
                        dynamic=False, max_programs=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _train(step, ref, opt, [(torch.randn(n, 5),) for n in (2, 3, 4, 5, 2)], lambda m, x: m(x).square().mean())
    warnings = [r for r in caplog.records if "max_programs" in r.getMessage()]
    assert len(warnings) == 1
    info = step.cache_info()
    assert len(info.programs) <= 2 and info.evictions >= 1, str(info)


@pytest.mark.parametrize("spec, match", [
    ("yes", "dynamic must be"),
    ({"input_ids": [1]}, "give each argument"),
    ({"input_ids": {1: "not a name"}}, "give each argument"),
])
def test_bad_specs_are_refused_at_compile(spec, match):
    with pytest.raises(kiln.KilnError, match=match):
        kiln.compile(nn.Linear(2, 2), optimizer=kiln.optim.SGD(lr=0.1), dynamic=spec)


def test_a_spec_naming_what_the_call_does_not_pass_is_refused():
    model = nn.Linear(4, 2)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, x: m(x).sum(),
                        dynamic={"input_ids": {1: "seq"}})
    with pytest.raises(kiln.KilnError, match="input_ids"):
        step(torch.randn(3, 4))


def test_a_named_dimension_the_model_fixes_is_refused_with_its_reason():
    model = nn.Linear(4, 2)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, x: m(x).sum(), dynamic={0: {1: "f"}})
    with pytest.raises(kiln.KilnError, match="cannot be"):
        step(torch.randn(3, 4))


def test_symbolic_sizes_are_never_embedded_as_constants():
    """A SymInt object in generated code would run as the compiled batch's size: the printer refuses."""
    from kiln.ir.printer import Symbols
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, DimDynamic
    from torch._dynamo.source import ConstantSource
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(5, ConstantSource("x"), dynamic_dim=DimDynamic.DYNAMIC), hint=5)
    with pytest.raises(AssertionError, match="symbolic size"):
        Symbols().constant([s])


def test_loss_with_a_mean_over_a_dynamic_size_is_exact():
    """A reduction's gradient divides by a count that depends on the batch's sizes (mean over tokens)."""
    class Mean(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x * self.w).mean() + (x * self.w).sum(1).var()
    model = Mean()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), dynamic=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(step, ref, opt, [(torch.randn(n, 3),) for n in (4, 9, 2, 30)], lambda m, x: m(x))


@pytest.mark.inductor
def test_fused_regions_compiled_for_symbolic_sizes_match_eager(monkeypatch):
    """Inductor regions of a dynamic program are compiled once for symbolic sizes and run for every batch."""
    from kiln.passes.regions import Region
    monkeypatch.setenv("KILN_KEEP", "all")
    model, ref = _gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=_lm_loss, dynamic=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(step, ref, opt, [(torch.randint(0, zoo.VOCAB, (b, t)),) for b, t in [(2, 12), (3, 7), (2, 16)]], _lm_loss)
    regions = [n.target for n in step.graph.nodes if isinstance(n.target, Region)]
    assert regions and all(r.compiled is not None and r.failed is None for r in regions)
    assert any(r.sizes for r in regions), "regions of a dynamic program take its symbolic sizes"


def test_a_kernel_compiled_under_guards_runs_the_reference_outside_them():
    import sympy
    from kiln.dialects.inductor import Kernel
    from kiln.passes.regions import Region
    ran = []
    kernel = Kernel(lambda args: ran.append("kernel") or (args[1] * 2,), ["z0 <= 4"])
    region = Region([], [], [], "k", "r", lambda n, x: ran.append("reference") or (x * 2,),
                    sizes=[sympy.Symbol("s0")])
    region.compiled, region.checked = kernel, True
    x = torch.ones(3)
    region(3, x)
    region(9, x)
    assert ran == ["kernel", "reference"]


def test_measured_kernels_are_chosen_per_size_bucket(monkeypatch):
    """oneDNN linear in a dynamic program: measured per size bucket, each bucket's choice kept."""
    from kiln.dialects import measure, registry
    impl = next(i for i in registry.impls_for(torch.ops.aten.linear.default) if i.dialect.name == "onednn")
    real, seen, ran = impl.kernel, [], []

    def spy(x, w, b=None):
        seen.append(x.numel())
        return real(x, w, b)
    monkeypatch.setattr(impl, "kernel", spy)

    def medians(fns, runs=5):       # "measured": oneDNN wins on inputs under 200 elements, loses above
        fns["new_ms"]()
        return {"new_ms": 1.0 if seen[-1] < 200 else 3.0, "aten_ms": 2.0}
    monkeypatch.setattr(measure, "medians", medians)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    loss = lambda m, x: m(x).square().mean()          # noqa: E731
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=loss, dialects=["onednn"], dynamic=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(step, ref, opt, [(torch.randn(n, 4),) for n in (5, 100, 6, 120)], loss)
    ran = seen[:]
    seen.clear()
    _train(step, ref, opt, [(torch.randn(n, 4),) for n in (7, 110)], loss)
    assert seen and all(n < 200 for n in seen), "big batches run ATen's linear, small ones oneDNN's"
    assert any(n >= 200 for n in ran), "every bucket was measured on its first call"


def test_a_failing_dynamic_compile_falls_back_to_static_programs(monkeypatch, caplog):
    """dynamic=None never stops training over a dynamic compile: it warns once and compiles per shape."""
    from kiln.runtime import shapes

    def broken(*a, **k):
        raise RuntimeError("injected failure of the dynamic compile")
    monkeypatch.setattr(shapes, "dynamic_signature", broken)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    loss = lambda m, x: m(x).square().mean()          # noqa: E731
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=loss)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _train(step, ref, opt, [(torch.randn(n, 5),) for n in (2, 3, 4)], loss)
    assert sum("could not compile" in r.getMessage() for r in caplog.records) == 1
    info = step.cache_info()
    assert info.compiles == 3 and not any(p.dynamic for p in info.programs), str(info)
    with pytest.raises(RuntimeError, match="injected"):
        kiln.compile(copy.deepcopy(model), optimizer=kiln.optim.SGD(lr=0.1), loss_fn=loss, dynamic=True)(
            torch.randn(2, 5))
