"""The previous release, pinned as an archive (``python -m tests.releases.pin REV``), for the
tests that run its code beside this release's: :func:`extract` unpacks it once per folder."""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHIVE = HERE / "previous.tar.gz"
MANIFEST = HERE / "previous.json"


@dataclass(frozen=True)
class PreviousRelease:
    rev: str
    root: Path
    """The extracted packages: put it first on ``PYTHONPATH`` to run the old code."""
    packages: list[str]
    migrations: list[str]
    """The migrations the release shipped (names, both dialects)."""

    @property
    def newest_migration(self) -> str:
        return self.migrations[-1]


def manifest() -> dict[str, object]:
    data: dict[str, object] = json.loads(MANIFEST.read_text())
    return data


def extract(into: Path) -> PreviousRelease:
    """Unpack the pinned release under ``into`` (checked against its recorded sha256)."""
    meta = manifest()
    blob = ARCHIVE.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise RuntimeError(f"{ARCHIVE.name} does not match {MANIFEST.name}: pin it again "
                           "(python -m tests.releases.pin REV)")
    root = into / f"release-{str(meta['rev'])[:10]}"
    if not root.exists():
        staging = into / f".staging-{str(meta['rev'])[:10]}"
        staging.mkdir(parents=True, exist_ok=True)
        with tarfile.open(ARCHIVE) as archive:
            archive.extractall(staging, filter="data")
        staging.rename(root)
    return PreviousRelease(
        rev=str(meta["rev"]),
        root=root,
        packages=list(meta["packages"]),  # type: ignore[call-overload]
        migrations=list(meta["migrations"]),  # type: ignore[call-overload]
    )
