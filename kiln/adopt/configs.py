"""Defaults of configuration fields, read from the configuration module a modeling file imports.

transformers picks activations at run time (`self.act = ACT2FN[config.hidden_act]`). Whether such a
call is a GELU or a SiLU is not in the modeling file, but the default is in the configuration class
it imports (`from .configuration_llama import LlamaConfig`): `hidden_act: str = "silu"` (5.x, class
attributes) or `def __init__(self, ..., hidden_act="silu", ...)` (4.x). Matching uses the default to
decide whether a lookup is a location at all; the rewrite still guards at run time
(`kiln.kernels.linear_act` / `act_mul` check the activation on every call), so a config that
overrides the default is computed exactly as written.

Only sibling files named by relative imports are read (never imported or executed); a file outside
its package, or a field whose defaults disagree between the imported classes, is unknown (None).
"""
from __future__ import annotations

import ast
import functools
import os

import libcst as cst

# ACT2FN keys by what they compute (transformers.activations, 4.x and 5.x)
GELU_NAMES = {"gelu", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast"}
SILU_NAMES = {"silu", "swish"}


class ConfigDefaults:
    """`default("hidden_act")` -> the one default the imported configuration classes give it, or None."""

    def __init__(self, filename: str | None, module: cst.Module):
        self.classes: list[dict] = []
        if not filename or not os.path.isfile(filename):
            return
        folder = os.path.dirname(os.path.abspath(filename))
        for stmt in module.body:
            for small in getattr(stmt, "body", ()) if isinstance(stmt, cst.SimpleStatementLine) else ():
                if not (isinstance(small, cst.ImportFrom) and len(small.relative) == 1 and small.module is not None
                        and isinstance(small.module, cst.Name) and isinstance(small.names, (list, tuple))):
                    continue
                fields = _config_fields(os.path.join(folder, small.module.value + ".py"))
                for alias in small.names:
                    name = alias.name.value if isinstance(alias.name, cst.Name) else None
                    if name in fields:
                        self.classes.append(fields[name])

    def default(self, field: str):
        values = {repr(c[field]) for c in self.classes if field in c}
        if len(values) != 1:
            return None
        return next(c[field] for c in self.classes if field in c)


@functools.lru_cache(maxsize=64)
def _config_fields(path: str) -> dict:
    """class name -> {field: literal default} for every class of a configuration module."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        fields = {}
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                _literal(fields, item.target.id, item.value)
            elif isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
                _literal(fields, item.targets[0].id, item.value)
            elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                positional = args.posonlyargs + args.args
                for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                    _literal(fields, a.arg, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults):
                    if d is not None:
                        _literal(fields, a.arg, d)
        out[cls.name] = fields
    return out


def _literal(fields: dict, name: str, node: ast.AST) -> None:
    try:
        fields[name] = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        pass
