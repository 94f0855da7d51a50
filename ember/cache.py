"""ember's cache folder (compiled kernels, converted tokenizers and models) and the keys of its entries."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Callable

from ember import envs


def cache_dir(*parts: str) -> str:
    """EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember or ~/.cache/ember, joined with parts."""
    return os.path.join(envs.cache_root(), *parts)


def file_key(path: str, *extra: object) -> str:
    """A short key that changes when the file at path (or any of extra) changes: names its cache entries."""
    st = os.stat(path)
    text = ":".join(map(str, (os.path.abspath(path), st.st_size, st.st_mtime_ns, *extra)))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def replace_with(path: str, write: Callable[[str], None]) -> None:
    """Write path whole under a name of its own beside it (``write(tmp)``), then rename it into place: a concurrent
    reader sees all of the file or none of it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
