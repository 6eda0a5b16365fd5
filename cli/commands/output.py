"""What every subcommand prints, written once: times, payloads, tables, and ``--json``/``--out``.

- :func:`when`: a time for a person, ISO-8601 in the local zone with its offset
  (``2026-11-30T19:02:05+01:00``); JSON output keeps the same text, so a script reads the
  zone too.
- :func:`iso_times`: what ``--json`` prints goes through it, so every field holding a time
  (a key ending in ``_at``, or ``at``) is that ISO-8601 text, never epoch seconds.
- :func:`payload_text`: a payload (or any stored value) as JSON text, never Python's ``repr``.
- :func:`add_output_arguments` / :func:`emit`: ``--json`` prints only JSON on stdout (progress
  and errors go to stderr), ``--out PATH`` writes the same JSON to a file (the human view still
  prints unless ``--json`` is given). The one meaning of these flags for every subcommand.
- :func:`console` / :func:`err_console`: rich consoles that never read stored text as markup
  or emoji, with wide lines when piped (a captured table is not wrapped at 80 columns).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from resources.storage.files import write_private


def when(ts: float | None) -> str:
    """``ts`` (epoch seconds) as ISO-8601 in the local zone, to the second; ``""`` for None."""
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(float(ts)).astimezone().isoformat(timespec="seconds")


def _is_time_key(key: object) -> bool:
    return isinstance(key, str) and (key == "at" or key.endswith("_at"))


_VERBATIM = frozenset({"payload", "patch", "result", "run_config"})
"""Values shown as stored: a user's own ``ship_at`` inside a payload stays what they sent."""


def iso_times(data: Any) -> Any:
    """``data`` with every number under a time key (``*_at``, ``at``) as :func:`when` text, in
    nested dicts and lists too (not inside a payload); text already converted and everything
    else is left as it is."""
    if isinstance(data, dict):
        return {
            k: v if k in _VERBATIM
            else when(v) if _is_time_key(k) and isinstance(v, int | float)
            and not isinstance(v, bool) else iso_times(v)
            for k, v in data.items()
        }
    if isinstance(data, list | tuple):
        return [iso_times(v) for v in data]
    return data


def payload_text(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON text (keys in stored order, non-ASCII kept, a lone surrogate escaped);
    what JSON cannot hold is shown as its string."""
    return printable(json.dumps(value, indent=indent, ensure_ascii=False, default=str))


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e"
                      "\u2066-\u2069]")


def _escaped(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (ESC and every C0/C1 character but
    newline and tab, line separators, bidirectional overrides) shown as escapes (``\\x1b``),
    so stored text (an endpoint's answer, a payload) cannot move the cursor, recolour, retitle
    or hide itself; and what a terminal cannot encode (a lone surrogate kept from hostile
    input) shown as its escape (``\\ud800``)."""
    text = _CONTROL.sub(_escaped, text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def console() -> Console:
    """stdout, plain: stored text is never markup; piped output gets 200 columns."""
    width = None if sys.stdout.isatty() else 200
    return Console(highlight=False, markup=False, emoji=False, width=width)


def err_console() -> Console:
    """stderr, for progress and errors (never mixed into ``--json`` stdout)."""
    width = None if sys.stderr.isatty() else 200
    return Console(stderr=True, highlight=False, markup=False, emoji=False, width=width)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--out PATH``, with the same meaning in every subcommand."""
    parser.add_argument(
        "--json", action="store_true", help="print only JSON on stdout (progress on stderr)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="PATH", help="also write the JSON to PATH"
    )


def emit(args: argparse.Namespace, data: Any, human: Callable[[], None]) -> int:
    """Print ``data`` as JSON (``--json``) or through ``human()``; write it to ``--out`` too.
    Returns 0, or 2 with one line on stderr when ``--out`` cannot be written."""
    text = json.dumps(iso_times(data), indent=2, default=str)
    out: Path | None = getattr(args, "out", None)
    if out is not None:
        try:
            write_private(out, text + "\n")  # a report may name hosts and personal data
        except OSError as exc:
            print(f"error: --out {out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if getattr(args, "json", False):
        print(text)
    else:
        human()
    return 0
