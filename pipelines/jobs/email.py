"""``send_email``: one mail per intent, key ``email:{template}:{user_id}:{date}``.

No lock: the idempotency claim is enough, and the Message-ID is derived from the key
(:func:`pipelines.domain.mail.message_id_for`), so even the one case the claim cannot close (the
worker dies after the SMTP server accepted the mail and before the key completes) gives a redelivery
with the same Message-ID, which mail clients and the sink recognise as the same message.

States (recorded per attempt, status before/after): ``not_sent -> sent``.
"""

from __future__ import annotations

import datetime
import logging
import re
import string
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from email.utils import make_msgid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import (
    SEND_TRIES,
    Calls,
    ChaosCase,
    ChaosCount,
    ChaosProof,
    Check,
    Effect,
    JobContext,
    JobType,
    Keying,
    NaiveRun,
    Presentation,
    Queue,
    Running,
    Upkeep,
    formatted,
    in_lanes,
    require_str,
)
from engine.services import MissingClient
from pipelines.domain.mail import SMTP, Mailer, mail_session, message_id_for, single_address
from resources.errors import SendDeadlinePassed, ValidationError, shown
from resources.headers import refuse_control

log = logging.getLogger(__name__)

TEMPLATES: dict[str, tuple[str, str]] = {
    "welcome": ("Welcome, $name", "Hello $name,\n\nwelcome to sekali.\n"),
    "receipt": (
        "Your receipt for order $order_id",
        "Hello $name,\n\nthanks for order $order_id.\n",
    ),
    "reminder": ("A reminder", "Hello $name,\n\nthis is your reminder for $date.\n"),
}

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _is_calendar_date(text: str) -> bool:
    """The key names a day: a date that does not exist would name an intent that cannot be."""
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


TemplateName = Literal["receipt", "reminder", "welcome"]
assert set(typing.get_args(TemplateName)) == set(TEMPLATES)


def _template(payload: dict[str, Any], field_name: str) -> str:
    template = require_str(payload, field_name)
    if template not in TEMPLATES:
        known = ", ".join(sorted(TEMPLATES))
        raise ValidationError(
            field_name, f"must be one of {known}, got {shown(template)}", template
        )
    return template


def _date(payload: dict[str, Any], field_name: str) -> str:
    date = require_str(payload, field_name)
    if len(date) != 10 or not _DATE.fullmatch(date) or not _is_calendar_date(date):
        raise ValidationError(
            field_name, f"must be an ISO date YYYY-MM-DD that exists, got {shown(date)}", date
        )
    return date


def _address(payload: dict[str, Any], field_name: str) -> str:
    return single_address(field_name, payload.get(field_name))  # personal: never quoted


def _context(payload: dict[str, Any], field_name: str) -> dict[str, str]:
    context = payload.get(field_name)
    if not isinstance(context, dict) or not all(isinstance(k, str) for k in context):
        raise ValidationError(
            field_name, f"must be an object of template variables, got {shown(context)}",
            context,
        )
    return {k: str(v) for k, v in sorted(context.items())}


class EmailRequest(BaseModel):
    """One templated mail: the key is ``email:{template}:{user_id}:{date}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"template": "welcome", "user_id": "u-example-1", "date": "2026-11-29",
         "to": "u-example-1@example.com", "context": {}},
    ]})

    template: Annotated[TemplateName, Check(_template), Field(
        description="Which mail; part of the key email:{template}:{user_id}:{date}.")]
    user_id: Annotated[str, Check(require_str), Field(
        description="The recipient's user id (no spaces or ':').")]
    date: Annotated[str, Check(_date), Field(
        description="The day the mail is for, YYYY-MM-DD: one mail per day.")]
    to: Annotated[str, Check(_address), Field(description="The recipient's e-mail address.")]
    context: Annotated[dict[str, str], Check(_context)] = Field(
        default_factory=dict,
        description="Template variables (strings), e.g. order_id for receipt.",
    )

    @model_validator(mode="after")
    def _subject_has_no_control(self) -> EmailRequest:
        subject = string.Template(TEMPLATES[self.template][0])
        for name in subject.get_identifiers():  # what reaches the Subject header
            if name in self.context:
                refuse_control(f"context.{name}", self.context[name])
        return self


key_for = formatted("email:{template}:{user_id}:{date}")


def render(p: EmailRequest | Mapping[str, Any]) -> tuple[str, str]:
    """The mail's subject and body (``p`` a validated payload, typed or as its dict)."""
    if not isinstance(p, EmailRequest):
        p = EmailRequest.model_validate(dict(p))
    subject, body = TEMPLATES[p.template]
    values = {"name": p.user_id, "date": p.date, **p.context}
    return (
        string.Template(subject).safe_substitute(values),
        string.Template(body).safe_substitute(values),
    )


