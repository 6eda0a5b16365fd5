"""``send_email``: one mail per intent, key ``email:{template}:{user_id}:{date}``.

No lock: the idempotency claim is enough, and the Message-ID is derived from the key
(:func:`pipelines.domain.mail.message_id_for`), so even the one case the claim cannot close (the
worker dies after the SMTP server accepted the mail and before the key completes) gives a redelivery
with the same Message-ID, which mail clients and the sink recognise as the same message.

States (recorded per attempt, status before/after): ``not_sent -> sent``.
"""

from __future__ import annotations

import datetime
import re
import string
from collections.abc import Sequence
from typing import Any

from engine import (
    SEND_TRIES,
    JobContext,
    JobType,
    PayloadField,
    reject_unknown,
    require_str,
)
from engine.services import MissingClient
from pipelines.domain.mail import SMTP, Mailer, mail_session, message_id_for, single_address
from resources.errors import SendDeadlinePassed, ValidationError, shown
from resources.headers import refuse_control

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


def validate(payload: dict[str, Any]) -> dict[str, Any]:
    reject_unknown(payload, {"template", "user_id", "date", "to", "context"})
    template = require_str(payload, "template")
    if template not in TEMPLATES:
        known = ", ".join(sorted(TEMPLATES))
        raise ValidationError(
            "template", f"must be one of {known}, got {shown(template)}", template
        )
    date = require_str(payload, "date")
    if len(date) != 10 or not _DATE.fullmatch(date) or not _is_calendar_date(date):
        raise ValidationError(
            "date", f"must be an ISO date YYYY-MM-DD that exists, got {shown(date)}", date
        )
    to = single_address("to", payload.get("to"))  # personal: never quoted
    context = payload.get("context", {})
    if not isinstance(context, dict) or not all(isinstance(k, str) for k in context):
        raise ValidationError(
            "context", f"must be an object of template variables, got {shown(context)}",
            context,
        )
    subject = string.Template(TEMPLATES[template][0])
    for name in subject.get_identifiers():  # what reaches the Subject header
        if isinstance(context.get(name), str):
            refuse_control(f"context.{name}", context[name])
    return {
        "template": template,
        "user_id": require_str(payload, "user_id"),
        "date": date,
        "to": to,
        "context": {k: str(v) for k, v in sorted(context.items())},
    }


def key_for(payload: dict[str, Any]) -> str:
    return f"email:{payload['template']}:{payload['user_id']}:{payload['date']}"


def render(p: dict[str, Any]) -> tuple[str, str]:
    subject, body = TEMPLATES[p["template"]]
    values = {"name": p["user_id"], "date": p["date"], **p["context"]}
    return (
        string.Template(subject).safe_substitute(values),
        string.Template(body).safe_substitute(values),
    )


def send_email(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    mailer: Mailer = ctx.client(SMTP.name)
    return _send(ctx, p, mailer)


def send_emails(items: Sequence[tuple[JobContext, dict[str, Any]]]) -> list[Any]:
    """A micro-batch of mails over one SMTP connection; each mail is still its own attempt
    (lease confirmed, crash points, its own result or error)."""
    if not items:
        return []
    try:
        mailer: Mailer = items[0][0].client(SMTP.name)
    except MissingClient as error:
        return [error for _ in items]
    results: list[Any] = []
    with mail_session(mailer) as session:
        for ctx, p in items:
            try:
                results.append(_send(ctx, p, session))
            except Exception as exc:  # noqa: BLE001 - this mail's failure, not the batch's
                results.append(exc)
    return results



def _send(ctx: JobContext, p: dict[str, Any], mailer: Mailer) -> dict[str, Any]:
    subject, body = render(p)
    message_id = message_id_for(ctx.key)
    ctx.attempt.status_before = "not_sent"
    ctx.crash_point("before_send")
    for tries_left in range(SEND_TRIES - 1, -1, -1):
        send_by = ctx.confirm_lease()
        try:
            with ctx.timed("smtp"):
                mailer.send(
                    to=p["to"], subject=subject, body=body, message_id=message_id,
                    correlation_id=ctx.correlation_id, send_by=send_by,
                )
            break
        except SendDeadlinePassed:
            # nothing was handed over: confirm again (LeaseLost when taken over), then resend
            if not tries_left:
                raise
    ctx.crash_point("after_send")
    ctx.attempt.status_after = "sent"
    return {"message_id": message_id, "to": p["to"]}


JOB_TYPE = JobType(
    name="send_email",
    queue="light",
    validate=validate,
    key_for=key_for,
    max_runtime_seconds=120,
    side_effect=True,
    handler=send_email,
    resource_id=lambda p: str(p["user_id"]),
    clients=(SMTP,),
    description="Send one templated mail per (template, user, date).",
    fields=(
        PayloadField(
            "template", str, "Which mail; part of the key email:{template}:{user_id}:{date}.",
            choices=tuple(sorted(TEMPLATES)),
        ),
        PayloadField("user_id", str, "The recipient's user id (no spaces or ':')."),
        PayloadField("date", str, "The day the mail is for, YYYY-MM-DD: one mail per day."),
        PayloadField("to", str, "The recipient's e-mail address."),
        PayloadField(
            "context", dict, "Template variables (strings), e.g. order_id for receipt.",
            required=False,
        ),
    ),
    example={"template": "welcome", "user_id": "u-example-1", "date": "2026-11-29",
             "to": "u-example-1@example.com", "context": {}},
    result_fields=("message_id",),
    personal=frozenset({"to"}),
    handler_many=send_emails,
)
