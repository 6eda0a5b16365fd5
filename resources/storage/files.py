"""Files and folders only their owner can read: state folders, reports, configuration that holds
secrets or personal data.

The mode is set when the file is created (``os.open(..., 0o600)``), not by a ``chmod`` after the
content is written, so there is no moment when another local user could open it; a file that
already existed with a wider mode is narrowed (``fchmod``) before anything is written to it.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
FOLDER_MODE = 0o700


def private_folder(path: Path) -> Path:
    """``path`` created (with its parents) and set to 0700: what is inside is nobody else's."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(FOLDER_MODE)
    return path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``, readable and writable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), FILE_MODE)
        out.write(text)
    return path
