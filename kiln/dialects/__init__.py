"""Kernel providers. `aten` is the reference (always available); `sdpa` is PyTorch's fused attention."""
from kiln.dialects.registry import DIALECTS, dialects, enabled, select  # noqa: F401
