"""`kiln adopt`: find hand-written GELU / SiLU / RMSNorm / attention in model source, call fused kernels.

    from kiln.adopt import rewrite_source
    new_text, matches = rewrite_source(open("modeling_x.py").read(), rules=["rms_norm"])

Pipeline: `analysis` (libcst -> DSL structures) -> `expr` (trees, algebraic normal form) ->
`match` (rules from `rules/*.kiln`, parsed by `dsl`; Python rules in `attention` (sdpa) and
`detect` (the kiln-kernel rules)) -> `synth` (libcst edits, imports).
"""
import importlib

# Loaded on first use: `kiln adopt --list-rules` must not pay for libcst.
_EXPORTS = {"rewrite_source": "kiln.adopt.rewrite", "Match": "kiln.adopt.rewrite", "AdoptError": "kiln.adopt.rewrite",
            "DSLError": "kiln.adopt.dsl", "builtin_names": "kiln.adopt.rules", "load_file": "kiln.adopt.rules",
            "load_text": "kiln.adopt.rules"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.adopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
