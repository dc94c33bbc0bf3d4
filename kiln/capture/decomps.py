"""Decompositions applied at capture (`ep.run_decompositions(table())`): composite ops Kiln has no
rule for, written out as ops it can differentiate."""
from __future__ import annotations


def table() -> dict:
    return {}
