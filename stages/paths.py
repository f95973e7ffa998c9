"""Where rollflow keeps its files on this machine: the repository and the cache folder. Standard library only, so
every layer of ``stages`` (storage, the runner, checkpoints, the model store) may import it.

The cache (root = ``$ROLLFLOW_CACHE`` or ``<repo>/.cache``) holds the converted models (``models/``), vLLM's compile
cache (``vllm/``), local mirrors of object-store folders, the runner's staging folders and the model folder states
that passed their checks (``checked/``, stages/model_files.py).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_root_path(cache_root: str | os.PathLike | None = None) -> Path:
    """The rollflow cache folder: the argument, else ``$ROLLFLOW_CACHE``, else ``<repo>/.cache``."""
    if cache_root is not None:
        return Path(cache_root)
    from_env = os.environ.get("ROLLFLOW_CACHE")
    return Path(from_env) if from_env else REPO_ROOT / ".cache"
