"""The workers' process group on GPU nodes: NCCL is registered for CUDA tensors only, so the loop's CPU-side
collectives (metric sums, gathered objects, the mean rows of a grown vocabulary) would stop the first step with "No
backend type associated with device type cpu". Reproduced here with gloo standing in for NCCL on the `cuda` device
type: the same collectives fail under a CUDA-only backend and run under the one training configures for GPUs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from amalia_ray.train.parallel import process_group_backend
from amalia_ray.train.process_group import RendezvousTorchConfig
from tests.conftest import free_port


def _collectives(rank: int, world: int, port: int, backend: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    from amalia_ray.train.loop import _all_reduce, _all_reduce_sum

    try:
        sums = _all_reduce_sum(1.0, float(rank))
        peak = _all_reduce([float(rank)], dist.ReduceOp.MAX)
        nodes: list = [None] * world
        dist.all_gather_object(nodes, f"node-{rank}")
        payload = [{"rollout": rank}]
        dist.broadcast_object_list(payload, src=0)
        result = repr((sums, peak, nodes, payload))
    except RuntimeError as e:
        result = f"error: {e}"
    if rank == 0:
        with open(out, "w") as f:
            f.write(result)
    dist.destroy_process_group()


def _run(backend: str, tmp_path) -> str:
    out = tmp_path / f"{backend.replace(':', '_').replace(',', '_')}.txt"
    mp.spawn(_collectives, args=(2, free_port(), backend, str(out)), nprocs=2)
    return out.read_text()


def test_cpu_collectives_need_a_cpu_backend_beside_nccl(tmp_path):
    # plain "nccl" registers a backend for cuda alone: what the loop's CPU tensors meet on a GPU cluster
    assert "No backend type associated with device type cpu" in _run("cuda:gloo", tmp_path)
    gpu_backend = process_group_backend(use_gpu=True)
    assert gpu_backend == "cpu:gloo,cuda:nccl" and process_group_backend(use_gpu=False) == "gloo"
    # the GPU configuration with gloo standing in for NCCL (no GPU here): every CPU collective goes through
    assert _run(gpu_backend.replace("nccl", "gloo"), tmp_path) == repr(
        ([2.0, 1.0], [1.0], ["node-0", "node-1"], [{"rollout": 0}]))


def test_training_passes_the_backend_to_ray_train(monkeypatch, tmp_path):
    """run_train_stage hands Ray Train the backend above (Ray's default on GPUs is plain nccl)."""
    import ray.train.torch

    from amalia_ray.core.config import ModelConfig, PretrainStage
    from amalia_ray.train import train_stage as stage_module

    seen = {}

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", capture)
    monkeypatch.setattr(stage_module, "hf_config_dict", lambda *a, **k: {})
    for use_gpu in (True, False):
        with pytest.raises(Stop):
            stage_module.run_train_stage(PretrainStage(name="pretrain", objective="pretrain", steps=10), ModelConfig(),
                                         data_dir=tmp_path,
                                         tokenizer_dir=tmp_path, init_hf_dir=None, stage_dir=tmp_path / "s",
                                         ray_run_name="r", seed=0, use_gpu=use_gpu, progress=False)
        assert seen["torch_config"].backend == process_group_backend(use_gpu)
        assert isinstance(seen["torch_config"], RendezvousTorchConfig)


def _listening(out: str) -> None:
    """A Ray Train worker: its process group works, and the TCP ports its process listens on go to `out`."""
    import json

    import ray.train

    total = torch.tensor([1.0])
    dist.all_reduce(total)
    dist.barrier(group=dist.new_group(backend="gloo"))  # a later group, as the loop's checkpoint and wait groups
    ports = _own_listening()
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"sum": total.item(), "listening": ports}, f)


