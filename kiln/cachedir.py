"""Private cache folders: what Kiln loads code from (compiled regions, native kernels) must be this user's alone.

Shared by the compiler's caches (kiln/dialects/measure.py) and the kernel library's native build
(kiln/kernels/native.py), which must not depend on the compiler.
"""
from __future__ import annotations

import os
from pathlib import Path


def private(root: Path, parts: tuple[str, ...]) -> Path:
    """root/parts..., every level from root down created 0700 and checked: ours, written by no one else
    (PermissionError saying which level and why otherwise)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    folder = root
    for part in ("",) + parts:
        folder = folder / part if part else folder
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.stat(folder)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise PermissionError(f"{folder} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_mode & 0o022:
            who = "others and its group" if st.st_mode & 0o002 else "its group"
            raise PermissionError(f"{folder} is writable by {who} (mode {oct(st.st_mode & 0o777)})")
    return folder


def root() -> Path:
    """$KILN_CACHE_DIR, default ~/.cache/kiln."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
