"""The trainer's weights into every rollout engine through one collective group, as veRL and OpenRLHF do: vLLM's
weight-update path (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`)
with a transfer engine of ours, registered with vLLM as a plugin (`register`), over gloo on CPU and NCCL on GPU.

The trainer's first worker is rank 0 of the group; every engine worker (each tensor-parallel rank too) joins it and
receives every bucket, which the model's own `load_weights` shards, inside vLLM's layerwise reload (so q/k/v and
gate/up, which vLLM fuses, are processed once all their parts are in). Nothing travels through Ray's object store: a
bucket is one flat byte buffer broadcast from rank 0, after a header with its length and a JSON list of what it holds
(name, dtype, shape, offset). A stream of buckets ends with an empty header, so the receiver needs no list of names
up front (LoRA adapters are merged into the weights as they stream).

NCCL carries the weights to engines on GPUs of their own (`placement: separate`); an engine colocated with a
training worker shares that worker's GPU, and NCCL refuses two members on one GPU, so colocated engines on GPU receive
over gloo, through the host, as on CPU. Rendezvous: NCCL takes a unique id minted by rank 0 and handed to the engines
over Ray (no listening store); gloo exchanges its addresses through a small Ray actor (`RendezvousStore`), so no store
port is opened either. Gloo's own connections bind to loopback when every engine runs on the trainer's node."""

from __future__ import annotations

import base64
import ctypes
import json
import math
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from amalia_ray.train.rendezvous import RendezvousStore

BACKEND = "amalia_collective"
NAMESPACE = "amalia-weight-sync"
ALIGN = 64  # each tensor's offset in a bucket: any dtype's view of it is aligned
TIMEOUT = timedelta(minutes=30)  # a 9B model's first gather can take minutes on a busy cluster
# the receiver's sanity limits on a header (the sender is the trainer, but a broken stream must fail, not allocate)
MAX_HEADER_BYTES = 64 << 20
MAX_BUCKET_BYTES = 64 << 30
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64", "int64", "int32",
                                                   "int16", "int8", "uint8", "bool", "float8_e4m3fn",
                                                   "float8_e5m2")}


def register() -> None:
    """Make the transfer engine known to vLLM in this process (the `vllm.general_plugins` entry point, which vLLM
    loads in every engine and worker process; called again before an engine starts, in case it did not)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "CollectiveReceiver")
    except ValueError:  # already registered
        pass


# -- the wire format --------------------------------------------------------------------------------------------

class Bucket:
    """Tensors copied one by one into one flat byte buffer of `capacity` bytes on `device`, each at an ALIGN-aligned
    offset (a tensor larger than the capacity gets a bucket of its own size), with the JSON header listing them."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self.entries: list[list] = []
        self.used = 0
        self.buffer: torch.Tensor | None = None

    @staticmethod
    def span(tensor: torch.Tensor) -> int:
        return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN

    def fits(self, tensor: torch.Tensor) -> bool:
        return not self.entries or self.used + self.span(tensor) <= self.capacity

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, self.span(tensor)), dtype=torch.uint8, device=self.device)
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        self.buffer[self.used:self.used + flat.numel()].copy_(flat)
        self.entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.used])
        self.used += self.span(tensor)

    def header(self) -> bytes:
        return json.dumps(self.entries).encode()

    def payload(self) -> torch.Tensor:
        return self.buffer[:self.used]


