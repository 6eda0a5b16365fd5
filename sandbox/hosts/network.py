"""Network namespaces joined by veth pairs to one bridge, and partitions that drop packets.

Everything goes through ``ip`` (iproute2) and ``iptables``; nothing here knows about Dagster or
sekali. The bridge lives in the root namespace and holds the subnet's first address, so the
machine itself reaches every host (the Dagster UI, the stores) by address. The root namespace
keeps ``ip_forward`` as it is and no host gets a default route: packets from a host can reach the
subnet and nothing else.

A partition is a pair of ``DROP`` rules in each of the two hosts' own namespaces (``INPUT`` from
the peer, ``OUTPUT`` to the peer), so packets vanish: a connect times out, an open connection
stalls until its own timeouts fire. Nothing is refused (no ``REJECT``, no RST), which is the
fault the chaos model asks for. This kernel has no ``netem`` qdisc, so loss below 100% uses
iptables' ``statistic`` match instead of ``tc``.
"""

from __future__ import annotations

import ipaddress
import logging
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from resources.errors import SekaliError

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
PARTITION_COMMENT = "sekali-partition"


class ClusterError(SekaliError):
    """The cluster could not be built, inspected or torn down; the message says what to do."""

    permanent = True


class CommandError(ClusterError):
    """A system command failed; carries the command and its output."""

    def __init__(self, argv: Sequence[str], returncode: int, output: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        super().__init__(f"{' '.join(argv)} exited {returncode}: {output.strip()[-500:]}")


def run(
    argv: Sequence[str], *, check: bool = True, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run a system command, capturing its output; raise :class:`CommandError` on failure."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise ClusterError(f"{argv[0]} is not installed (apt-get install it)") from exc
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, -1, f"timed out after {timeout:.0f}s") from exc
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stderr or done.stdout)
    return done


# -- namespaces and links --------------------------------------------------------------------


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def list_netns(prefix: str = "") -> list[str]:
    """Names of the network namespaces ``ip netns`` knows, starting with ``prefix``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def list_links(prefix: str = "") -> list[str]:
    """Interface names in the root namespace starting with ``prefix``."""
    out = run(["ip", "-o", "link", "show"]).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return sorted(names)


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def create_bridge(name: str, gateway: str, prefixlen: int) -> None:
    """A bridge in the root namespace holding ``gateway`` (the machine's door to the subnet)."""
    run(["ip", "link", "add", name, "type", "bridge"])
    run(["ip", "addr", "add", f"{gateway}/{prefixlen}", "dev", name])
    run(["ip", "link", "set", name, "up"])


def create_namespace(name: str) -> None:
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])


