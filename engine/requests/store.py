"""The one store callers use: :class:`RequestStore`, the intake table over a database, made of
its parts (one concern each, every one a :class:`~engine.requests.views.RequestViews`):

- :class:`~engine.requests.intake.RequestIntake`: enqueue, the record of a run nobody
  enqueued, rejections;
- :class:`~engine.requests.claims.RequestClaims`: the intake sensor's and the resident
  workers' claims (claim order, fair share, debounce groups);
- :class:`~engine.requests.lifecycle.RequestLifecycle`: the status changes, one conditional
  update each, checked against :data:`engine.requests.TRANSITIONS`;
- :class:`~engine.requests.cancels.RequestCancels`: cancel, and settling the cancels that wait;
- :class:`~engine.requests.views.RequestViews`: the reads (CLI, metrics, tenants, retention).
"""

from __future__ import annotations

from engine.requests.cancels import RequestCancels
from engine.requests.claims import RequestClaims
from engine.requests.intake import RequestIntake
from engine.requests.lifecycle import RequestLifecycle


class RequestStore(RequestIntake, RequestClaims, RequestLifecycle, RequestCancels):
    """The intake table over a :class:`Database`. Thread-safe; share one per process."""
