"""Every pattern run on user input is linear: a 64 KiB input costs at most a bounded multiple of
what a 1 KiB input costs, on the input each pattern finds hardest (no wall-clock limit: a ratio,
measured in the same run).

A linear check costs about 64 times more on 64 times the input (a length checked first: about
1 time); a quadratic one about 4,096 times. The bound below, 64 x 4, leaves room for a loaded
machine and fails any quadratic pattern by a factor of 16. Caught before the fix: ``send_email``'s
address check took 24.9 s on a 65,532-character ``to`` (at enqueue and again at intake),
``redact`` 2.2 s on ``a*8000@a*8000``, the stats' id folding and ``parse_age`` were quadratic too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from pipelines.domain.mail import single_address
from pipelines.jobs.email import validate as validate_email
from resources.dlq.fingerprints import normalise_message, top_frame
from resources.dlq.views import parse_age
from resources.errors import ValidationError
from resources.headers import http_header_value, refuse_control
from resources.telemetry.patterns import key_pattern
from resources.telemetry.redact import redact

KIB = 1024
SMALL, LARGE = KIB, 64 * KIB
BOUND = 64 * 4


def _email_to(n: int) -> dict[str, Any]:
    """A ``to`` the old pattern (``^[^@\\s]+@[^@\\s]+\\.[^@\\s]+$``) backtracked on:
    each dot of the domain tried as the last one, each try scanning to the end."""
    return {"template": "welcome", "user_id": "u-1", "date": "2026-11-29",
            "to": "a@" + "." * (n - 3) + "@"}


def _attempt(call: Callable[[Any], Any], value: Any) -> None:
    with contextlib.suppress(ValidationError, ValueError):  # refusing is fine: timed either way
        call(value)


def _cost(call: Callable[[Any], Any], value: Any, repeat: int) -> float:
    """The cheapest of 5 rounds of ``repeat`` calls, per call (the least disturbed)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            _attempt(call, value)
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


# (what, the function, the hardest input of n characters)
CASES: list[tuple[str, Callable[[Any], Any], Callable[[int], Any]]] = [
    ("send_email's to: a domain of dots", validate_email, _email_to),
    ("single_address: a*n@", lambda v: single_address("to", v), lambda n: "a" * (n - 1) + "@"),
    ("single_address: dots and ats", lambda v: single_address("to", v),
     lambda n: "a.@" * (n // 3)),
    ("redact: a*n@a*n", redact, lambda n: "a" * (n // 2) + "@" + "a" * (n // 2 - 1)),
    ("redact: a run of ats", redact, lambda n: "a@" * (n // 2)),
    ("redact: labels with hyphens", redact, lambda n: "a@" + "a-" * (n // 2 - 1)),
    ("key_pattern: a long word without a digit", key_pattern, lambda n: "a" * n),
    ("key_pattern: words around a digit", key_pattern, lambda n: ("a" * 63 + "1") * (n // 64)),
    ("parse_age: a number and spaces", parse_age, lambda n: "1" + " " * (n - 2) + "x"),
    ("normalise_message: hex and numbers", normalise_message,
     lambda n: ("deadbeef" * 8 + "-12.5 ") * (n // 70)),
    ("top_frame: unclosed file names", top_frame, lambda n: 'File "x' * (n // 7)),
    ("http_header_value: all non-ASCII", lambda v: http_header_value("k", v),
     lambda n: "日" * n),
    ("refuse_control: clean text", lambda v: refuse_control("k", v), lambda n: "x" * n),
]


@pytest.mark.parametrize(("what", "call", "make"), CASES, ids=[c[0] for c in CASES])
def test_a_64_kib_input_costs_a_bounded_multiple_of_a_1_kib_one(
    what: str, call: Callable[[Any], Any], make: Callable[[int], Any]
) -> None:
    small, large = make(SMALL), make(LARGE)
    ratio = _cost(call, large, 1) / _cost(call, small, 64)
    print(f"{what}: 64 KiB / 1 KiB = {ratio:.1f}")
    assert ratio <= BOUND, f"{what}: {ratio:.0f} times the cost for 64 times the input"


def test_the_long_to_is_refused_naming_the_field_without_quoting_it() -> None:
    with pytest.raises(ValidationError) as refused:
        validate_email(_email_to(65_532))
    assert refused.value.field == "to" and "aaaa" not in str(refused.value)
