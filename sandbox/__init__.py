"""Local stand-ins for the downstream services (payment gateway, SMTP sink) that count every
effect. The core reaches them only through the client interfaces in ``resources/``."""
