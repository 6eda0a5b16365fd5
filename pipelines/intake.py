"""``from pipelines.intake import enqueue`` as the README shows it: the intake is the
platform's (:mod:`engine.intake`)."""

from engine.intake import enqueue
from engine.requests import EnqueueResult

__all__ = ["EnqueueResult", "enqueue"]
