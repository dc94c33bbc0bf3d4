"""The memory model (kiln/passes/memory.py) against the allocator, and rematerialization under a budget
(kiln/passes/remat.py) against eager training: the budget holds, measured, and training is unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.runtime.memory import allocated, parse_budget

needs_allocator = pytest.mark.skipif(allocated() is None, reason="measuring needs glibc's mallinfo2")


class Deep(nn.Module):
    """An MLP whose activations dominate its memory: wide hidden layers, elementwise ops between them."""

    def __init__(self, d=64, h=1024, layers=3, p=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Dropout(p), nn.Linear(h, d))
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = self.norm(x + b(x))
        return x.square().mean()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws its model and batch from the same seed, whatever ran before it in the process: AdamW's
    first updates are sign(grad) * lr for any gradient far above eps, so an entry whose gradient nearly
    cancels turns float-order noise into a visible difference, and
    which entries do depends on the draw (seeds 0-7: at most 2.1e-6 over rtol; one unseeded draw in a
    full run: 4.2e-5)."""
    torch.manual_seed(0)


def _train(step, ref, x, steps=3):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for i in range(steps):
        torch.manual_seed(10 + i)
        got = step(x)
        torch.manual_seed(10 + i)
        opt.zero_grad()
        want = ref(x)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(step.model.parameters(), ref.parameters()):    # AdamW divides by sqrt(v): near-zero gradients
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)     # amplify float-order noise to ~2e-6


@needs_allocator
def test_the_predicted_peak_is_the_allocators():
    model = Deep()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3))
    step(torch.randn(512, 64))
    rep = step.memory(measure=True)
    assert abs(rep.predicted_peak - rep.measured_peak) <= 0.10 * rep.measured_peak, str(rep)
    assert rep.live and rep.saved > 0 and "kept for the backward" in str(rep)


@needs_allocator
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_budget_recomputes_activations_holds_measured_and_trains_like_eager(p):
    x = torch.randn(512, 64)
    model = Deep(p=p)
    ref = copy.deepcopy(model)
    free = kiln.compile(copy.deepcopy(model), optimizer=kiln.optim.AdamW(lr=1e-3))
    free(x)
    unconstrained = free.memory().predicted_peak
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget=0.8)
    _train(step, ref, x)
    rep = step.memory(measure=True)
    budget = rep.budget
    assert rep.recomputed and rep.extra_flops > 0, str(rep)
    assert rep.predicted_peak <= budget < unconstrained
    assert rep.measured_peak <= budget * 1.02, str(rep)       # the allocator agrees (2 %: its own bookkeeping)
    assert "_re" in step.source()                             # the recomputation is visible where it runs
    if p:                                                     # dropout is never recomputed: its masks are kept
        assert not any(r.startswith("aten.native_dropout") for r in rep.recomputed)


def test_a_budget_that_cannot_be_met_says_the_smallest_peak():
    step = kiln.compile(Deep(), optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget="1MiB")
    with pytest.raises(kiln.KilnError, match="smallest predicted peak"):
        step(torch.randn(512, 64))


def test_a_fraction_is_of_the_unconstrained_peak():
    step = kiln.compile(Deep(), optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget=0.85)
    step(torch.randn(512, 64))
    rep = step.memory()
    assert rep.budget == int(0.85 * rep.unconstrained) and rep.predicted_peak <= rep.budget


@pytest.mark.parametrize("value, want", [(None, None), (1000, 1000), ("6GiB", 6 * 2 ** 30), ("512 MiB", 512 * 2 ** 20),
                                         ("1.5GB", 1_500_000_000), (0.5, 0.5)])
def test_budgets_parse(value, want):
    assert parse_budget(value) == want


@pytest.mark.parametrize("value", ["6 parsecs", "-1GiB", 1.5, 0.0, -3, True, [1]])
def test_bad_budgets_are_refused(value):
    with pytest.raises(kiln.KilnError, match="memory_budget"):
        kiln.compile(nn.Linear(2, 2), optimizer=kiln.optim.SGD(lr=0.1), memory_budget=value)


