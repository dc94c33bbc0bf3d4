"""User `torch.autograd.Function`s during capture (to be built: honour the user's backward)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def honour_autograd_functions():
    """While export traces the forward, turn each custom autograd.Function call into one node."""
    yield
