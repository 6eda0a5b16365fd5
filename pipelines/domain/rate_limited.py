"""The payment and mail clients at their downstream's shared rate: one token per call.

Every worker takes its token from the same Redis bucket (:class:`resources.flow.RateLimits`),
so the downstream sees at most ``burst + rate * t`` calls in any ``t`` seconds however many
workers run. A call waits its turn up to the setting's ``wait``, then fails with
:class:`resources.errors.RateLimited` (transient, ``retry_after`` set, no retry budget spent).
An answer carrying ``Retry-After`` (a 429 or 503 from the gateway) lowers the rate for every
worker for that long. The clients themselves stay unaware of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.domain.mail import Mailer
from pipelines.domain.payments import Charge, PaymentGateway
from resources.flow import RateLimits

PAYMENT_GATEWAY = "payment_gateway"
"""The downstream name of the payment gateway: ``SEKALI_RATE_PAYMENT_GATEWAY``, and its
retry-budget bucket (``charge_payment``'s ``downstream``)."""
MAIL = "smtp"
"""The downstream name of the mail server: ``SEKALI_RATE_SMTP`` (``send_email``'s)."""


@dataclass(frozen=True)
class RateLimitedGateway:
    """A :class:`PaymentGateway` whose every call (charge and lookup) takes a token first."""

    inner: PaymentGateway
    limits: RateLimits

    def charge(self, **call: Any) -> Charge:
        with self.limits.paced(PAYMENT_GATEWAY):
            return self.inner.charge(**call)

    def find_charges(self, reference: str) -> list[Charge]:
        with self.limits.paced(PAYMENT_GATEWAY):
            return self.inner.find_charges(reference)


@dataclass(frozen=True)
class RateLimitedMailer:
    """A :class:`Mailer` whose every send takes a token first."""

    inner: Mailer
    limits: RateLimits

    def send(self, **call: Any) -> None:
        with self.limits.paced(MAIL):
            self.inner.send(**call)


def limit_gateway(gateway: PaymentGateway, limits: RateLimits) -> PaymentGateway:
    """``gateway`` at its shared rate, or ``gateway`` itself when no rate is set."""
    if limits.limiter(PAYMENT_GATEWAY) is None:
        return gateway
    return RateLimitedGateway(gateway, limits)


def limit_mailer(mailer: Mailer, limits: RateLimits) -> Mailer:
    """``mailer`` at its shared rate, or ``mailer`` itself when no rate is set."""
    if limits.limiter(MAIL) is None:
        return mailer
    return RateLimitedMailer(mailer, limits)