def unpack(header: bytes, payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a bucket holds: views into its buffer, checked against its bounds."""
    out = []
    for name, dtype, shape, at in json.loads(header):
        if dtype not in DTYPES:
            raise ValueError(f"weight stream: unknown dtype {dtype!r} for {name!r}")
        dt = DTYPES[dtype]
        size = math.prod(shape) * dt.itemsize
        if not (isinstance(at, int) and 0 <= at and at + size <= payload.numel() and at % ALIGN == 0):
            raise ValueError(f"weight stream: {name!r} ({size} bytes at {at}) lies outside its "
                             f"{payload.numel()}-byte bucket")
        out.append((name, payload[at:at + size].view(dt).view(shape)))
    return out


class Channel:
    """One side of the group: broadcasts from rank 0 over a gloo process group or a NCCL communicator."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.device.type == "cuda":  # this device's stream: a sending thread's current device is device 0
            self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream(self.device))
        else:
            self.group.broadcast(tensor, 0).wait()

    def send(self, header: bytes, payload: torch.Tensor) -> None:
        self._broadcast(torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=self.device))
        if header:
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
            self._broadcast(payload)
        if self.device.type == "cuda":  # NCCL only enqueues: done means received, and the buffer is free again
            torch.cuda.current_stream(self.device).synchronize()

    def end(self) -> None:
        self.send(b"", torch.empty(0, dtype=torch.uint8, device=self.device))

    def receive(self):
        """Each bucket of one stream as (header, payload), until its end."""
        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            self._broadcast(sizes)
            header_len, payload_len = sizes.tolist()
            if header_len == 0:
                return
            if not (0 < header_len <= MAX_HEADER_BYTES and 0 <= payload_len <= MAX_BUCKET_BYTES):
                raise ValueError(f"weight stream: a bucket header of {header_len} bytes for {payload_len} bytes is "
                                 "out of bounds")
            header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
            self._broadcast(header)
            payload = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
            self._broadcast(payload)
            yield bytes(header.cpu().numpy()), payload

    def close(self) -> None:
        if self.device.type == "cuda":
            self.group.destroy()
        else:
            self.group.shutdown()


# -- rendezvous -------------------------------------------------------------------------------------------------

class RayStore(dist.Store):
    """torch.distributed's Store interface over a `RendezvousStore` actor."""

    def __init__(self, name: str):
        import ray

        super().__init__()
        self.actor = ray.get_actor(name, namespace=NAMESPACE)
        self.timeout_s = TIMEOUT.total_seconds()

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def set(self, key, value):
        self._call("set", key, value if isinstance(value, bytes) else str(value).encode())

    def get(self, key):
        got = self._call("get", [key], self.timeout_s)
        if got is None:
            raise TimeoutError(f"weight sync rendezvous: no peer set {key!r} within {self.timeout_s:.0f} s")
        return got[0]

    def add(self, key, amount):
        return self._call("add", key, int(amount))

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        if self._call("get", list(keys), seconds) is None:
            raise TimeoutError(f"weight sync rendezvous: {list(keys)} not set within {seconds:.0f} s")

    def delete_key(self, key):
        return self._call("delete", key)

    def compare_set(self, key, expected, desired):
        as_bytes = lambda v: v if isinstance(v, bytes) else str(v).encode()  # noqa: E731
        return self._call("compare_set", key, as_bytes(expected), as_bytes(desired))

    def set_timeout(self, timeout):
        self.timeout_s = timeout.total_seconds()


def gloo_group(store_name: str, host: str, rank: int, world: int):
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = TIMEOUT
    return ProcessGroupGloo(RayStore(store_name), rank, world, options)


