"""Pin the previous release for the rolling-upgrade test: ``python -m tests.releases.pin REV``.

Writes ``tests/releases/previous.tar.gz``, a ``git archive`` of REV's Python packages and its
``sql/`` (the code an old producer, worker or CLI runs), and ``previous.json`` (the revision,
the packages, the archive's sha256, the migrations REV ships). The test extracts the archive
and runs the old processes with ``PYTHONPATH`` pointing at it, in the same venv; it needs no git
history at run time (CI checks out main without it). Moving the base forward after a release
is this one command and a commit of the two files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PACKAGES = ("pipelines", "resources", "sensors", "sql")
"""What an old producer, worker or ``sekali`` command imports (checked when they run)."""
_MIGRATION = re.compile(r"^sql/(\d{4}_[a-z0-9_]+?)(?:\.(?:postgresql|sqlite))?\.sql$")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def pin(rev: str, packages: Sequence[str] = PACKAGES) -> dict[str, object]:
    commit = _git("rev-parse", f"{rev}^{{commit}}")
    present = set(_git("ls-tree", "--name-only", commit).split())
    missing = [p for p in packages if p not in present]
    if missing:
        raise SystemExit(f"{rev}: no {', '.join(missing)} at that revision")
    archive = subprocess.run(
        ["git", "archive", "--format=tar.gz", commit, *packages],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout
    files = _git("ls-tree", "-r", "--name-only", commit, "sql").split()
    migrations = sorted({m.group(1) for f in files if (m := _MIGRATION.match(f))})
    manifest: dict[str, object] = {
        "rev": commit,
        "subject": _git("log", "-1", "--format=%s", commit),
        "committed": _git("log", "-1", "--format=%cI", commit),
        "packages": list(packages),
        "sha256": hashlib.sha256(archive).hexdigest(),
        "migrations": migrations,
    }
    (HERE / "previous.tar.gz").write_bytes(archive)
    (HERE / "previous.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.releases.pin", description=__doc__)
    parser.add_argument("rev", help="the previous release (a commit, tag or branch)")
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES))
    args = parser.parse_args(argv)
    manifest = pin(args.rev, args.packages)
    size = (HERE / "previous.tar.gz").stat().st_size
    print(f"pinned {manifest['rev']} ({size // 1024} KiB, newest migration "
          f"{manifest['migrations'][-1]})", file=sys.stderr)  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
