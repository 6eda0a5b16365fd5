"""Structured logs and the folding of key names into bounded patterns."""
