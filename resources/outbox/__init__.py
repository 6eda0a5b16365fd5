"""The transactional outbox and the inbox: events written in the business transaction, published
at least once in order per aggregate, and consumed once per consumer.
"""

from resources.outbox.dead_letters import (
    DEFAULT_MAX_FAILURES,
    DeadLetterStatus,
    OutboxDeadLetter,
    OutboxDeadLetters,
)
from resources.outbox.events import inbox, outbox, write_event
from resources.outbox.publisher import (
    Consumer,
    Handler,
    InAppPublisher,
    Inbox,
    OutboxEvent,
    OutboxPublisher,
    Publisher,
    PublishStats,
    held_by_dead_letters,
    unpublished_older_than,
)
from resources.outbox.retention import expired_inbox, expired_outbox

__all__ = [
    "DEFAULT_MAX_FAILURES",
    "Consumer",
    "DeadLetterStatus",
    "OutboxDeadLetter",
    "OutboxDeadLetters",
    "Handler",
    "InAppPublisher",
    "Inbox",
    "OutboxEvent",
    "OutboxPublisher",
    "PublishStats",
    "Publisher",
    "expired_inbox",
    "expired_outbox",
    "held_by_dead_letters",
    "inbox",
    "outbox",
    "unpublished_older_than",
    "write_event",
]
