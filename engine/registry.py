"""The job types sekali knows, by name: discovered, never listed.

A job type is declared in a module of its own: a module-level ``JOB_TYPE`` (or, for a module
that declares several, a ``JOB_TYPES`` list). The registry imports, by name and at first use
(never when :mod:`engine` is imported):

- every module of the built-in package ``pipelines.jobs`` (one without a declaration is a
  helper, skipped), and
- every module named in ``SEKALI_JOB_MODULES`` (comma-separated import paths, e.g.
  ``myjobs.loyalty,myjobs.refunds``): how a package outside this tree adds job types.

A named module that cannot be found, or declares no job type, and two modules declaring the same
name, are a :class:`JobModuleError` saying which. Job types are kept in name order; the
downstreams they call (:func:`downstreams`) are collected from their ``clients``.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from collections.abc import Iterator, MutableMapping
from types import ModuleType

from engine.contract import JobType
from engine.downstreams import Downstream
from resources.errors import PermanentJobError, ValidationError, shown

BUILT_IN_PACKAGE = "pipelines.jobs"
MODULES_ENV = "SEKALI_JOB_MODULES"

log = logging.getLogger(__name__)


class JobModuleError(PermanentJobError):
    """A job module could not be used: fix ``SEKALI_JOB_MODULES`` or the module named."""


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise JobModuleError(
                f"job module {name!r} (from {MODULES_ENV}) cannot be found: install its package "
                "or put it on PYTHONPATH, or correct the name"
            ) from exc
        raise


def declared(module: ModuleType) -> list[JobType]:
    """The job types ``module`` declares (``JOB_TYPE`` and the members of ``JOB_TYPES``)."""
    found = [getattr(module, "JOB_TYPE", None), *getattr(module, "JOB_TYPES", ())]
    types = [jt for jt in found if jt is not None]
    wrong = [jt for jt in types if not isinstance(jt, JobType)]
    if wrong:
        raise JobModuleError(
            f"job module {module.__name__!r}: JOB_TYPE / JOB_TYPES must hold engine.JobType "
            f"declarations, found {type(wrong[0]).__name__}"
        )
    return types


def job_modules(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """The import paths searched: the built-in package's modules, then ``SEKALI_JOB_MODULES``."""
    package = importlib.import_module(BUILT_IN_PACKAGE)
    built_in = [
        f"{BUILT_IN_PACKAGE}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    ]
    env = os.environ if environ is None else environ
    named = [name.strip() for name in env.get(MODULES_ENV, "").split(",") if name.strip()]
    return built_in + [name for name in named if name not in built_in]


def discover(environ: MutableMapping[str, str] | None = None) -> dict[str, JobType]:
    """Import every job module and collect its job types, by name (see the module)."""
    return _discover(environ)[0]


def _discover(
    environ: MutableMapping[str, str] | None = None,
) -> tuple[dict[str, JobType], dict[str, str]]:
    """The job types by name, and the module that declared each."""
    env = os.environ if environ is None else environ
    named = {name.strip() for name in env.get(MODULES_ENV, "").split(",") if name.strip()}
    owners: dict[str, str] = {}
    found: dict[str, JobType] = {}
    for name in job_modules(env):
        types = declared(_import(name))
        if not types and name in named:
            raise JobModuleError(
                f"job module {name!r} (from {MODULES_ENV}) declares no job type: define a "
                "module-level JOB_TYPE = engine.JobType(...) (or a JOB_TYPES list)"
            )
        for jt in types:
            if jt.name in owners:
                raise JobModuleError(
                    f"job type {jt.name!r} is declared twice, by {owners[jt.name]!r} and "
                    f"{name!r}: rename one"
                )
            owners[jt.name] = name
            found[jt.name] = jt
            if jt.missing_lookup:
                log.warning(
                    "job type %r (%s) sends effects to %s but declares no lookup: an unknown "
                    "outcome cannot be asked there; declare lookup= (docs/job-types.md)",
                    jt.name, name, ", ".join(d.name for d in jt.calls.clients),
                )
    return dict(sorted(found.items())), owners


class JobTypes(MutableMapping[str, JobType]):
    """Every job type by name, discovered on first access. Mutable so a test can swap one in
    (``monkeypatch.setitem``); :meth:`reload` discovers again (after ``SEKALI_JOB_MODULES``
    changed)."""

    def __init__(self) -> None:
        self._types: dict[str, JobType] | None = None
        self._owners: dict[str, str] = {}

    def _all(self) -> dict[str, JobType]:
        if self._types is None:
            self._types, self._owners = _discover()
        return self._types

    def reload(self) -> None:
        self._types = None
        self._owners = {}

    def modules(self) -> list[str]:
        """The modules the job types were declared in, in discovery order (built-in first)."""
        self._all()
        return list(dict.fromkeys(self._owners.values()))

    def module_of(self, name: str) -> str | None:
        """The module that declared job type ``name`` (None for one swapped in by hand)."""
        self._all()
        return self._owners.get(name)

    def __getitem__(self, name: str) -> JobType:
        return self._all()[name]

    def __setitem__(self, name: str, value: JobType) -> None:
        self._all()[name] = value

    def __delitem__(self, name: str) -> None:
        del self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"JobTypes({sorted(self._all())})"


JOB_TYPES = JobTypes()


class UnknownJobType(PermanentJobError):
    """A person named a job type this process does not know: usually one of their own whose
    module is not named in ``SEKALI_JOB_MODULES`` in this process's environment (the shell of
    a ``sekali`` command, as in ``sekali dev``'s). The message names the variable, its value
    here and the modules this process loaded. An operator's mistake, not a refused input: the
    CLI exits 2 and keeps no rejection row."""

    def __init__(self, name: object) -> None:
        super().__init__(
            f"unknown job type {shown(name)}: this process knows {', '.join(JOB_TYPES)} "
            f"({_where_from()}); a job type of your own is found when its module is named in "
            f"{MODULES_ENV} (comma-separated import paths, e.g. myjobs.loyalty) here as in "
            "`sekali dev`"
        )
        self.name = name


def _where_from() -> str:
    """Where this process looked for job types, for a person: the modules and the variable."""
    built_in = [m for m in JOB_TYPES.modules() if m.startswith(BUILT_IN_PACKAGE + ".")]
    others = [m for m in JOB_TYPES.modules() if m not in built_in]
    named = os.environ.get(MODULES_ENV, "").strip()
    return (f"loaded from {BUILT_IN_PACKAGE} ({len(built_in)} modules)"
            + (f" and {', '.join(others)}" if others else "")
            + (f"; {MODULES_ENV}={named}" if named else f"; {MODULES_ENV} is not set"))


def require_job_type(name: object) -> JobType:
    """The job type called ``name``, or :class:`UnknownJobType` saying where this process
    looked (for surfaces where a person typed the name: the CLI)."""
    if isinstance(name, str) and name in JOB_TYPES:
        return JOB_TYPES[name]
    raise UnknownJobType(name)


def get_job_type(name: str) -> JobType:
    """The job type called ``name``; unknown names are a :class:`ValidationError` on ``job_type``.
    """
    try:
        return JOB_TYPES[name]
    except (KeyError, TypeError):
        raise ValidationError(
            "job_type", f"unknown job type (known: {', '.join(sorted(JOB_TYPES))}; "
            f"{_where_from()})", name
        ) from None


def downstreams() -> dict[str, Downstream]:
    """Every downstream some job type calls, by name, in the order the job types name them.
    Two different declarations under one name are a :class:`JobModuleError`."""
    found: dict[str, Downstream] = {}
    for jt in JOB_TYPES.values():
        for client in jt.calls.clients:
            known = found.setdefault(client.name, client)
            if known is not client and known != client:
                raise JobModuleError(
                    f"downstream {client.name!r} is declared twice (job type {jt.name!r} "
                    "names another declaration under the same name): declare it once, import it"
                )
    return found


def downstream(name: str) -> Downstream:
    """The downstream called ``name``; a :class:`JobModuleError` when no job type calls it."""
    found = downstreams()
    if name not in found:
        raise JobModuleError(
            f"no job type calls a downstream {name!r} (known: {', '.join(found) or 'none'})"
        )
    return found[name]


def key_owner(key: str) -> str | None:
    """The job type whose keys start like ``key`` (its ``prefix``), or None."""
    for jt in JOB_TYPES.values():
        prefix = jt.prefix
        if prefix and key.startswith(prefix):
            return jt.name
    return None


__all__ = [
    "JOB_TYPES",
    "JobModuleError",
    "JobType",
    "JobTypes",
    "UnknownJobType",
    "declared",
    "discover",
    "downstream",
    "downstreams",
    "get_job_type",
    "key_owner",
    "require_job_type",
]