def nccl_group(unique_id_b64: str, rank: int, world: int, device: torch.device):
    """vLLM's NCCL communicator on the id the trainer minted. Built through its constructor, which every vLLM
    version has (the GPU extra's 0.29 has no `from_unique_id_bytes`), with a group whose one broadcast, the id's,
    hands each rank that id: no store to reach and nothing pickled."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup

    raw = base64.b64decode(unique_id_b64)
    if len(raw) != ctypes.sizeof(ncclUniqueId):
        raise ValueError(f"weight sync: an NCCL unique id is {ctypes.sizeof(ncclUniqueId)} bytes, not {len(raw)}")
    agreed = ncclUniqueId.from_buffer_copy(raw)

    class AgreedId(StatelessProcessGroup):
        def broadcast_obj(self, obj, src):
            return agreed

    comm = PyNcclCommunicator(AgreedId(rank=rank, world_size=world, store=None), device=device)
    if not comm.available:  # no NCCL library here, or VLLM_DISABLE_PYNCCL: the others would wait for this rank
        raise RuntimeError(f"weight sync: NCCL is not available in this process (rank {rank} of {world}, {device}); "
                           "engines on GPUs of their own need it (VLLM_DISABLE_PYNCCL unset, NCCL installed)")
    return comm


def open_channel(info: dict, rank: int, device: torch.device) -> Channel:
    if info["transport"] == "nccl":
        return Channel(nccl_group(info["nccl_unique_id_b64"], rank, info["world_size"], device), device)
    # loopback when every member is on one node, else this member's own node address
    host = info["host"]
    if host is None:
        import ray

        host = ray.util.get_node_ip_address()
    return Channel(gloo_group(info["store"], host, rank, info["world_size"]), torch.device("cpu"))


# -- the engine's side ------------------------------------------------------------------------------------------

def _receiver_classes():
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class CollectiveInitInfo(WeightTransferInitInfo):
        transport: str  # gloo | nccl
        rank_offset: int  # the group rank of this engine's first worker
        world_size: int
        host: str | None = None  # gloo: 127.0.0.1 when all members share a node, else None: each its own
        store: str | None = None  # gloo: the rendezvous actor's name
        nccl_unique_id_b64: str | None = None

    @dataclass
    class CollectiveUpdateInfo(WeightTransferUpdateInfo):
        pass  # a stream describes itself, bucket by bucket

    class CollectiveReceiver(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
        """The engine worker's side: joins the trainer's group, and loads each bucket of a stream as it comes."""
        init_info_cls = CollectiveInitInfo
        update_info_cls = CollectiveUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.channel: Channel | None = None

        def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
            parallel = self.parallel_config
            rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
            self.channel = open_channel(vars(init_info), rank, self.device)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            if self.channel is None:
                raise RuntimeError("weight sync: the engine has not joined the trainer's group")
            with disable_mtp_completeness_check():
                for header, payload in self.channel.receive():
                    self.model.load_weights(unpack(header, payload.to(self.device)))

        def shutdown(self) -> None:
            if self.channel is not None:
                self.channel.close()
                self.channel = None

    return CollectiveReceiver


def __getattr__(name: str):
    # vLLM loads the receiver by name; defined on first use so this module imports without vLLM (the trainer)
    if name == "CollectiveReceiver":
        globals()[name] = _receiver_classes()
        return globals()[name]
    raise AttributeError(name)


# -- the trainer's side -----------------------------------------------------------------------------------------

class WeightSender:
    """Rank 0 of the trainer in the group with every engine's workers (`workers_per_engine` each): over NCCL
    (`nccl`: engines on GPUs of their own) or gloo (`gloo`: on CPU, and on GPU for engines that share a training
    worker's GPU — NCCL refuses two members on one GPU — through the host)."""

    def __init__(self, engines: list, workers_per_engine: int, transport: str):
        import ray

        # an engine that failed to start must raise here, not leave rank 0 waiting for it in the rendezvous
        nodes = ray.get([engine.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                         for engine in engines])
        here = ray.get_runtime_context().get_node_id()
        world = 1 + len(engines) * workers_per_engine
        self.store = None
        if transport == "nccl":
            from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

            info = {"transport": "nccl", "world_size": world,
                    "nccl_unique_id_b64": base64.b64encode(bytes(NCCLLibrary().ncclGetUniqueId().internal)).decode()}
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            name = f"store-{uuid.uuid4().hex}"
            self.store = ray.remote(RendezvousStore).options(name=name, namespace=NAMESPACE, num_cpus=0).remote()
            info = {"transport": "gloo", "world_size": world, "store": name,
                    "host": "127.0.0.1" if all(node == here for node in nodes) else None}
            device = torch.device("cpu")
        try:
            joined = [engine.join_weight_group.remote({**info, "rank_offset": 1 + i * workers_per_engine})
                      for i, engine in enumerate(engines)]
            self.channel = self._open_watching(info, device, joined)
        except BaseException:
            if self.store is not None:
                ray.kill(self.store)
            raise
        self.device = self.channel.device

    @staticmethod
    def _open_watching(info: dict, device: torch.device, joined: list) -> Channel:
        """Rank 0's side of the rendezvous, opened on a thread while the engines' joins are watched: an engine that
        dies or fails to join raises here (NCCL's rendezvous has no timeout of its own)."""
        import threading

        import ray

        opened: dict = {}

        def open_it():
            try:
                opened["channel"] = open_channel(info, 0, device)
            except BaseException as e:  # noqa: BLE001 - handed to the watching thread
                opened["error"] = e

        opener = threading.Thread(target=open_it, name="weight-group-open", daemon=True)
        opener.start()
        pending = list(joined)
        while pending or opener.is_alive():
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
            ray.get(done)  # an engine's failed join raises here
            opener.join(timeout=0 if pending else 2.0)
            if "error" in opened:  # rank 0's own side failed: the engines would wait for it
                raise opened["error"]
        return opened["channel"]

    def send(self, bucket: Bucket) -> None:
        self.channel.send(bucket.header(), bucket.payload())

    def end(self) -> None:
        self.channel.end()

    def close(self) -> None:
        import ray

        self.channel.close()
        if self.store is not None:
            ray.kill(self.store)
