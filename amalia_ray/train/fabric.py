"""Which network the workers' collectives cross nodes on, found out rather than assumed: a multi-node stage whose
NCCL fell back to TCP sockets (no EFA or InfiniBand device in the container, the OFI plugin not on the library
path) trains at a fraction of the speed without any error, so the first step of each attempt says what NCCL chose
on every node, the stage's records and report carry it, and a fallback is logged as a warning.

NCCL names its network once per process at its first communicator ("NCCL INFO Using network Socket", "IB",
"AWS Libfabric" / "Libfabric" for EFA through aws-ofi-nccl). Its INFO lines for INIT and NET only are sent to a file
of the worker's own (NCCL_DEBUG_FILE) and read back after the first step; a user's own NCCL_DEBUG setting is left as
it is, and the network is then reported unknown.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

NETWORK_LINE = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
NET_PREFIX = re.compile(r"NCCL INFO NET/(OFI|IB|Socket)\b")  # NCCL versions that do not print the line above
TCP_NETWORKS = {"Socket"}

# What an EFA node's Ray workers need in their environment for NCCL to cross nodes over EFA: libfabric's EFA
# provider with GPUDirect RDMA, and the aws-ofi-nccl plugin (libnccl-net-ofi.so, which NCCL_NET_PLUGIN=ofi names) on
# the library path. The EFA installer puts it under /opt/amazon/ofi-nccl: lib/x86_64-linux-gnu on Ubuntu, lib64 on
# Amazon Linux, lib in older releases (older still: /opt/amazon/aws-ofi-nccl/lib); the path names them all.
# cluster.yaml and deploy/kuberay/raycluster.yaml set exactly these (tests/test_cluster_config.py checks them).
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET_PLUGIN": "ofi"}
EFA_LIBRARY_PATH = ("/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/ofi-nccl/lib64:/opt/amazon/ofi-nccl/lib:"
                    "/opt/amazon/aws-ofi-nccl/lib:/opt/amazon/efa/lib")


def capture_nccl_network(rank: int) -> Path | None:
    """Before this process's first NCCL communicator: NCCL's INIT and NET info lines into a file of this rank's
    own, whose path is returned; None when the user set NCCL_DEBUG (their setting wins)."""
    if "NCCL_DEBUG" in os.environ:
        return None
    path = Path(tempfile.gettempdir()) / f"amalia-nccl-{os.getpid()}-rank{rank}.log"
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
    return path


def network_in(log: Path | None) -> str | None:
    """The network NCCL said it uses in its log, None when the log is missing or says nothing of it."""
    if log is None or not log.exists():
        return None
    text = log.read_text(errors="replace")
    found = NETWORK_LINE.findall(text) or NET_PREFIX.findall(text)
    return found[-1] if found else None


def describe(backend: str, per_rank: list[tuple[str, str | None]]) -> tuple[str, str | None]:
    """What the collectives ran over, from every rank's (node id, NCCL network; None where it is not known), and a
    warning when a stage spanning nodes crosses them over TCP sockets."""
    nodes: dict[str, set] = {}
    for node, network in per_rank:
        nodes.setdefault(node, set()).add(network or "unknown")
    if "nccl" not in backend:
        # gloo has one transport, TCP: a CPU stage's collectives are what they are, nothing to warn about
        return f"gloo (TCP) on {len(nodes)} node(s)", None
    by_network: dict[str, int] = {}
    for networks in nodes.values():
        for network in networks:
            by_network[network] = by_network.get(network, 0) + 1
    text = "NCCL " + "; ".join(f"{network} on {count} node(s)" for network, count in sorted(by_network.items()))
    slow = set(by_network) & TCP_NETWORKS
    if len(nodes) < 2 or not slow:
        return text, None
    return text, (f"WARNING: NCCL crosses the {len(nodes)} nodes over {' / '.join(sorted(slow))} "
                  f"({text}): the collectives between nodes (FSDP's all-gathers and reduce-scatters, HSDP's gradient "
                  "all-reduce) go through TCP sockets, which can take most of a step at this size. Give the "
                  "containers the EFA or InfiniBand devices and put NCCL's network plugin on the library path "
                  "(cluster.yaml and deploy/kuberay do this for EFA; docs/cluster.md)")


def shard_groups_across_nodes(nodes: list[str], shard_size: int | None) -> str | None:
    """HSDP's shard groups are runs of `shard_size` consecutive ranks (a `replicate × shard` mesh): a warning when
    one spans nodes (workers SPREAD, or nodes holding other counts than `shard_size`), whose per-layer all-gathers
    then cross the network."""
    if not shard_size:
        return None
    split = [i for i in range(0, len(nodes), shard_size) if len(set(nodes[i:i + shard_size])) > 1]
    if not split:
        return None
    return (f"WARNING: {len(split)} of {len(nodes) // shard_size} HSDP shard groups of {shard_size} ranks span nodes, "
            "so their per-layer all-gathers cross the network: place the workers PACK, on nodes of "
            f"{shard_size} workers each")
