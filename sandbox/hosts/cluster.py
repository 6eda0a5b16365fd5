"""sekali deployed as Dagster runs it in production, on hosts made of network namespaces.

::

    root namespace (the machine) ── bridge sk<id>-br  10.77.N.1/24
        ├── store     10.77.N.10  private PostgreSQL (databases sekali, dagster) + Redis
        ├── control   10.77.N.11  dagster-webserver :3000 + dagster-daemon  (DAGSTER_HOME here)
        ├── provider  10.77.N.12  sandbox payment gateway :8765 + mail sink :8025
        └── w1..wN    10.77.N.21+ gRPC code server :4000, one code location each (sekali_wK)

``DefaultRunLauncher`` starts every run through the gRPC code server of the run's location,
so the run worker process is a child of that code server, on that worker host. One code
location per worker host is the only way to put run workers on several hosts without another
launcher (a location has exactly one server); the intake sensor runs on every location as a
competing consumer, and the once-per-deployment instigators run on the first location only
(:data:`~sandbox.hosts.services.SECONDARY_STOPPED_SENSORS`).

Everything the cluster creates is written to ``<state>/state.json`` *before* it is created, so
``down`` undoes a half-built ``up`` as well as a whole one, and may be run any number of times.
The chaos harness drives the same object: :meth:`Cluster.exec_in`, :meth:`Cluster.partition`,
:meth:`Cluster.heal`, :meth:`Cluster.kill`, :meth:`Cluster.stop`, :meth:`Cluster.cont`,
:meth:`Cluster.start`, :meth:`Cluster.kill_host`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import ipaddress
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import redis
import yaml

from resources.egress import ALLOW_ENV, allow_list
from resources.storage.db import Database
from resources.storage.files import write_private
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from resources.storage.settings import state_dir as sekali_state_dir
from resources.telemetry.redact import hide_url_password
from sandbox.hosts import cgroups, network, processes
from sandbox.hosts.network import ClusterError, Partition
from sandbox.hosts.processes import ProcessRecord, Reveal
from sandbox.hosts.services import (
    PORTS,
    PRODUCTION_INSTANCE,
    ROOT,
    SECONDARY_STOPPED_SCHEDULES,
    SECONDARY_STOPPED_SENSORS,
    GraphQL,
    http_ok,
    postgres_bin,
    postgres_ok,
    redis_ok,
    render,
    smtp_ok,
    tcp_open,
    workspace_yaml,
)
from sandbox.postgres_server import scram_verifier
from sandbox.redis_server import admin_names, rename_lines, run_admin

log = logging.getLogger(__name__)

BIN = Path(sys.executable).parent
LOCK_DIR = Path("/run/lock")
"""Two ``up`` runs pick their subnets under an flock of this directory (no lock file to leave)."""
STATE_FILE = "state.json"
POSTGRES_USER = "postgres"  # the OS user the private PostgreSQL runs as (initdb refuses root)
UI_USER = "operator"
"""The user of the writable UI's login (its password: ``state.json``'s secret ``ui``)."""
SERVICE_USER = "sekali"
"""The system user every other service of the cluster runs as (created by ``up`` if missing):
root only builds the namespaces, links and rules."""
FOLDER_MODE = 0o700
REQUIRED_TOOLS = ("ip", "iptables", "unshare", "setpriv", "runuser")


_SECRET_NAMES = ("PASSWORD", "SECRET", "TOKEN", "KEY")


def _without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` fit for output: URL passwords masked, values of secret-named variables hidden."""
    return {name: "***" if any(word in name.upper() for word in _SECRET_NAMES)
            else hide_url_password(value) for name, value in env.items()}


def _check_trusted(path: Path, info: os.stat_result) -> None:
    """``path`` is owned by this user and nobody else may write it."""
    if info.st_uid != os.geteuid():
        raise ClusterError(
            f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()}): not "
            "trusting the pids and links it names; remove it or chown it after checking it"
        )
    if info.st_mode & 0o022:
        raise ClusterError(
            f"{path} can be written by others (mode {info.st_mode & 0o777:o}): not trusting "
            "it; chmod go-w after checking it"
        )


