"""Structured logs, the folding of key names into bounded patterns, and bounded counters."""
