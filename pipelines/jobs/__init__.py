"""The job types, one module each: validation, key, budget and handler, as plain code."""
