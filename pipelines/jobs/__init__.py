"""The built-in job types, one module each (a module-level ``JOB_TYPE``): the registry
(:mod:`engine.registry`) finds every module here. Nothing outside a job type's module names it.
"""
