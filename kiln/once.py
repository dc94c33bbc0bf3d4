"""Run a loader once per process, safely when several threads need it at the same time."""
from __future__ import annotations

import threading
from typing import Callable


class Once:
    """`Once(load)()` runs `load` the first time and never again. Other threads wait until it has finished;
    a call from inside `load` itself (the modules it imports call back) returns at once."""

    def __init__(self, load: Callable[[], None]):
        self._load, self._done, self._owner = load, False, None
        self._lock = threading.Lock()

    def __call__(self) -> None:
        if self._done or self._owner == threading.get_ident():
            return
        with self._lock:
            if self._done:
                return
            self._owner = threading.get_ident()
            try:
                self._load()
                self._done = True
            finally:
                self._owner = None
