"""The code location: the job types (``jobs/``, one module each), the business they act on
(``domain/``), the Dagster adapter generated from the registry (``ops/``, ``assets/``,
``profile.py``, ``instance.py``) and ``definitions.py``, which only assembles."""
