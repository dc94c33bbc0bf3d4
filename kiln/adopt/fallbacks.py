"""The import a rewritten file uses for kiln's kernels, with a fallback for machines without kiln.

A rewrite to `kiln.kernels.X(...)` is spelled `kiln_kernels.X(...)`, and the file gets one block
after its imports:

    try:
        import kiln.kernels as kiln_kernels
    except ImportError:  # without kiln: the same computation as the code these calls replaced
        class kiln_kernels:
            @staticmethod
            def linear_act(x, linear, act, recompute=False):
                return act(linear(x))

so the rewritten file still runs where kiln is not installed, computing what the original code
did.  `EAGER` holds that plain-PyTorch body for each kernel a rule writes (the kernels' own
definitions in `kiln/kernels/__init__.py` say the same; `tests/adopt/test_fallbacks.py` checks
each pair against each other).  A second run keeps the block and adds what new rewrites need.
"""
from __future__ import annotations

import libcst as cst

ALIAS = "kiln_kernels"

# kernel -> (parameters, body): what the call computes, in plain PyTorch (`torch` must be imported)
EAGER = {
    "linear_act": ("x, linear, act, recompute=False", "return act(linear(x))"),
    "linear_gelu_of": ('x, linear, approximate="none", recompute=False',
                       "return torch.nn.functional.gelu(linear(x), approximate=approximate)"),
    "act_mul": ("act, gate, up", "return act(gate) * up"),
    "cross_entropy_of": ("loss, logits, labels", "return loss(logits, labels)"),
    "cross_entropy": ('logits, labels, ignore_index=-100, reduction="mean"',
                      "return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, "
                      "reduction=reduction)"),
    "swiglu": ("gate, up", "return torch.nn.functional.silu(gate) * up"),
    "rope": ("q, k, cos, sin", "def rotate(x):  # (-x2, x1), the rotate_half these calls replaced\n"
                               "    half = x.shape[-1] // 2\n"
                               "    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)\n"
                               "return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin"),
}


def is_block(stmt) -> bool:
    """Is `stmt` the `try: import kiln.kernels as kiln_kernels` block (of an earlier run)?"""
    if not isinstance(stmt, cst.Try) or not stmt.body.body:
        return False
    first = stmt.body.body[0]
    return isinstance(first, cst.SimpleStatementLine) and isinstance(first.body[0], cst.Import) \
        and cst.Module(body=[]).code_for_node(first.body[0]).strip() == f"import kiln.kernels as {ALIAS}"


def kernels_in(block: cst.Try) -> set[str]:
    """The kernels an existing block has fallbacks for."""
    names = set()
    for handler in block.handlers:
        for stmt in handler.body.body:
            if isinstance(stmt, cst.ClassDef):
                names |= {s.name.value for s in stmt.body.body if isinstance(s, cst.FunctionDef)}
    return names


def block(kernels) -> cst.BaseStatement:
    """The import block for these kernels (sorted, so the text does not depend on rule order)."""
    methods = []
    for name in sorted(kernels):
        params, body = EAGER[name]
        inner = "".join(f"            {line}\n" if line else "\n" for line in body.splitlines())
        methods.append(f"        @staticmethod\n        def {name}({params}):\n{inner}")
    code = (f"try:\n    import kiln.kernels as {ALIAS}\n"
            f"except ImportError:  # without kiln: the same computation as the code these calls replaced\n"
            f"    class {ALIAS}:\n" + "\n".join(methods))
    return cst.parse_statement(code)
