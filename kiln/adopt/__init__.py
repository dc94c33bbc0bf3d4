"""`kiln adopt`: find hand-written GELU / SiLU / RMSNorm / attention in model source, call fused kernels.

    from kiln.adopt import rewrite_source
    new_text, matches = rewrite_source(open("modeling_x.py").read(), rules=["rms_norm"])

Pipeline: `analysis` (libcst -> DSL structures) -> `expr` (trees, algebraic normal form) ->
`match` (rules from `rules/*.kiln`, parsed by `dsl`; Python rules in `structural` (sdpa) and
`detect` (the kiln-kernel rules)) -> `synth` (libcst edits, imports).
"""
from kiln.adopt.dsl import DSLError
from kiln.adopt.rewrite import AdoptError, Match, rewrite_source
from kiln.adopt.rules import builtin_names, load_file, load_text

__all__ = ["rewrite_source", "Match", "AdoptError", "DSLError", "builtin_names", "load_file", "load_text"]
