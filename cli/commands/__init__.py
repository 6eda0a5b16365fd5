"""Subcommands of the sekali CLI, one module each."""
