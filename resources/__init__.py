"""The defences: plain classes that need no Dagster context, and thin resources wrapping them."""
