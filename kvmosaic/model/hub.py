"""``--model org/name``: a model found in the local Hugging Face cache, offline.

A ``--model`` that is not an existing path but looks like a Hub id (``org/name``) is looked up
in the cache that ``huggingface_hub`` fills (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), at the revision ``refs/main`` names, with ``local_files_only``:
nothing is downloaded. A miss says where it looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> str:
    """The cache directory, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(model: str | None) -> str | None:
    """``model`` itself when it is a path that exists (or None: the shipped model); for a Hub id
    the snapshot folder in the local cache; otherwise a ``ValueError`` saying where it looked."""
    if model is None or Path(model).exists():
        return model
    if not _HUB_ID.match(model) or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} does not exist (nothing is downloaded)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(model, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise ValueError(f"model {model!r} is neither a path nor in the Hugging Face cache at {cache} "
                         f"(looked for {os.path.join(cache, 'models--' + model.replace('/', '--'))}; "
                         "nothing is downloaded: set HF_HUB_CACHE or pass a folder)") from None


def hub_name(path: str) -> str | None:
    """``org/name`` for a snapshot folder of the cache (``models--org--name/snapshots/REV``)."""
    p = Path(path)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/")
    return None
