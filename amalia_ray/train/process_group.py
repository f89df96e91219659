"""The training workers' process group, rendezvoused through a Ray actor instead of Ray Train's default TCPStore.

torch's TCPStore listens, without authentication, on every interface of the first worker's node, and whoever
reaches it can rewrite the rendezvous: the addresses the later groups (checkpoint writes, rank 0's long waits)
connect to, and so the objects those groups hand over. Here the store is a `RendezvousStore` actor, reached over
Ray's own channel (token auth), and no store port is opened. When every worker runs on one node, gloo connects
over loopback too, so a CPU run on one machine opens no port off loopback; across nodes its connections need the
network, as in any torch.distributed job. NCCL's interface is left alone: it is chosen once per process, and the
trainer's first worker also joins the rollout engines' weight group, whose engines may run on other nodes."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

from amalia_ray.train.rendezvous import RendezvousStore
from amalia_ray.train.weight_sync import NAMESPACE, RayStore


@dataclass
class RendezvousTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, its process group rendezvoused through a Ray actor (`_RendezvousBackend`)."""

    @property
    def backend_cls(self):
        return _RendezvousBackend


class _RendezvousBackend(_TorchBackend):
    """Ray Train's torch backend with its `on_start` (the process group's setup) replaced; the rest is Ray's."""

    def on_start(self, worker_group, backend_config: RendezvousTorchConfig) -> None:
        import ray

        name = f"amalia-train-rendezvous-{uuid.uuid4().hex}"
        # held by this backend for as long as the worker group: a restarted group gets a store of its own
        # every rank may wait in the store at once (a get blocks until the key is set): room for all of them
        self.store = ray.remote(RendezvousStore).options(name=name, namespace=NAMESPACE, num_cpus=0,
                                                         max_concurrency=1 << 16).remote()
        if not isinstance(worker_group, V1WorkerGroup):  # as Ray's own on_start (V1 sets them once training starts)
            worker_group.execute(_set_torch_distributed_env_vars)
        one_node = len(set(worker_group.execute(_node_id))) == 1
        world = len(worker_group)
        ray.get([worker_group.execute_single_async(i, join_process_group, backend=backend_config.backend,
                                                   world_rank=i, world_size=world, store_name=name,
                                                   timeout_s=backend_config.timeout_s, one_node=one_node)
                 for i in range(world)])


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def loopback_interface() -> str | None:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux)."""
    import psutil

    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.address == "127.0.0.1" for a in addresses)), None)


def join_process_group(backend: str, world_rank: int, world_size: int, store_name: str, timeout_s: float,
                       one_node: bool) -> None:
    """One worker's part of the setup: the default process group on the actor's store; gloo's connections over
    loopback when every worker shares this node (unless the environment already names an interface)."""
    if one_node and (loopback := loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    if "nccl" in backend:  # as Ray Train sets it: a timed-out NCCL collective fails instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    global _store
    # kept alive here: torch holds only the C++ side of a store written in Python, and the groups made on it later
    # (new_group) would call into a Python object already gone
    _store = RayStore(store_name)
    dist.init_process_group(backend=backend, store=_store, rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


_store: RayStore | None = None