def ensure_service_user(name: str = SERVICE_USER) -> pwd.struct_passwd:
    """The system user ``name``, created (no home, no login shell, a group of its own) if this
    machine has none; two ``up`` runs creating it at once both get it."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    done = network.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
                       check=False)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise ClusterError(f"could not create the system user {name!r} the cluster's services "
                           f"run as: {(done.stderr or done.stdout).strip()}") from None


def _searchable(info: os.stat_result, user: pwd.struct_passwd) -> bool:
    if info.st_uid == user.pw_uid:
        return bool(info.st_mode & 0o100)
    if info.st_gid == user.pw_gid:
        return bool(info.st_mode & 0o010)
    return bool(info.st_mode & 0o001)


def plan_reveal(paths: Sequence[Path], user: pwd.struct_passwd, holder: Path) -> Reveal:
    """What must be mounted for ``user`` to reach ``paths`` (the interpreter, the virtualenv,
    the code): for each, the first folder on its way that ``user`` may not search and the name
    under it. Raises :class:`ClusterError` when a second folder further down blocks it too."""
    folders: dict[str, list[str]] = {}
    for path in paths:
        current = Path(path.anchor)
        blocked = False
        for name in path.parts[1:]:
            if not _searchable(current.stat(), user):
                if blocked:
                    raise ClusterError(
                        f"user {user.pw_name} cannot reach {path}: {current} is not searchable "
                        f"by it (nor is a folder above); make {current} world-searchable or "
                        "install Python and sekali where every user can read them")
                names = folders.setdefault(str(current), [])
                if name not in names:
                    names.append(name)
                blocked = True
            current = current / name
    return Reveal(folders, str(holder))


def _own(path: Path, user: pwd.struct_passwd, *, tree: bool = False) -> None:
    """``path`` (a folder, created if missing) owned by ``user`` and 0700; with ``tree`` all
    that is in it too."""
    path.mkdir(parents=True, exist_ok=True)
    targets = [path]
    if tree:
        for folder, dirs, files in os.walk(path):
            targets += [Path(folder, name) for name in dirs + files]
    for target in targets:
        os.lchown(target, user.pw_uid, user.pw_gid)
    os.chmod(path, FOLDER_MODE)


class NotRoot(ClusterError):
    """Network namespaces, veth pairs and bridges need root."""


def default_state_dir() -> Path:
    return sekali_state_dir() / "cluster"


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRoot("needs root (network namespaces, veth pairs and a bridge)")


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with one address on the bridge."""

    name: str
    role: str  # store | control | provider | worker
    address: str
    namespace: str
    veth: str
    hostname: str
    location: str | None = None  # the code location a worker host serves

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Host:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def plan_hosts(cluster_id: str, subnet: ipaddress.IPv4Network, workers: int) -> list[Host]:
    """Store .10, control .11, provider .12, workers .21 on."""
    if not 1 <= workers <= 200:
        raise ClusterError(f"--workers: expected 1..200, got {workers}")
    base = subnet.network_address

    def host(name: str, role: str, offset: int, short: str, location: str | None = None) -> Host:
        return Host(
            name=name,
            role=role,
            address=str(base + offset),
            namespace=f"sekali-{cluster_id}-{name}",
            veth=f"sk{cluster_id}-{short}",
            hostname=f"sekali-{name}",
            location=location,
        )

    hosts = [
        host("store", "store", 10, "st"),
        host("control", "control", 11, "ct"),
        host("provider", "provider", 12, "pv"),
    ]
    hosts += [
        host(f"w{i}", "worker", 20 + i, f"w{i}", location=f"sekali_w{i}")
        for i in range(1, workers + 1)
    ]
    return hosts


