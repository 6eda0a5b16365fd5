"""The one place that chooses resources: embedded defaults or production, from the environment
at run time (resources read ``DATABASE_URL`` / ``REDIS_URL`` in setup, never at import)."""

from __future__ import annotations

from typing import Any

from pipelines.observability import ObservabilityResource
from resources.cache import CacheResource
from resources.database import DatabaseResource
from resources.dlq import DlqResource
from resources.idempotency import IdempotencyResource
from resources.locks import LockResource
from resources.mail import MailerResource
from resources.payments import PaymentGatewayResource
from resources.requests import RequestsResource
from resources.retry import RetryResource


def resource_defs() -> dict[str, Any]:
    return {
        "idempotency": IdempotencyResource(),
        "app_db": DatabaseResource(),
        "locks": LockResource(),
        "cache": CacheResource(),
        "gateway": PaymentGatewayResource(),
        "mailer": MailerResource(),
        "retry": RetryResource(),
        "observability": ObservabilityResource(),
        "requests": RequestsResource(),
        "dlq": DlqResource(),
    }
