"""sekali on several hosts made of network namespaces: ``sekali cluster up|down|status``.

The public names; the chaos harness drives :class:`Cluster` (hosts with names, addresses and
namespaces, ``exec_in``, ``partition`` / ``heal``, ``kill`` / ``stop`` / ``cont`` / ``start``).
"""

from sandbox.hosts.cluster import Cluster, Host, NotRoot, default_state_dir, require_root
from sandbox.hosts.network import ClusterError, CommandError, Partition
from sandbox.hosts.processes import ProcessRecord

__all__ = [
    "Cluster",
    "ClusterError",
    "CommandError",
    "Host",
    "NotRoot",
    "Partition",
    "ProcessRecord",
    "default_state_dir",
    "require_root",
]