def send_email(ctx: JobContext, p: EmailRequest) -> dict[str, Any]:
    mailer: Mailer = ctx.client(SMTP.name)
    return _send(ctx, p, mailer)


def send_emails(items: Sequence[tuple[JobContext, EmailRequest]]) -> list[Any]:
    """A micro-batch of mails, looked up first in one read of the provider's record
    (:func:`_found_for_batch`), then sent on the mailer's ``connections`` SMTP connections at
    once, one per lane (:func:`engine.in_lanes`): a mail is four round trips to the relay,
    which lanes overlap. Each mail is still its own attempt (lease confirmed, send bound,
    crash points, its own result or error)."""
    if not items:
        return []
    try:
        mailer: Mailer = items[0][0].client(SMTP.name)
    except MissingClient as error:
        return [error for _ in items]
    found = _found_for_batch(mailer, items)

    def lane(part: list[tuple[JobContext, EmailRequest]]) -> list[Any]:
        results: list[Any] = []
        with mail_session(mailer) as session:
            for ctx, p in part:
                try:
                    results.append(_send(ctx, p, session, found=found))
                except Exception as exc:  # noqa: BLE001 - this mail's failure, not the batch's
                    results.append(exc)
        return results

    return in_lanes(items, int(getattr(mailer, "connections", 1)), lane)


def _send(ctx: JobContext, p: EmailRequest, mailer: Mailer,
          found: frozenset[str] | None = None) -> dict[str, Any]:
    """Send ``p`` unless the provider accepted its Message-ID before. ``found``: the
    Message-IDs the batch's one lookup found (:func:`_found_for_batch`); None: ask now."""
    subject, body = render(p)
    message_id = message_id_for(ctx.key)
    ctx.attempt.status_before = "not_sent"
    again = _again(ctx)
    if (again or JOB_TYPE.looks_up_first()) and (
        message_id in found if found is not None else _accepted_before(ctx, p, again=again)
    ):
        ctx.attempt.status_before = ctx.attempt.status_after = "sent"
        return {"message_id": message_id, "to": p.to}
    ctx.crash_point("before_send")
    for tries_left in range(SEND_TRIES - 1, -1, -1):
        send_by = ctx.confirm_lease()
        try:
            with ctx.timed("smtp"):
                mailer.send(
                    to=p.to, subject=subject, body=body, message_id=message_id,
                    correlation_id=ctx.correlation_id, send_by=send_by,
                )
            break
        except SendDeadlinePassed:
            # nothing was handed over: confirm again (LeaseLost when taken over), then resend
            if not tries_left:
                raise
    ctx.crash_point("after_send")
    ctx.attempt.status_after = "sent"
    return {"message_id": message_id, "to": p.to}


def _again(ctx: JobContext) -> bool:
    """A claim after the first: the last holder may have sent (see :func:`_accepted_before`)."""
    return ctx.claim.takeover or ctx.claim.attempt > 1


def _found_for_batch(
    mailer: Mailer, items: Sequence[tuple[JobContext, EmailRequest]]
) -> frozenset[str] | None:
    """The Message-IDs, among those of the batch's mails that look up first, that the
    provider's record already holds: one read for the batch instead of one per mail. None
    when the mailer cannot read several at once (a client wrapped without
    ``find_messages_many``): each mail then asks on its own, as a single one does.

    The read is as conclusive as one right before each send. Every key of the batch was
    claimed before the handler runs, so each earlier holder's lease had run out before the
    read, and its sends ended before that: a holder sends only up to its send bound, 0.4 of a
    lease after its last confirmation (:meth:`JobContext.confirm_lease`), and the lease runs
    at least 0.6 of a lease beyond that bound. Timeline, lease L, one key::

        t0         A confirms its lease (it runs until at least t0 + L), then sends
        t0 + .4L   A's bound: no byte of A's leaves later (its client refuses, paused or not)
        t0 + L     the lease can run out; B's batch claims the key (begin_many), then more
        later      B's handler reads the record for the whole batch, at least 0.6 L after
                   A's last byte (as a read right before B's send would be): A's mail, once
                   the provider took it, is in it, and B does not send it

    A record that cannot be read (no ``SEKALI_SMTP_LOG_URL``, the provider down) is what it
    is for a single mail: the mails are sent, under their Message-ID (receivers deduplicate
    it), and a first send says so once per process."""
    wanted = {message_id_for(ctx.key): _again(ctx) for ctx, _ in items
              if _again(ctx) or JOB_TYPE.looks_up_first()}
    if not wanted:
        return frozenset()
    many = getattr(mailer, "find_messages_many", None)
    if many is None:
        return None
    try:
        return frozenset(str(m["message_id"]) for m in many(sorted(wanted)))
    except Exception as exc:  # noqa: BLE001 - no record to ask: send, as without a lookup
        if any(wanted.values()) or not _NO_RECORD_TOLD.is_set():
            _NO_RECORD_TOLD.set()
            log.warning("no Message-ID lookup for a batch of %d mails before sending: %s",
                        len(wanted), exc)
        return frozenset()


