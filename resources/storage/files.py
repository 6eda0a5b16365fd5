"""Files and folders only their owner can read: state folders, reports, configuration that holds
secrets or personal data.

The mode is set when the file is created (``os.open(..., 0o600)``), not by a ``chmod`` after the
content is written, so there is no moment when another local user could open it; a file that
already existed with a wider mode is narrowed (``fchmod``) before anything is written to it.
"""

from __future__ import annotations

import os
import stat
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


class SecretFileUnsafe(ValueError):
    """A file that holds a secret can be read, or was written, by someone else: it is not used.
    ``chmod 600`` it (and ``chown`` it to the user running sekali) after checking its content."""


def read_secret_file(path: Path) -> str:
    """The text of a file holding a secret, stripped; :class:`SecretFileUnsafe` when it is not a
    regular file owned by this user, or when its group or others may read or write it. The
    checks are made on the open file (``fstat``), so the file checked is the file read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SecretFileUnsafe(f"{path}: not a regular file")
        if info.st_uid != os.geteuid():
            raise SecretFileUnsafe(f"{path}: owned by uid {info.st_uid}, not by this user "
                                   f"({os.geteuid()})")
        if info.st_mode & 0o077:
            raise SecretFileUnsafe(f"{path}: mode {info.st_mode & 0o777:o}, readable or "
                                   "writable by others; chmod 600 it")
        return handle.read().strip()