def _own_listening() -> list[str]:
    import psutil

    return [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


@pytest.mark.reliability
def test_the_training_workers_open_no_port_off_loopback_on_one_node(ray_cluster, tmp_path):
    """Ray Train's default rendezvous is a TCPStore that rank 0 opens, unauthenticated, on every interface (shown
    here: a TCPStore given 127.0.0.1 listens off loopback). The training's own rendezvous goes through a Ray actor instead, and on
    one node gloo connects over loopback: two workers sum, build a later group, and listen off loopback on nothing
    but what every Ray worker process does (its gRPC server, behind Ray's token)."""
    import json

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def listening(config) -> list[list[str]]:
        out = tmp_path / type(config).__name__
        out.mkdir()
        TorchTrainer(lambda: _listening(str(out)), torch_config=config, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=str(tmp_path / "ray"))).fit()
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert all(r["sum"] == 2.0 for r in ranks)
        return [r["listening"] for r in ranks]

    def off_loopback(ports: list[str]) -> list[str]:
        return [p for p in ports if not p.startswith(("127.", "::1:"))]

    # Ray's default rendezvous: a TCPStore, which listens on every interface even when given 127.0.0.1
    store = dist.TCPStore("127.0.0.1", port := free_port(), 1, True)
    assert [p for p in off_loopback(_own_listening()) if p.endswith(f":{port}")], "a TCPStore off loopback"
    del store
    # what any Ray worker process listens on by itself (its gRPC server, behind Ray's token): not the training's
    ray_own = len(off_loopback(ray.get(ray.remote(_own_listening).remote())))
    ours = listening(RendezvousTorchConfig(backend="gloo"))
    assert all(len(off_loopback(ports)) == ray_own for ports in ours), (ours, ray_own)


def test_the_network_nccl_chose_is_read_from_its_log_and_tcp_between_nodes_is_warned_about(tmp_path, monkeypatch):
    """NCCL's own lines name the network ("Using network …", or NET/… in versions without that line); a stage on
    several nodes whose NCCL uses sockets anywhere gets a warning naming the fix; one node, EFA, InfiniBand and
    gloo's CPU stages do not. A user's own NCCL_DEBUG is left alone."""
    from amalia_ray.train import fabric

    for var in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.setenv(var, "")  # recorded, so what the capture sets is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    log = fabric.capture_nccl_network(rank=3)
    assert log.parent == tmp_path and log.name.endswith("-rank3.log")
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert os.environ["NCCL_DEBUG_FILE"] == str(log)
    assert fabric.network_in(log) is None, "no communicator yet: no file"
    log.write_text("p5-7:812:812 [3] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)\n"
                   "p5-7:812:812 [3] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)\n"
                   "p5-7:812:812 [3] NCCL INFO Using network Libfabric\n")
    assert fabric.network_in(log) == "Libfabric"
    log.write_text("node:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.7<0>\n")
    assert fabric.network_in(log) == "Socket", "an NCCL that prints no 'Using network' line"
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/elsewhere")
    assert fabric.capture_nccl_network(rank=0) is None and os.environ["NCCL_DEBUG_FILE"] == "/elsewhere"

    nccl = "cpu:gloo,cuda:nccl"
    efa = [("a", "Libfabric")] * 8 + [("b", "Libfabric")] * 8
    assert fabric.describe(nccl, efa) == ("NCCL Libfabric on 2 node(s)", None)
    text, warning = fabric.describe(nccl, [("a", "Libfabric")] * 8 + [("b", "Socket")] * 8)
    assert text == "NCCL Libfabric on 1 node(s); Socket on 1 node(s)"
    assert warning.startswith("WARNING: NCCL crosses the 2 nodes over Socket") and "EFA or InfiniBand" in warning
    assert fabric.describe(nccl, [("a", "Socket")] * 8) == ("NCCL Socket on 1 node(s)", None), "within one node"
    assert fabric.describe(nccl, [("a", "IB"), ("b", None)]) == ("NCCL IB on 1 node(s); unknown on 1 node(s)", None)
    assert fabric.describe("gloo", [("a", None), ("b", None)]) == ("gloo (TCP) on 2 node(s)", None)
    # HSDP's shard groups are runs of shard_size ranks: each on one node, or a warning
    assert fabric.shard_groups_across_nodes(["a"] * 8 + ["b"] * 8, 8) is None
    assert fabric.shard_groups_across_nodes(["a", "b"] * 8, 8).startswith("WARNING: 2 of 2 HSDP shard groups")
    assert fabric.shard_groups_across_nodes(["a", "b"] * 8, None) is None, "FSDP: no shard groups"
