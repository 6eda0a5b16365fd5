"""Argument types shared by the subcommands: every id the CLI takes is bounded before it reaches
a database (a 20-digit id is an OverflowError on SQLite, not an answer)."""

from __future__ import annotations

import argparse
import re

from pipelines.validation import INT64_MAX

_DIGITS = re.compile(r"^[0-9]{1,19}$")


def record_id(text: str) -> int:
    """argparse ``type=`` of a row id: a whole number from 1 to 2**63 - 1 (BIGINT's range);
    anything else is bad usage (exit 2, one line)."""
    if not _DIGITS.match(text) or not 1 <= int(text) <= INT64_MAX:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not a record id (a whole number from 1 to {INT64_MAX})"
        )
    return int(text)