def test_a_dynamic_program_under_a_budget_guards_its_peak():
    """A batch much bigger than the one a dynamic program planned for compiles its own program."""
    model = Deep(layers=2)
    ref = copy.deepcopy(model)
    x = torch.randn(256, 64)
    free = kiln.compile(copy.deepcopy(model), optimizer=kiln.optim.AdamW(lr=1e-3))
    free(x)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget=0.9, dynamic=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for n in (256, 200, 2048):
        x = torch.randn(n, 64)
        try:
            step(x)
        except kiln.KilnError as e:                  # the big batch cannot fit: said, with nothing written
            assert n == 2048 and "cannot be met" in str(e)
            break
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    info = step.cache_info()
    assert any("memory" in g for p in info.programs for g in p.guards), str(info)
    for p, q in zip(step.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


MIB = 2 ** 20


def _probe(model, x) -> tuple[int, int]:
    """(bytes the process holds beyond a step's tensors, the step's unconstrained peak) on a copy of model."""
    probe = kiln.compile(copy.deepcopy(model), optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget="1TiB")
    probe(x)
    rep = probe.memory()
    probe.close()
    return rep.outside, rep.unconstrained


@needs_allocator
def test_a_byte_budget_covers_what_the_process_holds_besides_the_step():
    """Bytes are a budget for the process's heap: what it holds beyond the step's tensors (here 64 MiB the
    test keeps) leaves that much less for the step, which recomputes to fit; the allocator agrees."""
    x = torch.randn(512, 64)
    model = Deep()
    ref = copy.deepcopy(model)
    _probe(model, x)                                    # torch's first-run allocations happen here
    before, unconstrained = _probe(model, x)
    ballast = torch.ones(16 * MIB)                      # 64 MiB outside any step
    outside, _ = _probe(model, x)
    assert 60 * MIB <= outside - before <= 68 * MIB, (before, outside)
    budget = outside + int(0.8 * unconstrained)     # counting the step alone, far more than it needs
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget=budget)
    _train(step, ref, x)
    rep = step.memory(measure=True)
    assert rep.recomputed and abs(rep.outside - outside) <= 4 * MIB, str(rep)
    assert rep.predicted_peak + rep.outside <= budget and rep.measured_peak + rep.outside <= budget * 1.02, str(rep)
    assert "for the process" in str(rep)
    del ballast


HELD: list[torch.Tensor] = []


class KeepsOnFirstRun(torch.autograd.Function):
    """Doubles x; its first real (not fake) call keeps 32 MiB for good, as torch's own first run does."""

    @staticmethod
    def forward(ctx, x):
        if not HELD and not torch._subclasses.fake_tensor.is_fake(x):
            HELD.append(torch.ones(8 * MIB))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Keeps(Deep):
    def forward(self, x):
        return super().forward(KeepsOnFirstRun.apply(x))


@needs_allocator
def test_memory_kept_by_the_first_step_is_planned_for():
    """What the process keeps after a program's first step (torch's first-run allocations) counts too: the
    step is compiled again with it, recomputes to fit, and trains like eager."""
    HELD.clear()
    x = torch.randn(512, 64)
    model = Keeps()
    ref = copy.deepcopy(model)
    outside, unconstrained = _probe(model, x)
    assert HELD
    budget = outside + int(0.8 * unconstrained)          # fits before HELD, which the next step cannot see
    HELD.clear()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), memory_budget=budget + 32 * MIB)
    _train(step, ref, x)
    info = step.cache_info()
    assert info.compiles == 2 and any("re-planned" in n for n in info.notes), str(info)
    rep = step.memory()
    assert rep.recomputed and rep.predicted_peak + rep.outside <= budget + 32 * MIB, str(rep)
