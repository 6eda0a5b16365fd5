"""``from pipelines.runtime import execute_request`` as the README shows it: the one execution
path is the platform's (:mod:`engine.runtime`)."""

from engine.runtime import RequestOutcome, execute_request

__all__ = ["RequestOutcome", "execute_request"]
