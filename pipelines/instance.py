"""Prepare a Dagster home once, before anything starts in parallel.

A fresh SQLite ``DAGSTER_HOME`` raced by several processes creating its schema can break for
good (``alembic_version ... more than one head``, a known Dagster bug). So ``sekali dev`` and the
tests call :func:`prepare_dagster_home` first, in one process, under a file lock: it writes the
``dagster.yaml`` (unless one is there) and touches every storage so the schema exists before the
webserver, the daemon and the run workers start. ``python -m pipelines.instance HOME
[--profile production]`` does the same from another process (``sekali cluster`` runs it).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
from pathlib import Path

from resources.storage.files import private_folder

DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy"


def instance_template(profile: str) -> Path:
    if profile not in ("embedded", "production"):
        raise ValueError(f"profile: expected 'embedded' or 'production', not {profile!r}")
    return DEPLOY_DIR / profile / "dagster.yaml"


def prepare_dagster_home(home: Path, *, profile: str = "embedded", extra_yaml: str = "") -> Path:
    """Create ``home`` with the profile's ``dagster.yaml`` and initialise its storage once.

    Dagster's "Join the community" dialog never covers the UI: the profiles turn it off
    (``nux: enabled: false``); a home that already had its own ``dagster.yaml`` is marked as
    having shown it (``.nux/nux.yaml``, where Dagster keeps that flag), since its settings are
    not ours to rewrite."""
    from dagster import DagsterInstance  # noqa: PLC0415 - heavy import, only when used
    from dagster._core.nux import set_nux_seen  # noqa: PLC0415

    home = private_folder(home.resolve())
    target = home / "dagster.yaml"
    with open(home / ".sekali-init.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if not target.exists():
            shutil.copyfile(instance_template(profile), target)
            if extra_yaml:
                with open(target, "a") as fh:
                    fh.write("\n" + extra_yaml)
        previous = os.environ.get("DAGSTER_HOME")
        os.environ["DAGSTER_HOME"] = str(home)
        try:
            with DagsterInstance.get() as instance:
                instance.get_runs(limit=1)
                instance.all_instigator_state()
                instance.get_run_records(limit=1)
                if instance.nux_enabled:  # a home whose dagster.yaml predates ``nux: off``
                    set_nux_seen()  # type: ignore[no-untyped-call]
        finally:
            if previous is None:
                os.environ.pop("DAGSTER_HOME", None)
            else:
                os.environ["DAGSTER_HOME"] = previous
    return home


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="prepare a Dagster home once")
    parser.add_argument("home", type=Path)
    parser.add_argument("--profile", default="embedded", choices=("embedded", "production"))
    args = parser.parse_args(argv)
    print(prepare_dagster_home(args.home, profile=args.profile))


if __name__ == "__main__":
    main()
