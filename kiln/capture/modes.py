"""The model's grad-mode and autocast blocks, as torch.export records them.

- `with torch.no_grad():` becomes a `wrap_with_set_grad_enabled(False, body)` call: its results are
  detached before decomposition inlines it (`detach_no_grad_regions`), so autodiff stops there.
- `with torch.autocast(..., enabled=False):` becomes a `wrap_with_autocast` call: its ops are marked
  full precision (`mark_autocast_off`, `full_precision`), so `amp=` keeps them in fp32 as autocast does.
  (Hugging Face's `maybe_autocast(enabled=False)` is made to open one: kiln/capture/hf.py.)
- A `no_grad` block *inside* an autocast block is lost by export (torch 2.13: the autocast pass splits
  the block at the grad-mode switch and no `wrap_with_set_grad_enabled` is left), so its results would
  carry gradients eager never computes: `refuse_no_grad_in_autocast` stops the capture there instead.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from kiln.errors import UnsupportedError

log = logging.getLogger("kiln")


def detach_no_grad_regions(ep) -> None:
    """What the forward computes under `torch.no_grad()` carries no gradient. Export records such a block
    as a `wrap_with_set_grad_enabled(False, ...)` call, which decomposition inlines (and the fact with
    it): each of its results is detached first, so autodiff sees where gradients stop. Every graph module
    of the program is walked, so a block recorded inside another block's subgraph is detached too (a
    `no_grad` inside `torch.autocast(...)` is not recorded at all: `refuse_no_grad_in_autocast`)."""
    wrap = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    for gm in _graph_modules(ep):
        g, changed = gm.graph, False
        for n in list(g.nodes):
            if n.op == "call_function" and n.target is wrap and n.args and n.args[0] is False:
                for u in list(n.users):
                    with g.inserting_after(u):
                        d = g.call_function(torch.ops.aten.detach.default, (u,))
                    u.replace_all_uses_with(d, delete_user_cb=lambda x, d=d: x is not d)
                    changed = True
        if changed:
            gm.recompile()


FULL_PRECISION = "kiln_full_precision"


def mark_autocast_off(ep) -> None:
    """A block the model runs under `torch.autocast(..., enabled=False)` (MoE routers that keep top-k in
    fp32, losses) is recorded as a `wrap_with_autocast` call; decomposition inlines it and copies the
    call's custom metadata onto every op of the block. Marked here, those ops are `Node.full_precision`:
    amp keeps them in fp32 (the block's own `.float()` casts were no-ops in the fp32 capture)."""
    wrap = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    for gm in _graph_modules(ep):
        for n in gm.graph.nodes:
            # wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *args)
            if n.op == "call_function" and n.target is wrap and len(n.args) > 2 and n.args[2] is False:
                n.meta["custom"] = {**(n.meta.get("custom") or {}), FULL_PRECISION: True}


def _graph_modules(ep) -> list:
    """The program's graph module and every subgraph module of its higher-order calls, outermost first."""
    return [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]


def full_precision(fx) -> bool:
    """Whether an exported op ran in a `torch.autocast(enabled=False)` block (after decomposition)."""
    return bool((fx.meta.get("custom") or {}).get(FULL_PRECISION))


@contextlib.contextmanager
def refuse_no_grad_in_autocast(stack: list[str]):
    """During capture: entering `torch.no_grad()` or `torch.set_grad_enabled(False)` inside a
    `torch.autocast` block raises UnsupportedError naming the module. (The context managers' Python
    methods are wrapped, never `torch._C._set_grad_enabled`, whose calls export records by identity.)"""
    depth = [0]
    originals = [(cls, name, getattr(cls, name)) for cls, name in
                 ((torch.autocast, "__enter__"), (torch.autocast, "__exit__"), (torch.no_grad, "__enter__"),
                  (torch.set_grad_enabled, "__enter__"), (torch.set_grad_enabled, "__init__"))]
    enter, exit_, no_grad_enter, set_enter, set_init = (f for _, _, f in originals)

    def refuse():
        if depth[0] > 0:
            where = f"module `{stack[-1]}`" if stack and stack[-1] else "the model's forward"
            raise UnsupportedError(
                f"torch.no_grad() (or set_grad_enabled(False)) inside a torch.autocast(...) block, in {where}: "
                "torch.export drops the no_grad there, so gradients would flow where eager computes none. Move "
                "the no_grad block out of the autocast block, or write `.detach()` on the values it computes")

    def autocast_enter(self):
        depth[0] += 1
        return enter(self)

    def autocast_exit(self, *exc):
        depth[0] -= 1
        return exit_(self, *exc)

    def no_grad(self):
        refuse()
        return no_grad_enter(self)

    def set_grad_init(self, mode):
        if not mode:                      # set_grad_enabled(False) switches in its constructor
            refuse()
        return set_init(self, mode)

    def set_grad(self):
        if not getattr(self, "mode", True):
            refuse()
        return set_enter(self)

    for (cls, name, _), f in zip(originals, (autocast_enter, autocast_exit, no_grad, set_grad, set_grad_init)):
        setattr(cls, name, f)
    try:
        yield
    finally:
        for cls, name, f in originals:
            setattr(cls, name, f)



@contextlib.contextmanager
def warn_rebound_buffers(model: torch.nn.Module):
    """During capture: a forward that assigns one of its registered buffers a tensor of another shape (a
    position table grown for a longer input: `self.pe = extend(...)`) gets a warning naming the buffer. The
    compiled step computes with the new value, so its numbers are eager's, but it does not store it back:
    the module's buffer keeps its old value (eager's holds the new one after the step)."""
    owners = {id(m): path for path, m in model.named_modules()}
    seen: set = set()
    original = torch.nn.Module.__setattr__

    def setattr_(self, name, value):
        old = self.__dict__.get("_buffers", {}).get(name) if id(self) in owners else None
        if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape != value.shape:
            where = ".".join(p for p in (owners[id(self)], name) if p)
            if where not in seen:
                seen.add(where)
                log.warning("kiln: the forward rebinds buffer `%s` to shape %s (was %s); the compiled step "
                            "computes with the new value but does not store it: the module keeps the old one",
                            where, tuple(value.shape), tuple(old.shape))
        return original(self, name, value)

    torch.nn.Module.__setattr__ = setattr_
    try:
        yield
    finally:
        torch.nn.Module.__setattr__ = original
