"""Kiln's op registry. `registry.lookup(aten.mm.default)` gives every fact about an op."""
from kiln.ops.registry import Cast, Kind, OpDef, all_ops, by_name, lookup  # noqa: F401