class Cluster:
    """A cluster recorded under ``state_dir`` (built by :meth:`up`, removed by :meth:`down`)."""

    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.cluster_id = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:5]
        self.state: dict[str, Any] = self._read_state()

    # -- state ---------------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    def _read_state(self) -> dict[str, Any]:
        """The recorded state, after checking nobody else could have written it: root acts on
        the pids, links, namespaces and firewall rules it names, so a state file (or folder)
        another user owns or can write would let that user make root signal or delete what
        they choose. Refused with :class:`ClusterError` naming the path and the fix."""
        try:
            fd = os.open(self.state_file, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as exc:  # ELOOP: a symbolic link put in its place
            raise ClusterError(f"{self.state_file}: not a regular file ({exc.strerror})") from exc
        with os.fdopen(fd) as fh:
            _check_trusted(self.state_dir, os.stat(self.state_dir))
            _check_trusted(self.state_file, os.fstat(fh.fileno()))
            data: dict[str, Any] = json.loads(fh.read())
            return data

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.state, fh, indent=2, sort_keys=True)
        os.replace(tmp, self.state_file)

    @property
    def exists(self) -> bool:
        return bool(self.state)

    @property
    def phase(self) -> str:
        return str(self.state.get("phase", "absent"))

    @property
    def hosts(self) -> list[Host]:
        return [Host.from_json(h) for h in self.state.get("hosts", [])]

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "worker"]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ClusterError(f"no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def _role(self, role: str) -> Host:
        return next(h for h in self.hosts if h.role == role)

    @property
    def processes(self) -> list[ProcessRecord]:
        return [ProcessRecord.from_json(p) for p in self.state.get("processes", [])]

    def process(self, host: str, name: str) -> ProcessRecord:
        for record in self.processes:
            if record.host == host and record.name == name:
                return record
        names = [f"{p.host}/{p.name}" for p in self.processes]
        raise ClusterError(f"no process {host}/{name} (processes: {', '.join(names)})")

    def _put_process(self, record: ProcessRecord) -> None:
        others = [
            p for p in self.state.get("processes", [])
            if not (p["host"] == record.host and p["name"] == record.name)
        ]
        self.state["processes"] = [*others, record.to_json()]
        self._save()

    def _path(self, *parts: str) -> Path:
        return self.state_dir.joinpath(*parts)

    # -- addresses and the environment every process gets ---------------------------------------

    def _secret(self, name: str) -> str:
        return str(self.state["secrets"][name])

    @property
    def database_url(self) -> str:
        """sekali's app store, as every host reaches it."""
        store = self._role("store").address
        return (f"postgresql+psycopg://sekali:{quote(self._secret('sekali'))}"
                f"@{store}:{PORTS['postgres']}/sekali")

    @property
    def dagster_pg_url(self) -> str:
        store = self._role("store").address
        return (f"postgresql+psycopg2://dagster:{quote(self._secret('dagster'))}"
                f"@{store}:{PORTS['postgres']}/dagster")

    def admin_conninfo(self, database: str = "postgres") -> str:
        """libpq conninfo of the private server's superuser (for measurements and tests)."""
        store = self._role("store").address
        return (f"host={store} port={PORTS['postgres']} user=postgres "
                f"password={self._secret('postgres')} dbname={database}")

    @property
    def redis_url(self) -> str:
        store = self._role("store").address
        return f"redis://:{quote(self._secret('redis'))}@{store}:{PORTS['redis']}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://{self._role('provider').address}:{PORTS['gateway']}"

    @property
    def ui_url(self) -> str:
        """The writable UI, behind ``sekali ui-proxy`` (login: :attr:`ui_login`)."""
        return f"http://{self._role('control').address}:{PORTS['webserver']}"

    @property
    def ui_readonly_url(self) -> str:
        """The read-only UI for viewers (``dagster-webserver --read-only``)."""
        return f"http://{self._role('control').address}:{PORTS['webserver_readonly']}"

    @property
    def ui_login(self) -> tuple[str, str]:
        """The writable UI's user and password (kept in ``state.json``, root's, 0600)."""
        return UI_USER, self._secret("ui")

    @property
    def dagster_home(self) -> Path:
        return self._path("control", "dagster_home")

    @property
    def workspace_file(self) -> Path:
        return self._path("control", "workspace.yaml")

    def graphql(self) -> GraphQL:
        return GraphQL(self.ui_url, auth=self.ui_login)

    def env(
        self, host: str | None = None, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The environment of a process on ``host`` (or of a client on the machine): every
        address points at the cluster's hosts, nothing is inherited from the caller's sekali
        settings."""
        provider = self._role("provider").address
        env = {
            "PATH": f"{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "SEKALI_GATEWAY_URL": self.gateway_url,
            ALLOW_ENV: allow_list([self.gateway_url], {}),
            "SEKALI_SMTP_HOST": provider,
            "SEKALI_SMTP_PORT": str(PORTS["smtp"]),
            "DAGSTER_HOME": str(self.dagster_home),
            "DAGSTER_PG_URL": self.dagster_pg_url,
            "SEKALI_STATE_DIR": str(self._path("hosts", host or "client")),
        }
        if host is not None:
            env["SEKALI_CLUSTER_HOST"] = host
            if self.host(host).role == "worker":
                env.update(self.state.get("worker_env", {}))
        env.update(extra or {})
        return env

    # -- up --------------------------------------------------------------------------------------

    def up(
        self,
        workers: int = 2,
        *,
        worker_env: Mapping[str, str] | None = None,
        subnet: str | None = None,
        timeout: float = 300.0,
        instance_overrides: Mapping[str, Any] | None = None,
        progress: Callable[[str], None] = lambda _msg: None,
    ) -> None:
        """Build the hosts, start every process and wait (at most ``timeout`` s) until the UI
        answers, every location is loaded and the daemon is healthy.

        ``instance_overrides`` is merged into the copy of ``deploy/production/dagster.yaml``
        (e.g. ``{"run_coordinator": {"config": {"dequeue_use_threads": True}}}``): for
        measuring a setting before proposing it there."""
        require_root()
        missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
        if missing:
            raise ClusterError(f"missing tools: {', '.join(missing)} (.ci/run installs them)")
        if self.exists:
            raise ClusterError(
                f"a cluster is already recorded in {self.state_dir} (phase {self.phase}): "
                f"run `sekali cluster down --state {self.state_dir}` first"
            )
        leftovers = network.list_netns(f"sekali-{self.cluster_id}-")
        if leftovers:
            raise ClusterError(f"namespaces of this state folder exist without a state file: "
                               f"{', '.join(leftovers)}; `sekali cluster down` removes them")
        deadline = time.monotonic() + timeout
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)  # nosec B103: user postgres traverses to its data, lists nothing
        self._check_postgres_can_reach_state()
        user = ensure_service_user()
        holder = self._path("mnt")
        reveal = plan_reveal([Path(sys.executable), Path(sys.executable).resolve(),
                              Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), ROOT],
                             user, holder)
        self.state = {
            "version": 1,
            "cluster_id": self.cluster_id,
            "phase": "building",
            "created_at": time.time(),
            "secrets": {k: secrets.token_hex(16) for k in ("postgres", "sekali", "dagster",
                                                           "redis", "ui")},
            "redis_admin": admin_names(),
            "service_user": user.pw_name,
            "reveal": {"folders": dict(reveal.folders), "holder": reveal.holder},
            "worker_env": dict(worker_env or {}),
            "instance_overrides": dict(instance_overrides or {}),
            "processes": [],
            "partitions": [],
            "root_rules": [],
            "namespaces": [],
            "links": [],
        }
        self._save()
        self._build_network(workers, subnet, progress)
        self._prepare_folders(user)
        self._start_store(deadline, progress)
        self._start_provider(deadline, progress)
        self._prepare_storage(progress)
        _own(self._path("control"), user, tree=True)
        self._start_workers(deadline, progress)
        self._start_control(deadline, progress)
        self.state["phase"] = "up"
        self._save()
        progress(f"up: Dagster UI at {self.ui_url}")

    @property
    def service_user(self) -> str:
        return str(self.state.get("service_user", SERVICE_USER))

    def _reveal(self) -> Reveal | None:
        data = self.state.get("reveal")
        return Reveal(data["folders"], data["holder"]) if data else None

    def _prepare_folders(self, user: pwd.struct_passwd) -> None:
        """Root keeps the state file, the logs and the mount holder; each service's folder is
        its user's alone (0700); the folders between are searchable, not listable."""
        for folder, mode in (("logs", 0o700), ("mnt", 0o700), ("store", 0o711), ("hosts", 0o711)):
            self._path(folder).mkdir(parents=True, exist_ok=True)
            os.chmod(self._path(folder), mode)  # nosec B103: 0711: the service users traverse
        for h in self.hosts:
            _own(self._path("hosts", h.name), user)
        _own(self._path("provider"), user)
        _own(self._path("store", "redis"), user)

    def _check_postgres_can_reach_state(self) -> None:
        probe = network.run(
            ["runuser", "-u", POSTGRES_USER, "--", "test", "-x", str(self.state_dir)], check=False
        )
        if probe.returncode != 0:
            raise ClusterError(
                f"user {POSTGRES_USER} cannot reach {self.state_dir} (a parent folder is not "
                "world-searchable); choose --state under a folder it can traverse"
            )

    def _build_network(
        self, workers: int, subnet: str | None, progress: Callable[[str], None]
    ) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        lock = os.open(LOCK_DIR, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two `up`s never pick the same subnet
            if subnet:
                net = ipaddress.IPv4Network(subnet)
                if net.prefixlen != 24:
                    raise ClusterError(f"--subnet: expected a /24, got {subnet}")
                if network.subnet_in_use(net):
                    raise ClusterError(f"--subnet {subnet} overlaps a route of this machine")
            else:
                net = network.pick_subnet(int(self.cluster_id, 16))
            hosts = plan_hosts(self.cluster_id, net, workers)
            bridge = f"sk{self.cluster_id}-br"
            self.state.update(
                subnet=str(net), bridge=bridge, gateway=str(net.network_address + 1),
                hosts=[asdict(h) for h in hosts],
            )
            self.state["links"].append(bridge)
            self._save()
            network.create_bridge(bridge, self.state["gateway"], net.prefixlen)
        finally:
            os.close(lock)  # releases the flock
        progress(f"network: bridge {bridge} {net}")
        root = cgroups.hierarchy()
        for h in hosts:
            self.state["namespaces"].append(h.namespace)
            self.state["links"].append(h.veth)
            if root is not None:
                self.state.setdefault("cgroups", {})[h.name] = str(root / h.namespace)
            self._save()
            network.create_namespace(h.namespace)
            network.attach_host(h.namespace, h.veth, bridge, h.address, net.prefixlen)
            if root is not None and cgroups.create(h.namespace) is None:
                del self.state["cgroups"][h.name]  # not allowed here: no CPU meter, no harm
                self._save()
        policy = network.forward_policy()
        if policy is not None and policy != "ACCEPT":
            rule = network.bridge_accept_rule(bridge)
            self.state["root_rules"].append(rule)
            self._save()
            network.add_root_rule(rule)
        progress("hosts: " + ", ".join(f"{h.name} {h.address}" for h in hosts))

    def _spawn(
        self,
        host: str,
        name: str,
        argv: Sequence[str],
        *,
        user: str | None = None,
        stop_signal: int = signal.SIGTERM,
        extra_env: Mapping[str, str] | None = None,
    ) -> ProcessRecord:
        h = self.host(host)
        record = ProcessRecord(
            host=host,
            name=name,
            argv=list(argv),
            log=str(self._path("logs", f"{host}-{name}.log")),
            user=user,
            stop_signal=int(stop_signal),
            extra_env=dict(extra_env or {}),
        )
        self._put_process(record)  # recorded (pid 0) before it exists: down still looks
        env = self.env(host, record.extra_env)
        if user == self.service_user:
            env["HOME"] = str(self._path("hosts", host))
        processes.spawn(
            record, namespace=h.namespace, hostname=h.hostname,
            env=env, cwd=ROOT, cgroup=self._cgroup(host), reveal=self._reveal(),
        )
        self._put_process(record)
        return record

    def _cgroup(self, host: str) -> str | None:
        group = self.state.get("cgroups", {}).get(host)
        return str(group) if group else None

    def _wait(self, what: str, probe: Callable[[], bool], deadline: float,
              record: ProcessRecord | None = None) -> None:
        while time.monotonic() < deadline:
            if probe():
                return
            if record is not None and not processes.is_alive(record):
                raise ClusterError(f"{what}: {record.host}/{record.name} exited; "
                                   f"log: {record.log}\n{_tail(record.log)}")
            time.sleep(0.5)
        tail = f"\n{_tail(record.log)}" if record is not None else ""
        raise ClusterError(f"timed out waiting for {what}{tail}")

    def _start_store(self, deadline: float, progress: Callable[[str], None]) -> None:
        store = self._role("store")
        pg_bin = postgres_bin()
        self.state["postgres_bin"] = str(pg_bin)
        pgdata = self._path("store", "pgdata")
        pgdata.mkdir(parents=True, exist_ok=True)
        shutil.chown(pgdata, POSTGRES_USER, POSTGRES_USER)
        os.chmod(pgdata, 0o700)
        pwfile = self._path("store", "pwfile")
        pwfile.write_text(self._secret("postgres") + "\n")
        shutil.chown(pwfile, POSTGRES_USER, POSTGRES_USER)
        os.chmod(pwfile, 0o600)
        try:
            network.run(
                ["runuser", "-u", POSTGRES_USER, "--", str(pg_bin / "initdb"), "-D", str(pgdata),
                 "-U", "postgres", "--pwfile", str(pwfile), "--auth-local=trust",
                 "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                 "--no-instructions"],
                timeout=120,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        with open(pgdata / "postgresql.conf", "a") as conf:
            conf.write("\n" + render("postgresql.conf", listen=f"127.0.0.1,{store.address}",
                                     port=PORTS["postgres"]))
        (pgdata / "pg_hba.conf").write_text(render("pg_hba.conf", subnet=self.state["subnet"]))
        postgres = self._spawn(
            "store", "postgres", [str(pg_bin / "postgres"), "-D", str(pgdata)],
            user=POSTGRES_USER, stop_signal=signal.SIGINT,  # SIGINT: fast shutdown
        )
        self._wait("PostgreSQL on the store host",
                   lambda: postgres_ok(self.admin_conninfo()), deadline, postgres)
        with psycopg.connect(self.admin_conninfo(), autocommit=True) as conn:
            for role in ("sekali", "dagster"):
                verifier = scram_verifier(self._secret(role))  # no password text on the wire
                conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{verifier}'")
                conn.execute(f"CREATE DATABASE {role} OWNER {role}")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        progress(f"store: PostgreSQL {pg_bin.parent.name} on {store.address}:{PORTS['postgres']}")

        redis_dir = self._path("store", "redis")
        conf_path = redis_dir / "redis.conf"
        fd = os.open(conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(render("redis.conf", address=store.address, port=PORTS["redis"],
                            password=self._secret("redis"), dir=redis_dir,
                            rename_commands="\n".join(rename_lines(self.state["redis_admin"]))))
        shutil.chown(conf_path, self.service_user, self.service_user)
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError("no redis-server binary (apt-get install redis-server)")
        redis = self._spawn("store", "redis", [binary, str(conf_path)], user=self.service_user)
        self._wait("Redis on the store host", lambda: redis_ok(self.redis_url), deadline, redis)
        progress(f"store: Redis on {store.address}:{PORTS['redis']}")

    def _start_provider(self, deadline: float, progress: Callable[[str], None]) -> None:
        provider = self._role("provider")
        folder = self._path("provider")
        gateway = self._spawn(
            "provider", "gateway",
            [sys.executable, "-m", "sandbox.gateway", "--host", provider.address,
             "--port", str(PORTS["gateway"]), "--db-url", f"sqlite:///{folder / 'gateway.db'}"],
            user=self.service_user,
        )
        sink = self._spawn(
            "provider", "mailsink",
            [sys.executable, "-m", "sandbox.mailsink", "--host", provider.address,
             "--port", str(PORTS["smtp"]), "--db-url", f"sqlite:///{folder / 'mailsink.db'}"],
            user=self.service_user,
        )
        self._wait("the sandbox gateway",
                   lambda: http_ok(f"{self.gateway_url}/healthz"), deadline, gateway)
        self._wait("the mail sink", lambda: smtp_ok(provider.address, PORTS["smtp"]),
                   deadline, sink)
        progress(f"provider: gateway {self.gateway_url}, SMTP {provider.address}:{PORTS['smtp']}")

    def _prepare_storage(self, progress: Callable[[str], None]) -> None:
        database = Database.from_url(self.database_url)
        try:
            applied = upgrade(database)
        finally:
            database.dispose()
        progress(f"schema: {len(applied)} migrations applied to the app database")
        # sekali's own command prepares the home (the profile's dagster.yaml, the storage
        # initialised once before anything starts in parallel); the hosts only run it
        subprocess.run(
            [sys.executable, "-m", "pipelines.instance", str(self.dagster_home),
             "--profile", "production"],
            env={**os.environ, "DAGSTER_PG_URL": self.dagster_pg_url}, cwd=ROOT, check=True,
            stdout=subprocess.DEVNULL, timeout=300,
        )
        overrides = self.state.get("instance_overrides") or {}
        if overrides:
            target = self.dagster_home / "dagster.yaml"
            merged = _merge(yaml.safe_load(target.read_text()), overrides)
            header = (f"# {PRODUCTION_INSTANCE.relative_to(ROOT)} with sekali cluster up's "
                      f"overrides: {json.dumps(overrides, sort_keys=True)}\n")
            target.write_text(header + yaml.safe_dump(merged, sort_keys=False))
        progress(f"dagster home: {self.dagster_home} ({PRODUCTION_INSTANCE.relative_to(ROOT)}"
                 f"{', overrides ' + json.dumps(overrides) if overrides else ''})")
        self.workspace_file.write_text(workspace_yaml(
            [(h.location or h.name, h.address, PORTS["code_server"]) for h in self.workers]
        ))

    def _code_server_argv(self, worker: Host) -> list[str]:
        return [str(BIN / "dagster"), "api", "grpc", "-m", "pipelines.definitions",
                "-h", worker.address, "-p", str(PORTS["code_server"]),
                "--location-name", worker.location or worker.name,
                "--use-python-environment-entry-point"]

    def _start_workers(self, deadline: float, progress: Callable[[str], None]) -> None:
        started = [
            (w, self._spawn(w.name, "code_server", self._code_server_argv(w),
                            user=self.service_user))
            for w in self.workers
        ]
        for worker, record in started:
            self._wait(f"the code server on {worker.name}",
                       functools.partial(tcp_open, worker.address, PORTS["code_server"]),
                       deadline, record)
        progress("workers: " + ", ".join(
            f"{w.name} {w.address}:{PORTS['code_server']} ({w.location})" for w in self.workers))

    def _start_control(self, deadline: float, progress: Callable[[str], None]) -> None:
        """The writable webserver on the control host's loopback, reached only through
        ``sekali ui-proxy`` (basic authentication) on the host's address; a read-only
        webserver beside it for viewers."""
        address = self._role("control").address
        users = self._path("control", "ui-users")
        write_private(users, f"{UI_USER}:{self._secret('ui')}\n")
        shutil.chown(users, self.service_user, self.service_user)
        webserver = self._spawn(
            "control", "webserver",
            [str(BIN / "dagster-webserver"), "-h", "127.0.0.1",
             "-p", str(PORTS["webserver_inner"]), "-w", str(self.workspace_file)],
            user=self.service_user,
        )
        proxy = self._spawn(
            "control", "ui_proxy",
            [sys.executable, "-m", "cli.main", "ui-proxy", "--listen",
             f"{address}:{PORTS['webserver']}", "--upstream",
             f"http://127.0.0.1:{PORTS['webserver_inner']}", "--users-file", str(users)],
            user=self.service_user,
        )
        readonly = self._spawn(
            "control", "webserver_readonly",
            [str(BIN / "dagster-webserver"), "-h", address, "-p",
             str(PORTS["webserver_readonly"]), "--read-only", "-w", str(self.workspace_file)],
            user=self.service_user,
        )
        self._wait("the Dagster webserver behind the UI proxy",
                   lambda: http_ok(f"{self.ui_url}/server_info"), deadline, webserver)
        self._wait("the UI proxy", lambda: http_ok(f"{self.ui_url}/server_info"), deadline,
                   proxy)
        self._wait("the read-only Dagster webserver",
                   lambda: http_ok(f"{self.ui_readonly_url}/server_info"), deadline, readonly)
        self._wait("every code location to load", self._locations_loaded, deadline, webserver)
        self._stop_singletons_on_secondaries()
        daemon = self._spawn(
            "control", "daemon",
            [str(BIN / "dagster-daemon"), "run", "-w", str(self.workspace_file)],
            user=self.service_user,
        )
        self._wait("the Dagster daemon to report healthy", self._daemon_healthy, deadline, daemon)
        progress(f"control: webserver {self.ui_url} (login {UI_USER}, password in "
                 f"{self.state_dir / STATE_FILE}), read-only {self.ui_readonly_url}, daemon "
                 "healthy")

    def _locations_loaded(self) -> bool:
        try:
            loaded = self.graphql().locations()
        except ClusterError:
            return False
        wanted = {w.location for w in self.workers}
        return wanted <= {k for k, v in loaded.items() if v == "RepositoryLocation"}

    def _daemon_healthy(self) -> bool:
        try:
            daemons = self.graphql().daemons()
        except ClusterError:
            return False
        return bool(daemons) and all(daemons.values())

    def _stop_singletons_on_secondaries(self) -> None:
        """Stop the once-per-deployment sensors and schedules on every location but the first,
        before the daemon starts (so they never tick there)."""
        gql = self.graphql()
        for worker in self.workers[1:]:
            assert worker.location is not None
            states = gql.instigators(worker.location)
            wanted = [f"sensor:{n}" for n in SECONDARY_STOPPED_SENSORS]
            wanted += [f"schedule:{n}" for n in SECONDARY_STOPPED_SCHEDULES]
            for key in wanted:
                if key in states and states[key][1] == "RUNNING":
                    gql.stop_instigator(key.split(":", 1)[0], states[key][0])

    # -- down ------------------------------------------------------------------------------------

    def down(self, *, purge: bool = False, progress: Callable[[str], None] = lambda _m: None) -> (
        dict[str, list[str]]
    ):
        """End every process, delete every namespace, link and rule the cluster made (recorded
        in the state file, and anything named with this cluster's id besides); idempotent.
        Returns what was removed. Raises :class:`ClusterError` if something would not go."""
        require_root()
        removed: dict[str, list[str]] = {"processes": [], "namespaces": [], "links": [],
                                         "rules": [], "cgroups": []}
        records = self.processes
        # control first (no new runs), then workers, provider, store: reverse start order
        for record in reversed(records):
            if processes.is_alive(record):
                removed["processes"].append(f"{record.host}/{record.name} pid {record.pid}")
        stubborn = processes.end(list(reversed(records)))
        namespaces = sorted(set(self.state.get("namespaces", []))
                            | set(network.list_netns(f"sekali-{self.cluster_id}-")))
        for ns in namespaces:  # run workers, harness processes: anything left in our hosts
            pids = network.namespace_pids(ns)
            if pids:
                removed["processes"] += [f"{ns} pid {p}" for p in pids]
                stubborn_pids = processes.kill_pids(pids)
                if stubborn_pids:
                    raise ClusterError(f"processes in {ns} would not die: {stubborn_pids}")
        if stubborn:
            raise ClusterError("processes would not die: "
                               + ", ".join(f"{r.host}/{r.name} {r.pid}" for r in stubborn))
        for rule in self.state.get("root_rules", []):
            network.delete_root_rule(rule)
            removed["rules"].append(" ".join(rule))
        for ns in namespaces:
            if network.netns_exists(ns):
                network.delete_namespace(ns)
                removed["namespaces"].append(ns)
        links = sorted(set(self.state.get("links", []))
                       | set(network.list_links(f"sk{self.cluster_id}-")))
        for link in links:
            if network.link_exists(link):
                network.delete_link(link)
                removed["links"].append(link)
        processes.reap()
        for group in sorted(set(self.state.get("cgroups", {}).values()) | set(self._cgroup_dirs())):
            if cgroups.remove(group):
                removed["cgroups"].append(group)
        left = self.leftovers()
        if any(left.values()):
            raise ClusterError(f"still present after down: {left}")
        for folder in ("store", "control", "provider", "hosts", "mnt"):
            shutil.rmtree(self._path(folder), ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        self.state = {}
        if purge:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        progress("down: " + "; ".join(f"{k}: {len(v)}" for k, v in removed.items()))
        return removed

    def leftovers(self) -> dict[str, list[str]]:
        """Namespaces, links and live processes of this cluster that exist now."""
        return {
            "namespaces": network.list_netns(f"sekali-{self.cluster_id}-"),
            "links": network.list_links(f"sk{self.cluster_id}-"),
            "processes": [f"{r.host}/{r.name} {r.pid}" for r in self.processes
                          if processes.is_alive(r)],
            "cgroups": self._cgroup_dirs(),
        }

    def _cgroup_dirs(self) -> list[str]:
        root = cgroups.hierarchy()
        if root is None:
            return []
        return sorted(str(p) for p in root.glob(f"sekali-{self.cluster_id}-*") if p.is_dir())

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Hosts, addresses, processes and health, as data (``sekali cluster status --json``)."""
        require_root()
        if not self.exists:
            return {"state_dir": str(self.state_dir), "phase": "absent", "hosts": [],
                    "leftovers": self.leftovers()}
        bridge = str(self.state.get("bridge", ""))
        # no bridge, no route: a probe would follow the default route off the machine
        health = self._health() if bridge and network.link_exists(bridge) else {}
        cpu = self.cpu_seconds()
        hosts = []
        for h in self.hosts:
            procs = [
                {"name": p.name, "pid": p.pid, "alive": processes.is_alive(p), "log": p.log}
                for p in self.processes if p.host == h.name
            ]
            hosts.append({
                **asdict(h),
                "namespace_exists": network.netns_exists(h.namespace),
                "processes": procs,
                "health": health.get(h.name, {}),
                "pids_in_namespace": len(network.namespace_pids(h.namespace)),
                "cpu_seconds": round(cpu[h.name], 2) if h.name in cpu else None,
            })
        healthy = bool(health) and all(
            all(v == "ok" for v in x["health"].values()) for x in hosts
        ) and all(p["alive"] for x in hosts for p in x["processes"])
        return {
            "state_dir": str(self.state_dir),
            "phase": self.phase,
            "healthy": healthy,
            "subnet": self.state.get("subnet"),
            "bridge": self.state.get("bridge"),
            "ui_url": self.ui_url,
            "ui_readonly_url": self.ui_readonly_url,
            "hosts": hosts,
            "partitions": self.state.get("partitions", []),
            "worker_env": _without_secrets(self.state.get("worker_env", {})),
            "env": _without_secrets(self.env()),
        }

    def _health(self) -> dict[str, dict[str, str]]:
        def word(ok: bool) -> str:
            return "ok" if ok else "down"

        provider = self._role("provider")
        out: dict[str, dict[str, str]] = {
            "store": {
                "postgres": word(postgres_ok(self.admin_conninfo())),
                "redis": word(redis_ok(self.redis_url)),
            },
            "provider": {
                "gateway": word(http_ok(f"{self.gateway_url}/healthz")),
                "smtp": word(smtp_ok(provider.address, PORTS["smtp"])),
            },
            "control": {"webserver": word(http_ok(f"{self.ui_url}/server_info")),
                        "webserver_readonly": word(http_ok(
                            f"{self.ui_readonly_url}/server_info"))},
        }
        locations: dict[str, str] = {}
        if out["control"]["webserver"] == "ok":
            try:
                locations = self.graphql().locations()
                daemons = self.graphql().daemons()
                out["control"]["daemon"] = word(bool(daemons) and all(daemons.values()))
            except ClusterError as exc:
                out["control"]["daemon"] = f"unknown: {exc}"
        for w in self.workers:
            loc = locations.get(w.location or "", "not loaded")
            out[w.name] = {
                "code_server": word(tcp_open(w.address, PORTS["code_server"])),
                "location": "ok" if loc == "RepositoryLocation" else loc,
            }
        return out

    # -- the harness's API -----------------------------------------------------------------------

    def exec_in(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
        check: bool = False,
        user: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` (its namespace and hostname) and wait; output captured.
        ``env`` is added to the host's environment."""
        h = self.host(host)
        argv_ns = processes.namespace_argv(h.namespace, h.hostname, argv, user, self._reveal())
        with subprocess.Popen(argv_ns, env=self.env(host, env), cwd=ROOT, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as child:
            cgroups.add(self._cgroup(host), child.pid)
            try:
                out, err = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise
        done = subprocess.CompletedProcess(argv_ns, child.returncode, out, err)
        if check and done.returncode != 0:
            raise network.CommandError(argv, done.returncode, done.stderr or done.stdout)
        return done

    def pids(self, host: str) -> list[int]:
        """Every process on ``host`` now (recorded ones, run workers, anything started there)."""
        return network.namespace_pids(self.host(host).namespace)

    def kill(self, host: str, process: str, sig: int = signal.SIGKILL, *,
             children: bool = False) -> bool:
        """Send ``sig`` (SIGKILL) to a recorded process; with ``children`` to its whole process
        group (a code server and the run workers it started). PostgreSQL always takes its
        backends with it. False if it was not running."""
        record = self.process(host, process)
        return processes.send(record, sig, group=children or process == "postgres")

    def stop(self, host: str, process: str, *, children: bool = False) -> bool:
        """Freeze a process (SIGSTOP): it holds its sockets, leases and locks but does nothing,
        until it gets SIGCONT (:meth:`kill` with ``signal.SIGCONT``)."""
        return self.kill(host, process, signal.SIGSTOP, children=children)

    def start(self, host: str, process: str, *, extra_env: Mapping[str, str] | None = None,
              wait: float = 60.0) -> ProcessRecord:
        """Start a recorded process again (after :meth:`kill`) with the same command line; with
        ``extra_env`` replacing its extra environment. Waits up to ``wait`` s for its port."""
        record = self.process(host, process)
        if processes.is_alive(record):
            raise ClusterError(f"{host}/{process} is running (pid {record.pid}); kill it first")
        env = dict(record.extra_env if extra_env is None else extra_env)
        fresh = self._spawn(host, process, record.argv, user=record.user,
                            stop_signal=record.stop_signal, extra_env=env)
        port = {"postgres": "postgres", "redis": "redis", "ui_proxy": "webserver",
                "webserver_readonly": "webserver_readonly",
                "code_server": "code_server", "gateway": "gateway", "mailsink": "smtp"}.get(process)
        if port is not None and wait > 0:
            address = self.host(host).address
            self._wait(f"{host}/{process}", lambda: tcp_open(address, PORTS[port]),
                       time.monotonic() + wait, fresh)
        return fresh

    def restart(self, host: str, process: str, *, extra_env: Mapping[str, str] | None = None,
                timeout: float = 30.0, wait: float = 60.0) -> ProcessRecord:
        """Stop a recorded process gracefully (its own stop signal; SIGKILL after ``timeout``),
        then :meth:`start` it."""
        record = self.process(host, process)
        processes.end([record], timeout=timeout)
        return self.start(host, process, extra_env=extra_env, wait=wait)

    def partition(self, a: str, b: str, *, one_way: bool = False, loss: float = 1.0) -> Partition:
        """Drop packets between hosts ``a`` and ``b`` (only a -> b with ``one_way``; a share
        ``loss`` < 1 of them for a lossy link). Nothing is refused: connects time out."""
        ha, hb = self.host(a), self.host(b)
        part = Partition(a, b, one_way=one_way, loss=loss)
        self.state.setdefault("partitions", []).append(part.to_json())
        self._save()
        network.drop_between(ha.namespace, ha.address, hb.namespace, hb.address,
                             one_way=one_way, loss=loss)
        return part

    def heal(self, a: str | None = None, b: str | None = None) -> int:
        """Remove the partitions between ``a`` and ``b`` (either direction), or every partition
        when no hosts are given; returns how many were removed."""
        if a is None and b is None:
            return self.heal_all()
        if a is None or b is None:
            raise ClusterError("heal: name both hosts, or none to heal every partition")
        ha, hb = self.host(a), self.host(b)
        kept, removed = [], 0
        for data in self.state.get("partitions", []):
            part = Partition.from_json(data)
            if {part.a, part.b} != {a, b}:
                kept.append(data)
                continue
            src, dst = (ha, hb) if part.a == a else (hb, ha)
            network.undrop_between(src.namespace, src.address, dst.namespace, dst.address,
                                   one_way=part.one_way, loss=part.loss)
            removed += 1
        self.state["partitions"] = kept
        self._save()
        return removed

    def heal_all(self) -> int:
        """Remove every partition (every rule in the hosts' filter chains, recorded or not);
        returns how many were recorded."""
        count = len(self.state.get("partitions", []))
        for h in self.hosts:
            network.clear_partitions(h.namespace)
        self.state["partitions"] = []
        self._save()
        return count

    def partition_rules(self) -> dict[str, list[str]]:
        """The DROP rules in force per host (what the kernel has, not what the state says)."""
        return {h.name: network.partition_rules(h.namespace) for h in self.hosts}

    # -- measurements ------------------------------------------------------------------------------

    def redis_commands(self) -> dict[str, int]:
        """Calls per Redis command since the server started (INFO commandstats)."""
        client = redis_client(self.redis_url)
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    def redis_admin(self, command: str, *args: str | int) -> object:
        """``CONFIG`` or ``DEBUG`` on the store Redis, under the secret name ``up`` renamed it to
        (its clients get "unknown command")."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            return run_admin(client, self.state["redis_admin"], command, *args)
        finally:
            client.close()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used on each host so far, every process counted (ended run workers
        too); empty when this machine has no CPU accounting."""
        out = {}
        for host, group in self.state.get("cgroups", {}).items():
            seconds = cgroups.cpu_seconds(group)
            if seconds is not None:
                out[host] = seconds
        return out


def _tail(path: str, chars: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _merge(base: Any, overrides: Mapping[str, Any]) -> Any:
    """``base`` with ``overrides`` merged in, mappings recursively."""
    if not isinstance(base, dict):
        return dict(overrides)
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key), value) if isinstance(value, Mapping) else value
    return out
