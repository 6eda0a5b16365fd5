"""The transactional outbox and the inbox: events written in the business transaction, published
at least once in order per aggregate, and consumed once per consumer.
"""

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
    unpublished_older_than,
)
from resources.outbox.retention import expired_inbox, expired_outbox

__all__ = [
    "Consumer",
    "Handler",
    "InAppPublisher",
    "Inbox",
    "OutboxEvent",
    "OutboxPublisher",
    "PublishStats",
    "Publisher",
    "expired_inbox",
    "expired_outbox",
    "inbox",
    "outbox",
    "unpublished_older_than",
    "write_event",
]
