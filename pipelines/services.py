"""``from pipelines.services import Services`` as the README shows it: the services a job runs
on are the platform's (:mod:`engine.services`)."""

from engine.services import Services

__all__ = ["Services"]