def attach_host(namespace: str, veth: str, bridge: str, address: str, prefixlen: int) -> None:
    """A veth pair: ``veth`` on the bridge, its peer ``eth0`` inside ``namespace``."""
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace])
    run(["ip", "link", "set", veth, "master", bridge])
    run(["ip", "link", "set", veth, "up"])
    run(["ip", "-n", namespace, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0"])
    run(["ip", "-n", namespace, "link", "set", "eth0", "up"])


def delete_namespace(name: str) -> None:
    """Delete a namespace (its end of every veth pair goes with it); absent is fine."""
    if netns_exists(name):
        run(["ip", "netns", "del", name], check=False)


def delete_link(name: str) -> None:
    if link_exists(name):
        run(["ip", "link", "del", name], check=False)


def namespace_pids(name: str) -> list[int]:
    """Every process whose network namespace is ``name`` (ours: we made the namespace)."""
    if not netns_exists(name):
        return []
    out = run(["ip", "netns", "pids", name], check=False).stdout
    return sorted(int(p) for p in out.split() if p.isdigit())


# -- addresses -------------------------------------------------------------------------------


def routed_networks() -> list[ipaddress.IPv4Network]:
    """Networks the root namespace already routes (``default`` excluded)."""
    out = run(["ip", "-4", "-o", "route", "show"]).stdout
    nets = []
    for line in out.splitlines():
        words = line.split()
        if not words or words[0] == "default":
            continue
        try:
            nets.append(ipaddress.IPv4Network(words[0], strict=False))
        except ValueError:
            continue
    return nets


def pick_subnet(seed: int, *, base: str = "10.77.0.0/16") -> ipaddress.IPv4Network:
    """A free /24 inside ``base``: the first one from ``seed`` on that no route overlaps."""
    pool = list(ipaddress.IPv4Network(base).subnets(new_prefix=24))
    taken = routed_networks()
    for i in range(len(pool)):
        candidate = pool[(seed + i) % len(pool)]
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise ClusterError(f"no free /24 left in {base}; pass --subnet")


def subnet_in_use(subnet: ipaddress.IPv4Network) -> bool:
    return any(subnet.overlaps(net) for net in routed_networks())


# -- root namespace forwarding -------------------------------------------------------------


def forward_policy() -> str | None:
    """The root namespace's ``FORWARD`` policy (bridged packets pass it when br_netfilter is
    on), or None when iptables is missing."""
    try:
        out = run(["iptables", "-S", "FORWARD"], check=False).stdout
    except ClusterError:
        return None
    for line in out.splitlines():
        if line.startswith("-P FORWARD"):
            return line.split()[-1]
    return None


def bridge_accept_rule(bridge: str) -> list[str]:
    """The root-namespace rule that lets the bridge's own traffic through a ``DROP`` policy."""
    return ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def add_root_rule(rule: Sequence[str]) -> None:
    run(["iptables", "-I", *rule])


def delete_root_rule(rule: Sequence[str]) -> None:
    # -C first: deleting an absent rule is an error, and down must be idempotent
    if run(["iptables", "-C", *rule], check=False).returncode == 0:
        run(["iptables", "-D", *rule], check=False)


# -- partitions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """Packets dropped between two hosts (both ways unless ``one_way``: then only a -> b)."""

    a: str
    b: str
    one_way: bool = False
    loss: float = 1.0

    def to_json(self) -> dict[str, object]:
        return {"a": self.a, "b": self.b, "one_way": self.one_way, "loss": self.loss}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Partition:
        return cls(
            a=str(data["a"]),
            b=str(data["b"]),
            one_way=bool(data.get("one_way", False)),
            loss=float(str(data.get("loss", 1.0))),
        )


def _drop(chain: str, direction: str, peer: str, loss: float, verb: str = "-I") -> list[str]:
    rule = [verb, chain, direction, f"{peer}/32"]
    if loss < 1.0:
        rule += ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.4f}"]
    return [*rule, "-m", "comment", "--comment", PARTITION_COMMENT, "-j", "DROP"]


def drop_between(
    ns_a: str, addr_a: str, ns_b: str, addr_b: str, *, one_way: bool = False, loss: float = 1.0
) -> None:
    """Drop packets a -> b (and b -> a unless ``one_way``), in both namespaces, so neither
    side's view depends on the other's rules."""
    if not 0.0 < loss <= 1.0:
        raise ClusterError(f"loss: expected 0 < loss <= 1, got {loss}")
    run(["ip", "netns", "exec", ns_a, "iptables", *_drop("OUTPUT", "-d", addr_b, loss)])
    run(["ip", "netns", "exec", ns_b, "iptables", *_drop("INPUT", "-s", addr_a, loss)])
    if not one_way:
        run(["ip", "netns", "exec", ns_b, "iptables", *_drop("OUTPUT", "-d", addr_a, loss)])
        run(["ip", "netns", "exec", ns_a, "iptables", *_drop("INPUT", "-s", addr_b, loss)])


def undrop_between(
    ns_a: str, addr_a: str, ns_b: str, addr_b: str, *, one_way: bool = False, loss: float = 1.0
) -> None:
    """Remove the rules :func:`drop_between` added for the same arguments (absent ones are
    skipped, so healing twice is fine); other partitions stay in force."""
    rules = [(ns_a, "OUTPUT", "-d", addr_b), (ns_b, "INPUT", "-s", addr_a)]
    if not one_way:
        rules += [(ns_b, "OUTPUT", "-d", addr_a), (ns_a, "INPUT", "-s", addr_b)]
    for ns, chain, direction, peer in rules:
        if not netns_exists(ns):
            continue
        check = ["ip", "netns", "exec", ns, "iptables", *_drop(chain, direction, peer, loss, "-C")]
        if run(check, check=False).returncode == 0:
            run(["ip", "netns", "exec", ns, "iptables",
                 *_drop(chain, direction, peer, loss, "-D")], check=False)


def clear_partitions(namespace: str) -> None:
    """Remove every partition rule in ``namespace`` (only the cluster writes rules there)."""
    if not netns_exists(namespace):
        return
    for chain in ("INPUT", "OUTPUT"):
        run(["ip", "netns", "exec", namespace, "iptables", "-F", chain], check=False)


def partition_rules(namespace: str) -> list[str]:
    """The partition rules in force in ``namespace`` (``iptables -S`` lines)."""
    if not netns_exists(namespace):
        return []
    out = run(["ip", "netns", "exec", namespace, "iptables", "-S"], check=False).stdout
    return [line for line in out.splitlines() if PARTITION_COMMENT in line]
