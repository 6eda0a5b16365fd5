"""The proof harness: ``sekali chaos`` (break the platform the way production does, then check the
invariants from the downstreams' own records) and ``sekali demo`` (naive against guarded)."""
