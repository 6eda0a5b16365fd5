"""The README's Python blocks run as written: extracted in order and executed as one script (a
reader pastes them into one session), in a fresh process, against an embedded Redis of the
test's own and the test's database (SQLite and Postgres) named by the variables the blocks
read. Catches a snippet that names something it never defines or imports (``redis_client``,
``db``), an import path that does not exist, or an API call whose signature changed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from resources.storage import Database
from sandbox.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(markdown: str) -> list[str]:
    return BLOCK.findall(markdown)


@pytest.fixture
def embedded_redis(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path / "redis", port=free_port()).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_the_readme_has_python_blocks() -> None:
    assert len(python_blocks((ROOT / "README.md").read_text())) >= 2


def test_readme_python_blocks_run_as_written(
    db: Database, db_url: str, embedded_redis: str, tmp_path: Path
) -> None:
    """``db``: migrated, as ``sekali db upgrade`` leaves a Postgres the README points at."""
    script = "\n\n".join(python_blocks((ROOT / "README.md").read_text()))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "DATABASE_URL": db_url, "REDIS_URL": embedded_redis, "PYTHONPATH": str(ROOT),
    }
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
