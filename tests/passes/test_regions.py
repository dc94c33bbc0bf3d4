"""Region fusion: which ops are grouped (and which must not be), and the `inductor` dialect that compiles
each region: numerics against the unfused ATen ops, one compile per distinct region, the disk cache,
and the fallbacks when Inductor cannot compile or a compiled kernel fails."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from kiln.dialects import inductor
from kiln.ir.graph import Phase
from kiln.ops.registry import Kind
from kiln.passes import regions as regions_pass
from kiln.passes.dispatch import dispatch
from kiln.passes.regions import Region, group, structural_key
from kiln.runtime.codegen import generate
from tests.passes.graphs import aten, fuse_regions, graph_with_inputs

NAMES = ("inductor", "aten")
pytestmark = pytest.mark.inductor


def _pointwise(n) -> bool:
    return n.op.kind in (Kind.POINTWISE, Kind.REDUCTION, Kind.VIEW) and not n.op.side_effects


def _groups(g, max_ops=64):
    return [[n.op.name.split(".")[1] for n in nodes] for nodes in group(g, inductor.accepts, max_ops)]


def _run(g, *tensors):
    dispatch(g, NAMES)
    return generate(g, return_all=True)[1](*tensors)


def _regions(g) -> list[Region]:
    return [n.target for n in g.nodes if isinstance(n.target, Region)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty region cache, and every compiled region kept (not only those faster than ATen here)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")
    return tmp_path


# ---- grouping ------------------------------------------------------------------------------------
def test_a_chain_of_pointwise_ops_and_its_reduction_is_one_region():
    g, b, (x, y) = graph_with_inputs(torch.randn(8, 16), torch.randn(8, 16))
    s = b(aten.mul.Tensor, b(aten.sigmoid.default, x), y)
    g.outputs = [b(aten.sum.dim_IntList, b(aten.add.Tensor, s, 1.0), [1])]
    assert _groups(g) == [["sigmoid", "mul", "add", "sum"]]


def test_never_across_a_matmul():
    g, b, (x, w) = graph_with_inputs(torch.randn(8, 16), torch.randn(16, 16))
    h = b(aten.mul.Tensor, b(aten.add.Tensor, x, 1.0), 2.0)
    m = b(aten.mm.default, h, w)
    g.outputs = [b(aten.mul.Tensor, b(aten.relu.default, m), h)]
    got = _groups(g)
    assert got == [["add", "mul"], ["relu", "mul"]]


def test_a_region_does_not_swallow_a_path_through_a_matmul():
    """a -> mm(a) -> c(a, mm): joining c to a's region would need mm's result before a is computed."""
    g, b, (x, w) = graph_with_inputs(torch.randn(8, 16), torch.randn(16, 16))
    a = b(aten.exp.default, b(aten.neg.default, x))
    m = b(aten.mm.default, a, w)
    c = b(aten.mul.Tensor, b(aten.add.Tensor, m, a), a)
    g.outputs = [c]
    got = _groups(g)
    assert ["neg", "exp"] in got and all(not ({"neg", "add"} <= set(r)) for r in got)


def test_fused_graph_keeps_a_valid_order_and_values(cache):
    tensors = [torch.randn(8, 16), torch.randn(16, 16)]
    g, b, (x, w) = graph_with_inputs(*tensors)
    a = b(aten.exp.default, b(aten.neg.default, x))
    m = b(aten.mm.default, a, w)
    s = b(aten.sum.dim_IntList, b(aten.mul.Tensor, a, a), [1], True)     # joins a's region, moved up before mm
    g.outputs = [b(aten.mul.Tensor, b(aten.add.Tensor, m, a), s)]
    want = _eager_outputs(g, tensors)
    with_regions(g)
    seen = set(v.uid for v in g.inputs)
    for n in g.nodes:                      # every value is computed before it is read
        assert all(v.uid in seen for v in n.inputs), n
        seen.update(o.uid for o in n.outputs)
    assert len(_regions(g)) == 2
    torch.testing.assert_close(_run(g, *tensors)[0], want[0], rtol=1e-5, atol=1e-5)


def test_a_reduction_needed_by_two_later_regions_is_computed_once(cache):
    g, b, (x, y, w) = graph_with_inputs(torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 16))
    p = b(aten.mul.Tensor, x, y)
    r = b(aten.sum.dim_IntList, p, [1], True)                                          # region A
    m = b(aten.mm.default, p, w)                                                       # needs A: a barrier
    u = b(aten.mul.Tensor, b(aten.sub.Tensor, m, r), 2.0)                             # region B reads r
    v = b(aten.mm.default, u, w)
    z = b(aten.div.Tensor, b(aten.add.Tensor, v, r), 3.0)                             # region C reads r
    g.outputs = [z]
    tensors = [torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 16)]
    assert _groups(g) == [["mul", "sum"], ["sub", "mul"], ["add", "div"]]
    want = _eager_outputs(g, tensors)
    with_regions(g)
    regs = _regions(g)
    assert [r_.ops for r_ in regs] == [("aten.mul.Tensor", "aten.sum"), ("aten.sub.Tensor", "aten.mul.Tensor"),
                                       ("aten.add.Tensor", "aten.div.Tensor")]
    producers = [n for n in g.nodes if r in n.outputs]
    assert len(producers) == 1 and producers[0].target is regs[0]                    # computed once
    assert sum(r in n.inputs for n in g.nodes) == 2                                    # read by B and C
    torch.testing.assert_close(_run(g, *tensors)[0], want[0])


def test_a_region_started_after_a_merge_does_not_replace_another():
    g, b, (x, y, z, w) = graph_with_inputs(*(torch.randn(8, 16) for _ in range(4)))
    chain = lambda v: b(aten.neg.default, b(aten.exp.default, v))  # noqa: E731
    a, c, e = chain(x), chain(y), chain(z)
    d = b(aten.add.Tensor, a, c)                    # merges x's and y's regions
    f = chain(w)                                    # a new region after the merge
    g.outputs = [d, e, f]
    assert sorted(_groups(g)) == sorted([["exp", "neg", "exp", "neg", "add"], ["exp", "neg"], ["exp", "neg"]])


def test_siblings_reading_one_tensor_share_a_region():
    g, b, (x,) = graph_with_inputs(torch.randn(8, 16))
    s1 = b(aten.sum.dim_IntList, x, [1])
    s2 = b(aten.sum.dim_IntList, b(aten.mul.Tensor, x, x), [1])
    g.outputs = [s1, s2]
    assert _groups(g) == [["sum", "mul", "sum"]]


def test_random_ops_and_side_effects_stay_out():
    g, b, (x, p) = graph_with_inputs(torch.randn(8, 16), torch.randn(8, 16))
    a = b(aten.mul.Tensor, b(aten.add.Tensor, x, 1.0), 2.0)
    noise = b(aten.rand_like.default, a)
    c = b(aten.mul.Tensor, b(aten.add.Tensor, a, noise), 3.0)
    effect = b(aten.sub.Tensor, p, c).producer
    effect.op = dataclasses.replace(effect.op, side_effects=True)     # as an in-place update would be
    g.outputs = [c]
    grouped = {id(n) for nodes in group(g, inductor.accepts) for n in nodes}
    assert id(noise.producer) not in grouped and id(effect) not in grouped
    assert len(grouped) == 4


def test_regions_are_capped():
    g, b, (x,) = graph_with_inputs(torch.randn(8, 16))
    v = x
    for _ in range(10):
        v = b(aten.mul.Tensor, b(aten.add.Tensor, v, 1.0), 0.5)
    g.outputs = [v]
    sizes = [len(r) for r in _groups(g, max_ops=6)]
    assert sum(sizes) == 20 and max(sizes) <= 6


def test_lone_ops_and_views_are_left_alone():
    g, b, (x, w) = graph_with_inputs(torch.randn(8, 16), torch.randn(16, 16))
    m = b(aten.mm.default, b(aten.relu.default, x), b(aten.t.default, w))
    g.outputs = [b(aten.view.default, b(aten.neg.default, m), [16, 8])]
    assert _groups(g) == []


def test_forward_and_backward_ops_are_not_mixed():
    g, b, (x,) = graph_with_inputs(torch.randn(8, 16))
    a = b(aten.exp.default, x)
    b.phase = Phase.BACKWARD
    c = b(aten.mul.Tensor, a, 2.0)
    g.outputs = [b(aten.add.Tensor, c, a)]
    assert _groups(g) == [["mul", "add"]]


def test_structural_key_equal_for_repeated_layers_and_different_for_other_shapes():
    def layer(b, v):
        return b(aten.mul.Tensor, b(aten.tanh.default, v), 0.5)
    g, b, (x, y, z) = graph_with_inputs(torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16))
    g.outputs = [layer(b, x), layer(b, y), layer(b, z)]
    groups = group(g, inductor.accepts)
    keys = []
    for nodes in groups:
        reg = regions_pass.make_region(nodes, 0, g.users(), g.live_outputs())
        keys.append(reg.key)
        assert reg.key == structural_key(reg.nodes, reg.inputs, reg.outputs)
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]


# ---- the inductor dialect --------------------------------------------------------------------------
def _graph_with_layer_norm_chain():
    tensors = [torch.randn(4, 8, 32), torch.randn(4, 8, 32), torch.randn(32), torch.randn(32)]
    g, b, (x, r, w, bias) = graph_with_inputs(*tensors)
    h = b(aten.add.Tensor, x, r)
    out, mean, rstd = b(aten.native_layer_norm.default, h, [32], w, bias, 1e-5)
    g.outputs = [b(aten.mul.Tensor, b(aten.gelu.default, out), 1.5), h]
    return g, tensors


def with_regions(g):
    """Fuse regions in g; returns how many were kept (compiled kernels replacing their ops)."""
    return sum(r.compiled is not None for r in fuse_regions(g, NAMES))


def _eager_outputs(g, tensors):
    import copy
    g2 = copy.deepcopy(g)
    dispatch(g2, ("aten",))
    return generate(g2, return_all=True)[1](*tensors)


def test_inductor_region_matches_aten_and_is_cached_on_disk(cache, monkeypatch):
    g, tensors = _graph_with_layer_norm_chain()
    want = _eager_outputs(g, tensors)
    assert with_regions(g) == 1
    (reg,) = _regions(g)
    assert reg.compiled is not None and reg.failed is None
    assert set(reg.ops) >= {"aten.add.Tensor", "aten.native_layer_norm", "aten.gelu"}
    got = _run(g, *tensors)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    files = {f.name for f in inductor.cache_dir().iterdir()} - {"lowerable.json", "index.json"}   # which ops Inductor takes
    assert files == {f"{reg.key}.py", f"{reg.key}.timing.json"}
    assert set(reg.timing) == {"compiled_ms", "aten_ms"}

    # a second compilation of the same graph loads the kernel from the cache: nothing is compiled
    def refuse(region):
        raise AssertionError("compiled again despite the cache")
    monkeypatch.setattr(inductor, "_compile_source", refuse)
    g2, _ = _graph_with_layer_norm_chain()
    with_regions(g2)
    (reg2,) = _regions(g2)
    assert reg2.key == reg.key and reg2.compiled is not None
    for a, e in zip(_run(g2, *tensors), want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_identical_regions_compile_once(cache, monkeypatch):
    calls = []
    real = inductor._compile_source
    monkeypatch.setattr(inductor, "_compile_source", lambda r: calls.append(r.key) or real(r))
    tensors = [torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 16)]
    g, b, (x, y, w) = graph_with_inputs(*tensors)
    v = x
    for _ in range(3):          # three "layers": the same region between matmuls
        v = b(aten.mm.default, b(aten.mul.Tensor, b(aten.tanh.default, v), y), w)
    g.outputs = [v]
    want = _eager_outputs(g, tensors)
    assert with_regions(g) == 3
    assert len(calls) == 1
    torch.testing.assert_close(_run(g, *tensors)[0], want[0], rtol=1e-5, atol=1e-5)


def test_a_region_inductor_cannot_compile_runs_unfused_with_a_warning(cache, monkeypatch, caplog):
    def broken(region):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(inductor, "_compile_source", broken)
    g, tensors = _graph_with_layer_norm_chain()
    want = _eager_outputs(g, tensors)
    before = [n.op.name for n in g.nodes]
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert with_regions(g) == 0
    assert any("could not compile" in r.getMessage() and "no C++ compiler" in r.getMessage() for r in caplog.records)
    assert [n.op.name for n in g.nodes] == before
    for a, e in zip(_run(g, *tensors), want):
        torch.testing.assert_close(a, e)
    assert not list(cache.rglob("*.py"))


def test_a_kernel_failing_at_run_time_hands_over_to_the_aten_ops(cache, caplog):
    g, tensors = _graph_with_layer_norm_chain()
    want = _eager_outputs(g, tensors)
    with_regions(g)
    (reg,) = _regions(g)

    def broken(args):
        raise RuntimeError("kernel crashed")
    reg.compiled = broken
    with caplog.at_level(logging.WARNING, logger="kiln"):
        got = _run(g, *tensors)
    assert any("failed at run time" in r.getMessage() for r in caplog.records)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_a_kernel_returning_other_strides_is_not_used(cache, caplog):
    g, tensors = _graph_with_layer_norm_chain()
    want = _eager_outputs(g, tensors)
    with_regions(g)
    (reg,) = _regions(g)
    real = reg.compiled
    reg.compiled = lambda args: tuple(t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 3 else t
                                      for t in real(args))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        got = _run(g, *tensors)
    assert any("strides" in r.getMessage() for r in caplog.records)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert a.stride() == e.stride()


def test_only_regions_faster_than_their_aten_ops_replace_them(cache, monkeypatch, caplog):
    monkeypatch.setenv("KILN_KEEP", "faster")
    monkeypatch.setattr(inductor, "_measured", lambda folder, key, region, kernel=None: {"compiled_ms": 1.0, "aten_ms": 1.0})
    g, tensors = _graph_with_layer_norm_chain()
    before = [n.op.name for n in g.nodes]
    with caplog.at_level(logging.INFO, logger="kiln"):
        assert with_regions(g) == 0
    assert [n.op.name for n in g.nodes] == before
    assert any("not faster than their ATen ops" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(inductor, "_measured", lambda folder, key, region, kernel=None: {"compiled_ms": 0.01, "aten_ms": 0.03})
    g, tensors = _graph_with_layer_norm_chain()
    assert with_regions(g) == 0                  # 3x faster, but 20 microseconds are not worth a compiler
    monkeypatch.setattr(inductor, "_measured", lambda folder, key, region, kernel=None: {"compiled_ms": 0.5, "aten_ms": 1.0})
    g, tensors = _graph_with_layer_norm_chain()
    assert with_regions(g) == 1


def test_the_timing_is_measured_once_and_cached(cache, monkeypatch):
    g, tensors = _graph_with_layer_norm_chain()
    with_regions(g)
    (reg,) = _regions(g)
    path = inductor.cache_dir() / f"{reg.key}.timing.json"
    assert path.exists() and all(v > 0 for v in reg.timing.values())
    monkeypatch.setattr(inductor.measure, "example", lambda meta: (_ for _ in ()).throw(AssertionError("timed again")))
    g2, _ = _graph_with_layer_norm_chain()
    with_regions(g2)
    assert _regions(g2)[0].timing == reg.timing


def test_kiln_dialects_environment_variable(monkeypatch):
    from kiln.dialects import registry
    from kiln.errors import KilnError
    everything = ("upcast", "sdpa", "kiln", "inductor", "aten")
    assert registry.from_env("", everything) == everything
    assert registry.from_env("-inductor, -upcast", everything) == ("sdpa", "kiln", "aten")
    assert registry.from_env("kiln,sdpa", everything) == ("kiln", "sdpa", "aten")
    for bad, words in [("-aten", "cannot be turned off"), ("kiln,-sdpa", "not both"), ("-nope", "unknown")]:
        with pytest.raises(KilnError, match=words):
            registry.from_env(bad, everything)
    monkeypatch.setenv("KILN_DIALECTS", "-inductor")
    assert "inductor" not in registry.enabled() and "aten" in registry.enabled()


def test_regions_too_cheap_to_gain_are_not_compiled(cache, monkeypatch, caplog):
    monkeypatch.setenv("KILN_KEEP", "faster")
    monkeypatch.setattr(inductor.measure, "medians", lambda fns, runs=5: {name: 0.02 for name in fns})
    monkeypatch.setattr(inductor, "_compile_source", lambda r: (_ for _ in ()).throw(AssertionError("compiled")))
    g, _ = _graph_with_layer_norm_chain()
    with caplog.at_level(logging.INFO, logger="kiln"):
        assert with_regions(g) == 0
    (timing,) = [f for f in inductor.cache_dir().glob("*.timing.json")]
    assert json.loads(timing.read_text()) == {"aten_ms": 0.02}


def test_summary_says_what_became_of_each_region(cache, monkeypatch):
    from kiln.passes.regions import summary
    monkeypatch.setenv("KILN_KEEP", "faster")
    monkeypatch.setattr(inductor, "_measured", lambda folder, key, region, kernel=None: {"compiled_ms": 2.0, "aten_ms": 1.0})
    g, _ = _graph_with_layer_norm_chain()
    regs = fuse_regions(g, NAMES)
    assert summary(regs) == "regions: 1 found (1 distinct): 1 not faster than ATen"
    monkeypatch.setattr(inductor, "_measured", lambda folder, key, region, kernel=None: {"compiled_ms": 0.5, "aten_ms": 1.0})
    g, _ = _graph_with_layer_norm_chain()
    regs = fuse_regions(g, NAMES)
    assert summary(regs) == ("regions: 1 found (1 distinct): 1 kept; kept regions measured 0.50 ms faster than "
                             "their ATen ops per step")


def test_the_shipped_op_table_is_what_inductor_says():
    """Grouping reads which ops Inductor takes from kiln/dialects/inductor_ops.json (no 2 s import of
    Inductor); it must say what Inductor itself says, for every op in Kiln's registry of those kinds."""
    table = json.loads(inductor.OP_TABLE.read_text())
    if table["torch"] != torch.__version__:
        pytest.skip(f"the table is for torch {table['torch']}; regenerate it with "
                    "`python -m kiln.dialects.inductor --write-op-table`")
    assert table == inductor.op_table()


