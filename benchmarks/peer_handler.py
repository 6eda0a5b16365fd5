"""The ``send_email`` body the peers run: the same validation, key, template and Message-ID as
sekali's handler (:mod:`pipelines.jobs.email`), without sekali's ledger around it.

A Celery or procrastinate user writing this job would write this function: validate the payload,
render the mail and hand it to SMTP. The Message-ID comes from the intent's key
(:func:`pipelines.domain.mail.message_id_for`), as sekali's does, so the mail sink counts every
system's mails per intent the same way: a second mail with one Message-ID is a duplicate send.

The mailer is the project's :class:`SmtpMailer` (one connection per message, the 10 s socket
and 30 s send bounds) on the sink named by ``SEKALI_SMTP_HOST`` / ``SEKALI_SMTP_PORT``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pipelines.domain.mail import SmtpMailer, message_id_for
from pipelines.jobs import email


@functools.cache
def mailer() -> SmtpMailer:
    """This process's mailer, built on first use from the environment."""
    return SmtpMailer(
        os.environ.get("SEKALI_SMTP_HOST", "127.0.0.1"), int(os.environ["SEKALI_SMTP_PORT"])
    )


def send_email(payload: dict[str, Any]) -> str:
    """Validate, render and send one mail; returns its Message-ID."""
    p = email.validate(payload)
    subject, body = email.render(p)
    message_id = message_id_for(email.key_for(p))
    mailer().send(to=p["to"], subject=subject, body=body, message_id=message_id)
    return message_id
