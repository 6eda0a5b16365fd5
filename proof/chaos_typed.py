"""``sekali chaos --job-type NAME[,NAME...]``: any registered job type under the faults.

What the harness needs of a job type it knows nothing about comes from the declaration:

- the workload: payloads built from the job type's ``example``, with every field that changes
  the key varied per request (so each request is its own intent); a poison payload carries a
  value of a field's own type that ``validate`` refuses (:func:`poisoned`);
- the world: each declared downstream's sandbox stand-in (:class:`engine.Sandbox`), started
  the way ``sekali dev`` starts it but on a free port (the setting its ``address`` names is
  moved: a ``*_PORT`` setting to the port, a ``*_URL`` one to the same URL on that port) with
  the settings the stand-in's records need (``Sandbox.environment``);
- the fault points: around every call of a declared client except the ones the job type's
  lookup hook reads with (:class:`proof.chaos_worker.HookedClient`);
- the verdict: effects counted at the downstream by the stand-in's own record where it declares
  one (``Sandbox.record``), else through the job type's ``lookup`` hook, said to be unverified;
  the lookup calibrated first and the send bound checked (:mod:`proof.chaos_truth`).

A job type that cannot be judged this way is refused before anything starts, with what to
declare: an unknown name, a side effect with no lookup hook, a downstream with no sandbox.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from engine.contract import JobType
from engine.downstreams import ClientOptions, Downstream, Stoppable
from engine.registry import JOB_TYPES, get_job_type
from resources.egress import ALLOW_ENV, allow_list
from resources.errors import ValidationError
from resources.storage.settings import Settings
from sandbox.redis_server import free_port

TYPED_FAULTS = ("kill", "stop", "redis-restart", "drop-response", "poison", "pg-restart",
                "redis-freeze", "redis-rollback", "redis-failover", "clock-skew",
                "budget-redis-down", "crash-loop", "poison-outbox",
                "evicting-redis")
"""The faults a ``--job-type`` run strikes: the others need a particular downstream (the
payment gateway's slow and dripping answers) or business (retention-travel's mails)."""


def job_types_of(names: Sequence[str], error: Callable[[str], Exception]) -> tuple[JobType, ...]:
    """The job types named, each one checked to be judgeable (see the module)."""
    out = []
    for name in names:
        if name not in JOB_TYPES:
            raise error(f"--job-type {name!r}: no such job type (registered: "
                        f"{', '.join(sorted(JOB_TYPES))}; add modules with SEKALI_JOB_MODULES)")
        jt = get_job_type(name)
        if jt.calls.lookup is None:
            raise error(
                f"--job-type {name}: it declares no lookup hook (Calls.lookup), so its effects "
                "cannot be counted at the downstream; declare one (docs/job-types.md)")
        if not jt.presentation.example:
            raise error(f"--job-type {name}: it declares no example payload (Presentation.example)")
        for d in jt.calls.clients:
            if d.sandbox is None:
                raise error(
                    f"--job-type {name}: its downstream {d.name!r} has no sandbox stand-in "
                    "(Downstream.sandbox), so the run has nothing to send to and count at")
        out.append(jt)
    return tuple(out)


def _with(payload: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    return {**payload, name: value}


def varied(jt: JobType, n: int) -> dict[str, Any]:
    """The example with each field that changes the key made unique to request ``n``
    (strings get ``-c<n>``, integers ``+ n``), each change kept only if ``validate`` takes it."""
    example = dict(jt.presentation.example)
    base = jt.keying.key_for(jt.validate(dict(example)))
    payload = dict(example)
    for spec in jt.presentation.fields:
        value = example.get(spec.name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, str) and not spec.choices:
            candidate = _with(example, spec.name, f"{value}-c{n}")
        elif isinstance(value, int):
            candidate = _with(example, spec.name, value + n)
        else:
            continue
        try:
            if jt.keying.key_for(jt.validate(dict(candidate))) == base:
                continue
            trial = _with(payload, spec.name, candidate[spec.name])
            jt.validate(dict(trial))
        except ValidationError:
            continue
        payload = trial
    return payload


POISON_VALUES: dict[type, tuple[Any, ...]] = {
    int: (-1, 0, 10**13),
    str: ("", "not valid: at all", "x" * 10_000),
}
"""Values of a field's own type that a job type's checks usually refuse (a negative amount, an
empty or malformed text): the payload still passes a typed launch form, so the refusal comes
from the job type's own ``validate`` inside the step, as a poison message's would."""


def poisoned(jt: JobType, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with one field's value refused by ``validate`` but of the field's declared
    type; if no such value is found, without its first required field."""
    for spec in jt.presentation.fields:
        for bad in POISON_VALUES.get(spec.type, ()):
            if spec.name not in payload or spec.choices:  # an enum: the form refuses it first
                continue
            candidate = _with(payload, spec.name, bad)
            try:
                jt.validate(dict(candidate))
            except ValidationError:
                return candidate
    required = [spec.name for spec in jt.presentation.fields
                if spec.required and spec.name in payload]
    if not required:
        return {**payload, "__poison__": 1}
    return {k: v for k, v in payload.items() if k != required[0]}


