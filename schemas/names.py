"""The one way a user-given name becomes a folder name (issue 48): :func:`folder_name` refuses what would leave its
folder or cannot be created there. A run's ``run_name`` (the run folder under ``runs_dir``) goes through it at config
load time, and again where the folder is made (stages/run_folder.py), with the filesystem's own limit."""

from __future__ import annotations

import os
import unicodedata

NAME_MAX_BYTES = 255  # the usual NAME_MAX of local filesystems (ext4, xfs, btrfs, tmpfs) and S3 key segments


def name_max(where: str | None = None) -> int:
    """The longest file name (in bytes) the filesystem of the existing local folder ``where`` (or of its nearest
    existing parent) allows: ``os.pathconf(PC_NAME_MAX)``; :data:`NAME_MAX_BYTES` for a URI, None, or where the
    system does not say."""
    if where is None or "://" in str(where):
        return NAME_MAX_BYTES
    folder = os.path.abspath(str(where))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX_BYTES


def name_problem(name: str, limit: int = NAME_MAX_BYTES) -> str | None:
    """Why ``name`` cannot be one folder's name (None when it can): empty, ``.`` or ``..`` (the folder itself or its
    parent), a path separator (a folder further down or elsewhere), a control character, or longer than ``limit``
    bytes in UTF-8."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if name in (".", ".."):
        return f"'{name}' names {'the folder itself' if name == '.' else 'the parent folder'}, not a folder in it"
    for sep in ("/", "\\"):
        if sep in name:
            return f"it holds the path separator '{sep}', which would put the folder elsewhere"
    bad = [c for c in name if unicodedata.category(c) == "Cc"]
    if bad:
        return f"it holds the control character {bad[0]!r}"
    size = len(name.encode("utf-8"))
    if size > limit:
        return f"it is {size} bytes long and the filesystem allows names of at most {limit} bytes"
    return None


def folder_name(name: str, what: str, limit: int = NAME_MAX_BYTES) -> str:
    """``name`` when it can be the name of one folder (:func:`name_problem`); else a ValueError naming ``what`` (the
    option, e.g. ``run_name``), the rule and the fix."""
    problem = name_problem(name, limit)
    if problem is not None:
        shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"
        raise ValueError(f"{what} {shown} becomes a folder name, but {problem}; use a short name of letters, digits, "
                         "'_', '-' and '.' (not '.' or '..'), e.g. quickstart-2")
    return name


RUN_NAME = r"^[A-Za-z0-9_.-]+$"


def run_name(name: str) -> str:
    """A run's ``run_name``: a folder name (:func:`folder_name`) of letters, digits, ``_``, ``-`` and ``.``."""
    import re

    folder_name(name, "run_name")
    if not re.match(RUN_NAME, name):
        raise ValueError(f"run_name {name!r} may hold only letters, digits, '_', '-' and '.', because it names the run "
                         "folder on any filesystem (an object store too); e.g. quickstart-2")
    return name