# ---- under a memory budget ---------------------------------------------------------------------------
def _sum_of_products():
    """Four products made one after the other, each summed as it comes (the slices' partial weight gradients):
    one region of the adds runs after the last product, so it would hold all four at once."""
    g, b, (x, w) = graph_with_inputs(torch.randn(256, 64), torch.randn(64, 256))
    acc = None
    for _ in range(4):
        p = b(aten.mm.default, x, w)                # 256 x 256 fp32: 256 KiB each
        acc = p if acc is None else b(aten.add.Tensor, acc, p)
    g.outputs = [b(aten.sum.default, acc)]
    return g


def test_a_region_that_would_hold_its_inputs_past_the_budget_stays_unfused():
    from kiln.passes import memory
    g = _sum_of_products()
    free = regions_pass.find_regions(g, NAMES)
    assert any(len(r.nodes) >= 3 for r in free)     # unconstrained: the adds are one region
    peak = memory.profile(g).peak
    limited = regions_pass.find_regions(g, NAMES, limit=peak)
    held = [r for r in limited if sum(x.op.name == "aten.add.Tensor" for x in r.nodes) >= 2]
    assert not held, [r.ops for r in limited]
    unit = {}                                       # what is left, placed, stays within the limit
    for r in limited:
        node = regions_pass.Node(regions_pass.REGION_OP, None, tuple(r.inputs), {}, list(r.outputs), Phase.FORWARD)
        unit.update({x.uid: node for x in r.nodes})
    trial = type(g)()
    trial.inputs, trial.outputs, trial.nodes = g.inputs, g.outputs, regions_pass._placed(g.nodes, unit)
    assert memory.profile(trial).peak <= peak
