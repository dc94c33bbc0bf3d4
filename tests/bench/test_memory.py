"""The peak-RSS reader: reset after one phase, see only the next phase's peak."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from kiln.bench import memory

MIB = 2 ** 20

# memory.py is loaded from its file so the child does not pay for importing torch.
SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("memory", sys.argv[1])
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)

    def touch(n):
        block = bytearray(n)               # calloc'd: not resident until written
        for i in range(0, n, 4096):
            block[i] = 1                    # one write per page makes it resident
        return block

    early = touch(300 * 2 ** 20)            # a bigger peak *before* the reset...
    del early                               # ...freed (munmap), so RSS drops again
    tracker = memory.PeakTracker()
    tracker.start()
    block = touch(200 * 2 ** 20)
    print(json.dumps(tracker.stop()))
""")


def _can_reset() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK)


@pytest.mark.skipif(not _can_reset(), reason="/proc/self/clear_refs not writable here")
def test_peak_rises_by_touched_block_only():
    out = subprocess.run([sys.executable, "-c", SCRIPT, memory.__file__], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["memory_method"] == "VmHWM after clear_refs reset"
    rise = (got["peak_rss_bytes"] - got["start_rss_bytes"]) / MIB
    # About the 200 MiB block; far from the 300 MiB peak that came before the reset.
    assert 190 <= rise <= 240, rise


def test_fallback_when_reset_not_permitted(monkeypatch):
    monkeypatch.setattr(memory, "_CLEAR_REFS", "/nonexistent/clear_refs")
    tracker = memory.PeakTracker()
    tracker.start()
    got = tracker.stop()
    assert tracker.reset_ok is False
    assert "not resettable" in got["memory_method"]
    assert got["peak_rss_bytes"] >= got["start_rss_bytes"] > 10 * MIB  # a Python with torch loaded


def test_fallback_without_proc(monkeypatch):
    monkeypatch.setattr(memory, "_STATUS", "/nonexistent/status")
    peak, how = memory.peak_bytes()
    assert how == "ru_maxrss" and peak > 10 * MIB
    assert memory.current_rss_bytes() is None
