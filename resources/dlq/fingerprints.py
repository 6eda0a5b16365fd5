"""Fingerprints group failures that share one cause, whatever varies between occurrences
(ids, numbers, line numbers); :func:`failure_line` says a failure in one line for a person."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_HEX = re.compile(
    r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}\b"
)
_NUM = re.compile(r"(?<![A-Za-z_])-?\d+(?:\.\d+)?")
_FRAME = re.compile(r'File "([^"\n]+)", line \d+, in (\S+)')
_FRAME_TAIL = 20_000  # top_frame reads the innermost frame: the last characters of a trace
def normalise_message(message: str) -> str:
    """The message with what varies between occurrences (uuids, hex ids, numbers) replaced."""
    message = _UUID.sub("<uuid>", message)
    message = _HEX.sub("<hex>", message)
    message = _NUM.sub("<n>", message)
    return " ".join(message.split())[:500]


def top_frame(stack: Sequence[str] | str | None) -> str:
    """``file:function`` of the innermost frame (where it was raised); line numbers dropped so a
    fingerprint survives unrelated edits."""
    if not stack:
        return ""
    text_ = stack if isinstance(stack, str) else "".join(stack)
    frames = _FRAME.findall(text_[-_FRAME_TAIL:])
    if not frames:
        return ""
    path, func = frames[-1]  # the innermost frame: the end of the text is enough
    return f"{path.rsplit('/', 1)[-1]}:{func}"


_TRACE_START = re.compile(r"\n\s*(?:Stack Trace:|Traceback \(most recent call last\):)")


def failure_line(error_type: str | None, message: str | None) -> str:
    """A failure as one line for a person: ``Type: message``, the type said once (a message
    that starts with it, qualified or not, is not prefixed again), any stack trace the message
    carries (a run failure's ``Stack Trace:``, a ``Traceback``) left out, whitespace folded.
    What ``sekali dlq list|show`` and the ``dead_letters`` asset print."""
    text_ = _TRACE_START.split(message or "", maxsplit=1)[0]
    text_ = " ".join(text_.split())
    kind = error_type or ""
    if not kind:
        return text_
    qualified = re.match(rf"[\w.]*\.{re.escape(kind)}:", text_)
    if qualified:  # ``pkg.module.UnknownSku: ...`` reads as ``UnknownSku: ...``
        return kind + text_[qualified.end() - 1:]
    if text_.startswith(f"{kind}:") or text_ == kind:
        return text_
    return f"{kind}: {text_}" if text_ else kind


def fingerprint(error_type: str, message: str, frame: str) -> str:
    """Groups failures with one cause: exception type + normalised message + top frame."""
    raw = f"{error_type}|{normalise_message(message)}|{frame}"
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:16]
