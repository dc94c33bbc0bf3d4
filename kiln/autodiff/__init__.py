"""Reverse-mode autodiff over Kiln's training graph (no torch.autograd involved)."""
from kiln.autodiff.reverse import differentiate  # noqa: F401
