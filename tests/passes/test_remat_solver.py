"""The rematerialization plan's two solvers (kiln/passes/remat.py): the greedy pass and the covering integer
program, on a memory model small enough to know the optimum by hand, and on a real program."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.passes import remat


class _Fake:
    """A memory model whose candidates each free bytes at fixed nodes, independently (what the covering
    program assumes), with `persistent` bytes besides."""

    def __init__(self, base: list[int], frees: dict[str, dict[int, int]]):
        self.base, self.frees = base, frees
        self.prof = SimpleNamespace(persistent=100)

    def live(self, chosen) -> list[int]:
        out = list(self.base)
        for c in chosen:
            for i, b in self.frees[c.name].items():
                out[i] -= b
        return out

    def peak(self, chosen) -> int:
        return self.prof.persistent + max(self.live(chosen))


def _cand(name: str, gflop: float):
    c = remat.Recompute(SimpleNamespace(uid=name), [], 0, gflop * 1e9)
    c.name = name
    return c


def test_the_covering_program_finds_the_cheaper_set_the_greedy_order_misses():
    """Over the budget at nodes 1 and 2 by 6 bytes: `a` (tried first: a cheaper kind of op) covers both for
    5 GFLOP; `b` and `c` cover one each for 1 GFLOP. The greedy pass keeps `a`; the program finds b + c."""
    pytest.importorskip("scipy")
    model = _Fake([0, 16, 16, 0], {"a": {1: 10, 2: 10}, "b": {1: 6}, "c": {2: 6}})
    cands = [_cand("a", 5.0), _cand("b", 1.0), _cand("c", 1.0)]
    budget = 110                                   # 100 persistent + 10 for the program's own values
    greedy, peak = remat._greedy(model, cands, [], model.peak([]), budget)
    greedy, peak = remat._prune(model, greedy, budget)
    assert [c.name for c in greedy] == ["a"] and peak <= budget
    cover = remat._cheapest_cover(model, cands, budget)
    assert sorted(c.name for c in cover) == ["b", "c"] and model.peak(cover) <= budget
    assert remat._flops(cover) < remat._flops(greedy)


def test_without_a_solution_the_program_gives_none_and_with_no_excess_an_empty_set():
    pytest.importorskip("scipy")
    model = _Fake([0, 30, 0], {"a": {1: 5}})
    assert remat._cheapest_cover(model, [_cand("a", 1.0)], 110) is None      # 20 over, 5 can be freed
    assert remat._cheapest_cover(model, [_cand("a", 1.0)], 200) == []


def test_a_plan_is_never_costlier_than_the_greedy_one_and_holds_its_budget(monkeypatch):
    """On the zoo's Llama at a tight fraction of its peak (0.946 is the least it reaches): the plan with the program recomputes no more FLOPs
    than the greedy pass alone, and both fit the budget on the memory model."""
    import kiln
    pytest.importorskip("scipy")
    from tests.models import zoo
    plans = {}
    for solver in ("greedy", "both"):
        if solver == "greedy":
            monkeypatch.setattr(remat, "_cheapest_cover", lambda *a: None)
        else:
            monkeypatch.undo()
        model, _args, batch, _loss = zoo.llama()
        step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.01), memory_budget=0.96)
        step(**batch)
        plans[solver] = step.last.memory
    g, b = plans["greedy"], plans["both"]
    assert g.chosen and g.after <= g.step_budget and b.after <= b.step_budget
    assert b.extra_flops <= g.extra_flops
    assert (b.solver == "milp") == (b.extra_flops < g.extra_flops)
