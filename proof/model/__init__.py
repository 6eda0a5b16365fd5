"""The SPIN model of the ledger protocol and its runner (``sekali model check``)."""