def _accepted_before(ctx: JobContext, p: EmailRequest, *, again: bool) -> bool:
    """Any claim after the first may follow a send: the last holder handed this mail over and
    died before recording it (a batch worker killed after the SMTP accept), or its attempt saw
    no answer (the reply lost after the server accepted: a transient failure, retried). So may
    a first claim, when a database failover rolled back the key a sent mail had completed:
    SMTP dedupes nothing, so the job type looks up first (``lookup_first``, on by default). Ask the
    provider's record by Message-ID before sending again. A provider whose record cannot be read
    gets the mail again, under the same Message-ID (receivers deduplicate it)."""
    try:
        return bool(lookup_mails(ctx.client, ctx.key, p))
    except Exception as exc:  # noqa: BLE001 - no record to ask: send, as without a lookup
        if again or not _NO_RECORD_TOLD.is_set():  # a first send: said once per process
            _NO_RECORD_TOLD.set()
            log.warning("no Message-ID lookup for %s before sending: %s", ctx.key, exc)
        return False


_NO_RECORD_TOLD = threading.Event()


def lookup_mails(client: Callable[[str], Any], key: str, payload: Any) -> list[Effect]:
    """The messages the mail provider accepted under this intent's Message-ID
    (:func:`message_id_for`), oldest first; raises :class:`MailUnavailable` when its record
    cannot be read."""
    mailer = client(SMTP.name)  # an SmtpMailer: a bare Mailer cannot be asked
    message_id = message_id_for(key)
    return [
        Effect(message_id, m.get("received_at"), {"subject": m.get("subject")})
        for m in mailer.find_messages(message_id)
    ]


# -- what the chaos proof needs (engine.chaos) ------------------------------------------------

CHAOS_DATE = "2026-11-29"


def _chaos_sample(i: int, poison: bool) -> dict[str, Any]:
    """Request ``i`` of the chaos mix: a welcome mail to a user of its own; poison has no
    address."""
    return {"template": "welcome", "user_id": f"u{i}", "date": CHAOS_DATE,
            "to": "not-an-address" if poison else f"u{i}@example.com"}


def _naive_send(run: NaiveRun, clean: dict[str, Any], key: str, correlation_id: str) -> None:
    subject, body = render(clean)
    run.client(SMTP.name).send(
        to=clean["to"], subject=subject, body=body,
        message_id=make_msgid(domain="naive.sekali"), correlation_id=correlation_id,
    )


_RESEND_WINDOWS = ("kill:after_effect", "stop:before_effect", "stop:after_effect",
                   "pg-restart:outage")
"""The faults after which one resend of a mail (same Message-ID) is allowed: the holder died
after the SMTP server accepted and before the record (kill:after_effect), or froze after its
last lease check (stop:before_effect sits inside the mailer, past confirm_lease;
stop:after_effect past the send) and was taken over, or the app database restarted under it."""


def _count_mails(_: None, case: ChaosCase) -> ChaosCount:
    """One effect per distinct Message-ID the sink accepted; a resend of one is allowed per
    fault window that explains it. A takeover no planned kill or stop explains is a holder
    stalled past its lease by the machine itself: the same window as a stop, so one more
    resend is allowed per such takeover, and counted."""
    effects = len({m["message_id"] for m in case.arrivals})
    planned = sum(n for fault, n in case.struck.items() if fault.startswith(("kill:", "stop:")))
    unplanned = max(0, case.takeovers - planned)
    allowed = sum(case.struck.get(fault, 0) for fault in _RESEND_WINDOWS) + unplanned
    return ChaosCount(effects, resends=len(case.arrivals) - effects, allowed_resends=allowed,
                      stats={"takeovers_unplanned": unplanned})


CHAOS = ChaosProof(
    mix=(0.7, 0.85), sample=_chaos_sample, naive=_naive_send,
    effect_calls=("send",), lookup_calls=("find_messages",), after_effect=("after_send",),
    count=_count_mails, retention_first=True,
)
"""Part of the chaos mix, judged by the mail sink's own record; retention-travel plants its
dead letters on mails first: SMTP dedupes nothing, so a replay after the purge would resend."""


JOB_TYPE = JobType(
    name="send_email",
    queue=Queue.LIGHT,
    payload=EmailRequest,
    handler=send_email,
    side_effect=True,
    keying=Keying(key_for=key_for, resource_id=formatted("{user_id}")),
    running=Running(max_runtime_seconds=120, handler_many=send_emails),
    calls=Calls(clients=(SMTP,), lookup=lookup_mails),
    upkeep=Upkeep(chaos=CHAOS),
    presentation=Presentation(
        description="Send one templated mail per (template, user, date).",
        result_fields=("message_id",),
        personal=frozenset({"to"}),
    ),
)
validate = JOB_TYPE.validate
