"""ember's cache folder (compiled kernels, converted tokenizers and models) and the keys of its entries."""

from __future__ import annotations

import hashlib
import os

from ember import envs


def cache_dir(*parts: str) -> str:
    """EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember or ~/.cache/ember, joined with parts."""
    return os.path.join(envs.cache_root(), *parts)


def file_key(path: str, *extra: object) -> str:
    """A short key that changes when the file at path (or any of extra) changes: names its cache entries."""
    st = os.stat(path)
    text = ":".join(map(str, (os.path.abspath(path), st.st_size, st.st_mtime_ns, *extra)))
    return hashlib.sha1(text.encode()).hexdigest()[:16]
