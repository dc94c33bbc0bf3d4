"""What a user is told when a compiled step fails while running: the op, the module it came from, the
generated line, the original error and what to do."""
from __future__ import annotations

import traceback

from kiln.ir.graph import Phase
from kiln.ops.registry import lookup


def failing_node(fn, error: BaseException):
    """The graph node whose generated line raised `error` (the innermost frame in the step's code)."""
    filename = fn.__code__.co_filename
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    if not frames:
        return None, None
    line = frames[-1].lineno
    return getattr(fn, "node_at_line", {}).get(line), line


def describe_failure(prog, error: Exception, evicted: bool) -> str:
    node, line = failing_node(prog.fn, error)
    first = (str(error).strip().splitlines() or [""])[0]
    cause = f"{type(error).__name__}: {first}"
    if node is None:
        return f"the compiled training step failed outside any op: {cause}"
    code = prog.source.splitlines()[line - 1].strip() if line and line <= len(prog.source.splitlines()) else ""
    where = f"module `{node.scope}`" if node.scope else "the top-level module"
    op = node.op.name
    if op in ("kiln.fallback_forward", "kiln.fallback_backward"):
        forward = node if op == "kiln.fallback_forward" else node.args[0].producer
        what = (f"{lookup(forward.args[0]).name}, which has no gradient rule in Kiln: its PyTorch autograd "
                f"fallback ({op}) failed")
        todo = ("rewrite that part of the model with ops Kiln has rules for, or report the op so it gets a rule")
    else:
        what = f"{op} ({node.phase.value})"
        dialect = node.impl.dialect.name if node.impl is not None else "aten"
        todo = ("this is a Kiln bug, please report it with step.source(); meanwhile try "
                "kiln.compile(..., dialects=['aten']) to leave out fused kernels" if dialect != "aten"
                else "this is a Kiln bug (shapes or layouts it predicted wrongly, or an unsupported argument); "
                     "please report it with step.source()")
    state = ("parameters and optimizer state are unchanged" if node.phase is not Phase.OPTIMIZER
             else "the failure was in the optimizer update: check parameters before continuing")
    return (f"the compiled training step failed in {what}, in {where}, at line {line} of the generated step: "
            f"`{code}`\n  {cause}\n  {state}" + ("; the program was dropped and will be compiled again on the "
                                                  "next call" if evicted else "") + f"\n  what to do: {todo}")
