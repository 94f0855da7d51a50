"""Models named by hub id: a name that is no path on this machine but reads as ``name`` or ``org/name`` is looked
up in the Hugging Face cache (``huggingface_hub.snapshot_download``: its cache layout, HF_HOME / HF_HUB_CACHE /
HF_HUB_OFFLINE), then downloaded unless the hub is offline; DashInfer's loader may also try ModelScope. The one
place ember turns a model or tokenizer name into a local path. ``huggingface_hub`` is imported only when a hub id
is resolved."""

from __future__ import annotations

import os
import re

from ember.errors import ConfigError

DEFAULT_REVISION = "main"
# what a model needs from its repository: configs, tokenizers, weights (safetensors or GGUF), chat templates
MODEL_FILES = ("*.json", "*.safetensors", "*.gguf", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt",
               "*.jinja")
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")
# huggingface_hub's repo id rule (validate_repo_id): [org/]name of letters, digits, '-', '_', '.', starting and
# ending with a letter or digit, no '--' or '..'; names of model files are paths, never ids
_HUB_ID = re.compile(r"(?:\b[\w.-]+\b/)?\b[\w.-]{1,96}\b", re.ASCII)
_FILE_SUFFIXES = (".gguf", ".asmodel", ".asparam", ".safetensors", ".json", ".git")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """``name`` or ``org/name`` as the Hugging Face hub spells repository ids (not checked against any hub)."""
    return (bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name
            and not name.lower().endswith(_FILE_SUFFIXES))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.upper() in _TRUE


def resolve(name: str, revision: str | None = None, *, arg: str = "model", files: tuple[str, ...] = MODEL_FILES,
            accepted: str = "a local path", modelscope: bool = False) -> str:
    """The local path ``name`` stands for: itself (``~`` expanded) when it exists on this machine (a path wins over
    a hub id of the same spelling), else the snapshot folder of hub id ``name`` at ``revision`` (default "main").
    ConfigError, naming ``arg`` and what is ``accepted``, when it is neither."""
    name = str(name)
    path = os.path.expanduser(name)
    if os.path.exists(path):
        return path
    if not is_hub_id(name):
        raise ConfigError(f"{arg}={name!r} is neither a path on this machine (it does not exist) nor a hub id "
                          f"('name' or 'org/name'): pass {accepted}, or a Hugging Face hub id")
    return snapshot(name, revision, arg=arg, files=files, modelscope=modelscope)


def snapshot(repo_id: str, revision: str | None = None, *, arg: str = "model", files: tuple[str, ...] = MODEL_FILES,
             modelscope: bool = False) -> str:
    """The cached snapshot folder of ``repo_id`` (only ``files`` are fetched): first from the Hugging Face cache
    without network, then (modelscope: from ModelScope's cache, then its hub) downloaded unless HF_HUB_OFFLINE is
    set. ConfigError naming the id, the revision and the cache when none of those has it."""
    import huggingface_hub
    from huggingface_hub import constants

    rev = revision or DEFAULT_REVISION
    cache = constants.HF_HUB_CACHE  # read now, not at ember's import: the library's value, set or patched since
    offline = hub_offline()
    reasons: list[str] = []

    def hf(local: bool) -> str | None:
        try:
            return huggingface_hub.snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=local,
                                                     allow_patterns=list(files))
        except Exception as e:  # not cached / incomplete / not found / no network: all mean "not from here"
            if not local or type(e).__name__ != "LocalEntryNotFoundError":
                reasons.append(f"{'' if local else 'downloading: '}{type(e).__name__}: {e}")
            return None

    found = hf(local=True)
    if found is None and modelscope:
        found = _modelscope(repo_id, revision, files, offline, reasons)
    if found is None and not offline:
        found = hf(local=False)
    if found is not None:
        return found
    how = "HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else "it could not be downloaded"
    detail = " ({})".format("; ".join(" ".join(r.split()) for r in reasons)) if reasons else ""
    raise ConfigError(f"{arg}={repo_id!r} is not a path on this machine, and the hub id {repo_id!r} (revision "
                      f"{rev!r}) is not in the Hugging Face cache {cache!r}, and {how}{detail}. Download it on a "
                      f"machine with network (`hf download {repo_id} --revision {rev}`) into that cache (HF_HOME / "
                      "HF_HUB_CACHE choose it), or pass a local path")


def _modelscope(repo_id: str, revision: str | None, files: tuple[str, ...], offline: bool,
                reasons: list[str]) -> str | None:
    """The ModelScope snapshot of ``repo_id``: its cache, then its hub unless offline; None (a reason recorded)
    when the modelscope package is absent or has no such model."""
    try:
        from modelscope import snapshot_download
    except ImportError:
        reasons.append("ModelScope: the modelscope package is not installed (`pip install modelscope` resolves "
                       "ModelScope ids)")
        return None
    kwargs = dict(allow_file_pattern=list(files))
    if revision is not None:
        kwargs["revision"] = revision
    for local in (True,) if offline else (True, False):
        try:
            return snapshot_download(repo_id, local_files_only=local, **kwargs)
        except Exception as e:  # modelscope raises ValueError / OSError / its own errors for a missing model
            reasons.append(f"ModelScope{'' if local else ' download'}: {type(e).__name__}: {e}")
    return None