def typed_payloads(job_types: Sequence[JobType], count: int, *, seed: int,
                   poison_rate: float) -> list[tuple[str, dict[str, Any], bool]]:
    """``(job type, payload, poison)`` per request, the job types taking turns."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        jt = job_types[i % len(job_types)]
        payload = varied(jt, i)
        poison = rng.random() < poison_rate
        out.append((jt.name, poisoned(jt, payload) if poison else payload, poison))
    keys = [_key(get_job_type(name), p) for name, p, poison in out if not poison]
    if len(set(keys)) != len(keys):
        names = ", ".join(jt.name for jt in job_types)
        raise ValueError(f"{names}: no field of the example changes the key, so every request "
                         "would be the same intent")
    return out


def _key(jt: JobType, payload: dict[str, Any]) -> str:
    return jt.keying.key_for(jt.validate(dict(payload)))


def moved(setting: str, current: str | None, host: str, port: int) -> str:
    """The value of ``setting`` that moves a stand-in to ``port``."""
    if setting.endswith("_PORT"):
        return str(port)
    if setting.endswith("_URL") and current:
        parts = urlsplit(current)
        netloc = f"{parts.hostname or host}:{port}"
        if parts.username:
            netloc = f"{parts.username}{':' + parts.password if parts.password else ''}@{netloc}"
        return urlunsplit(parts._replace(netloc=netloc))
    if setting.endswith("_URL"):
        return f"http://{host}:{port}"
    return f"{host}:{port}"


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` on top, as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def downstreams_of(job_types: Sequence[JobType]) -> list[Downstream]:
    seen: dict[str, Downstream] = {}
    for jt in job_types:
        for d in jt.calls.clients:
            seen.setdefault(d.name, d)
    return list(seen.values())


class Sandboxes:
    """The stand-ins of the job types' downstreams on free ports, and the environment that
    points clients (the workers', the checker's) at them."""

    def __init__(self, job_types: Sequence[JobType], state: Path) -> None:
        self.job_types = tuple(job_types)
        self.state = state
        self.env: dict[str, str] = {}
        self.running: list[Stoppable] = []
        self.stand_ins: dict[str, Stoppable] = {}  # by downstream: what its record reads

    def start(self) -> Sandboxes:
        for d in downstreams_of(self.job_types):
            box = d.sandbox
            assert box is not None  # job_types_of refused a downstream without one
            host, _, setting = box.address(Settings.from_env())
            port = free_port()
            value = moved(setting, self.env.get(setting) or os.environ.get(setting), host, port)
            self.env[setting] = value
            self.env.update(box.environment(self.state))
            allowed = self.env.get(ALLOW_ENV, os.environ.get(ALLOW_ENV, ""))
            self.env[ALLOW_ENV] = allow_list([f"{host}:{port}"], {ALLOW_ENV: allowed})
            with environment(self.env):
                self.stand_ins[d.name] = box.start(Settings.from_env(), self.state)
            self.running.append(self.stand_ins[d.name])
        return self

    def settings(self) -> Settings:
        with environment(self.env):
            return Settings.from_env()

    def clients(self) -> dict[str, Any]:
        """One plain client per downstream (no rate, no fault points): the checker's."""
        settings = self.settings()
        with environment(self.env):  # a client may read a setting of its own when built
            return {d.name: d.build(settings, ClientOptions())
                    for d in downstreams_of(self.job_types)}

    def stop(self) -> None:
        for box in self.running:
            with contextlib.suppress(Exception):
                box.stop()
        self.running = []


def effect_counter(job_types: Sequence[JobType], clients: Mapping[str, Any]
                   ) -> Callable[[str, dict[str, Any]], int]:
    """``count(job_type, payload)``: the effects the downstream holds for the payload's
    intent, asked through the job type's lookup hook (0 for a payload it refuses)."""

    def client(name: str) -> Any:
        return clients[name]

    def count(job_type: str, payload: dict[str, Any]) -> int:
        jt = get_job_type(job_type)
        try:
            clean = jt.validate(dict(payload))
        except ValidationError:
            return 0
        return len(jt.effects(client, jt.keying.key_for(clean), clean))

    return count
