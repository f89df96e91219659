"""The rollout engine GRPO samples from: weights streamed into the running vLLM engine bucket by bucket, with the
memory that costs measured on both sides, and the engine's size and placement derived for the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from amalia_ray.core.config import RolloutConfig
from amalia_ray.train.rollout import ENGINE_WORKSPACE_BYTES, KV_SPARE_TOKENS, engine_memory, kv_bytes_per_token

GiB = 2**30


def test_engine_memory_fits_the_model_beside_the_trainer():
    # a 9B model in bf16 colocated on an 80 GB GPU: the step's KV cache when it fits, else what is left
    weights, per_token = 18 * GiB, 172 * 1024
    util, kv = engine_memory(weights, per_token, sequences=8, tokens_per_sequence=1024, max_model_len=4096,
                             free=78 * GiB, total=80 * GiB, trainer_bytes=GiB)
    assert kv == (8 * 1024 + KV_SPARE_TOKENS) * per_token and util == pytest.approx((weights + kv + ENGINE_WORKSPACE_BYTES) / (80 * GiB))
    util, kv = engine_memory(weights, per_token, sequences=512, tokens_per_sequence=4096, max_model_len=4096,
                             free=78 * GiB, total=80 * GiB, trainer_bytes=GiB)
    assert kv == int(0.9 * 78 * GiB) - GiB - weights - ENGINE_WORKSPACE_BYTES and util < 0.9
    with pytest.raises(ValueError, match="does not fit beside the training worker.*rollout.placement: separate"):
        engine_memory(weights, per_token, 8, 1024, 4096, free=20 * GiB, total=80 * GiB)


def test_kv_bytes_per_token_reads_grouped_query_heads():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=42, num_attention_heads=32, num_key_value_heads=8)
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 42 * 8 * 128 * 2


def test_a_colocated_engine_reserves_nothing_and_sees_its_workers_gpu(monkeypatch):
    """Colocated (the default), the engine is pinned to the calling worker's node, asks Ray for no CPU or GPU (the
    stage's workers hold them all; a GPU of its own would wait forever on a full cluster) and is shown the worker's
    own GPU, asleep between rollouts; separate, it asks for a GPU of its own."""
    import ray

    from amalia_ray.train import rollout

    seen = {}

    class Remote:
        def options(self, **options):
            seen.update(options)
            return self

        def remote(self, *args):
            seen["args"] = args

    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "a" * 56})())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(rollout, "device_memory", lambda this_gpu: {"free": 70 * GiB, "total": 80 * GiB})
    sizing = {"weight_bytes": GiB, "kv_per_token": 1024, "sequences": 8, "tokens_per_sequence": 256}
    rollout.start_engine("m", RolloutConfig(max_model_len=512), seed=0, use_gpu=True, sizing=sizing)
    assert seen["num_cpus"] == 0 and seen["num_gpus"] == 0
    assert seen["scheduling_strategy"].node_id == "a" * 56 and seen["scheduling_strategy"].soft is False
    assert seen["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"] == "6"
    dtype, max_len, eager, _, util, kv, sleep, tensor_parallel, max_seqs = seen["args"][1:]
    assert (dtype, max_len, sleep, kv) == ("bfloat16", 512, True, (8 * 256 + KV_SPARE_TOKENS) * 1024) and 0 < util < 0.1
    assert (eager, tensor_parallel) == (False, 1), "CUDA graphs on GPU unless the recipe asks for eager"
    assert max_seqs == 8, "the engine batches a step's sequences, not vLLM's default of up to 1,024"

    seen.clear()
    rollout.start_engine("m", RolloutConfig(max_model_len=512, placement="separate", gpu_memory_utilization=0.5),
                         seed=0, use_gpu=True)
    assert seen["num_gpus"] == 1 and "scheduling_strategy" not in seen and "CUDA_VISIBLE_DEVICES" not in seen[
        "runtime_env"]["env_vars"]
    assert seen["args"][5:8] == (0.5, None, False)
    seen.clear()  # separate and sized: the trainer's memory is on another GPU, not taken from the engine's
    greedy = {**sizing, "sequences": 10**6, "trainer_bytes": 30 * GiB}
    rollout.start_engine("m", RolloutConfig(max_model_len=512, placement="separate"), seed=0, use_gpu=True, sizing=greedy)
    assert seen["args"][6] == int(0.9 * 70 * GiB) - GiB - rollout.ENGINE_WORKSPACE_BYTES
    assert seen["args"][9] == rollout.ENGINE_MAX_SEQS

    # sharded, the engine's process holds no GPU and starts in the first bundle of its own placement group, whose
    # GPU bundles vLLM's Ray executor fills with its workers: GPUs free on one node, the process on that node
    seen.clear()
    group = object()
    rollout.start_engine("m", RolloutConfig(placement="separate", tensor_parallel=4, gpu_memory_utilization=0.8),
                         seed=0, use_gpu=True, group=group)
    strategy = seen["scheduling_strategy"]
    assert (seen["num_gpus"], strategy.placement_group, strategy.placement_group_bundle_index) == (0, group, 0)
    with pytest.raises(ValueError, match="starts in a placement group"):
        rollout.start_engine("m", RolloutConfig(placement="separate", tensor_parallel=4, gpu_memory_utilization=0.8),
                             seed=0, use_gpu=True)


def test_a_sharded_engines_gpus_are_free_ones_of_one_node_or_the_fleet_says_so(ray_cluster):
    """One placement group per sharded engine: a bundle for its process, one per GPU, packed on one node; where no
    node has them free the fleet does not wait for ever, and the group is given back."""
    from ray.util.placement_group import placement_group_table

    from amalia_ray.train.rollout import sharded_engine_groups

    before = set(placement_group_table())
    with pytest.raises(RuntimeError, match="tensor_parallel 2: 2 of 2 engine.s. found no node with 2 GPUs free "
                                           "within 1 s"):
        sharded_engine_groups(2, 2, timeout_s=1)
    made = [v for k, v in placement_group_table().items() if k not in before]
    assert len(made) == 2 and all(m["strategy"] == "STRICT_PACK" and m["state"] == "REMOVED" for m in made)
    assert list(made[0]["bundles"].values()) == [{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]


def test_a_fleet_splits_prompts_in_order_and_seeds_each_by_its_place_in_the_stream():
    """Contiguous, near-equal shares (no empty engine call); a prompt's seed depends on the stage's seed and its
    position only, spaced so its n completions' seeds (seed + i) never meet another prompt's."""
    from amalia_ray.train.rollout_fleet import prompt_seeds, shares

    assert shares(5, 2) == [range(0, 3), range(3, 5)] and shares(1, 3) == [range(0, 1)]
    assert [i for run in shares(7, 3) for i in run] == list(range(7))
    first, later = prompt_seeds(0, 0, 6, 4), prompt_seeds(0, 2, 4, 4)
    assert first[2:] == later, "the same position, the same seed"
    assert len(set(first)) == 6 and all(s % 4 == 0 for s in first) and prompt_seeds(1, 0, 6, 4) != first


def test_fleet_shapes_that_cannot_run_are_refused_before_an_engine_starts(monkeypatch):
    from amalia_ray.core.config import train_stage
    from amalia_ray.train.rollout_fleet import start_fleet, weight_transport

    with pytest.raises(ValueError, match="tensor_parallel 2 shards each engine.*placement: separate"):
        RolloutConfig(tensor_parallel=2)
    assert RolloutConfig(tensor_parallel=2, placement="separate", engines=3).gpus(True) == 6
    assert RolloutConfig(engines=3).gpus(True) == 0 and RolloutConfig(engines=3, placement="separate").gpus(False) == 0
    stage = train_stage({"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 10,
                         "rollout": {"engines": 4, "enforce_eager": None}})
    assert stage.rollout.engines == 4 and stage.rollout.eager(False) and not stage.rollout.eager(True)
    workers = [("a" * 56, "0"), ("b" * 56, "1")]
    with pytest.raises(ValueError, match="rollout.engines 3 colocated on GPU needs as many training workers"):
        start_fleet("m", RolloutConfig(engines=3), 0, True, None, workers)
    with pytest.raises(ValueError, match="tensor_parallel 2 shards engines over GPUs; on CPU"):
        start_fleet("m", RolloutConfig(tensor_parallel=2, placement="separate"), 0, False, None, workers)
    # each engine is sized for whole prompts, as they are dealt out: 3 prompts of 8 completions on 2 engines, the
    # first samples 16
    from amalia_ray.train import rollout_fleet

    sized = []
    monkeypatch.setattr(rollout_fleet, "start_engine", lambda model, cfg, seed, gpu, sizing, **k: sized.append(sizing))
    sizing = {"weight_bytes": 1, "kv_per_token": 1, "sequences": 24, "tokens_per_sequence": 8, "per_prompt": 8}
    start_fleet("m", RolloutConfig(engines=2), 0, False, sizing, workers, weight_sync=False)
    assert [s["sequences"] for s in sized] == [16, 16] and "per_prompt" not in sized[0]
    # an engine sharing rank 0's GPU cannot join it in a NCCL group: NCCL only to engines on GPUs of their own
    assert weight_transport(RolloutConfig(engines=2), use_gpu=True) == "gloo"
    assert weight_transport(RolloutConfig(placement="separate"), use_gpu=True) == "nccl"
    assert weight_transport(RolloutConfig(placement="separate"), use_gpu=False) == "gloo"


def test_nccl_members_join_on_the_trainers_id_through_the_communicators_constructor(monkeypatch):
    """Every member, rank 0 included, builds vLLM's communicator on the id the trainer minted, through the
    constructor every vLLM version has (the GPU extra's has no `from_unique_id_bytes`), with nothing pickled; a
    process without NCCL says so rather than leave the others waiting in the rendezvous."""
    import base64

    from vllm.distributed.device_communicators import pynccl
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    from amalia_ray.train.weight_sync import nccl_group

    class Created(Exception):
        pass

    class Nccl:  # what the constructor asks of the library, up to creating the communicator
        def __init__(self, library_path=None):
            pass

        def ncclGetRawVersion(self):
            return 22900

        def ncclGetVersion(self):
            return "2.29.0"

        def ncclGetUniqueId(self):  # what rank 0 would otherwise mint and share itself
            other = ncclUniqueId()
            other.internal[0] = 1
            return other

        def ncclCommInitRank(self, world_size, unique_id, rank):
            built.append((rank, world_size, bytes(unique_id.internal)))
            raise Created  # the warm-up collective after it needs the other members

    built = []
    monkeypatch.delattr(pynccl.PyNcclCommunicator, "from_unique_id_bytes", raising=False)  # as in vLLM 0.29
    monkeypatch.setattr(pynccl, "NCCLLibrary", Nccl)
    minted = bytes((i * 37 + 11) % 256 for i in range(128))
    for rank in range(3):
        with pytest.raises(Created):
            nccl_group(base64.b64encode(minted).decode(), rank, 3, torch.device("cpu"))
    assert built == [(rank, 3, minted) for rank in range(3)]
    with pytest.raises(ValueError, match="unique id is 128 bytes, not 5"):
        nccl_group(base64.b64encode(b"short").decode(), 1, 3, torch.device("cpu"))

    def no_library(library_path=None):
        raise OSError("libnccl.so.2: cannot open shared object file")

    monkeypatch.setattr(pynccl, "NCCLLibrary", no_library)
    with pytest.raises(RuntimeError, match="NCCL is not available in this process \\(rank 1 of 3"):
        nccl_group(base64.b64encode(minted).decode(), 1, 3, torch.device("cpu"))


class AnonPeak:
    """The peak of a process's private resident memory (RssAnon), sampled every half millisecond from a thread:
    the kernel's own high-water mark also counts the object store's shared pages, which every new object first
    touches wherever the store places it, whether or not any memory is held."""

    def __init__(self):
        import threading

        self.start = self.peak = self.now()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    @staticmethod
    def now() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("RssAnon:")[1].split()[0]) * 1024

    def sample(self):
        import time

        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.0005)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, self.now()) - self.start


def _push_and_measure(rank: int, address: str, folder: str, out: str) -> None:
    """One FSDP2 rank (world 1) beside a fleet of two engines: streams perturbed weights, then the original ones,
    and reports what each side's private resident memory grew by during each push, what the engines sample and
    the log-probabilities they give."""
    import os

    import ray
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from amalia_ray.train.completions import pad_completions, token_logps
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp
    from amalia_ray.train.rollout import kv_bytes_per_token, this_worker
    from amalia_ray.train.rollout_fleet import prompt_seeds, push_weights, start_fleet

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)
    ray.init(address=address, log_to_driver=False)
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = AutoConfig.from_pretrained(folder)
    model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", False), init_dir=Path(folder),
                  seed=0).requires_grad_(False)
    copy = sum(p.numel() * 4 for p in model.parameters())
    sizing = {"weight_bytes": copy, "kv_per_token": kv_bytes_per_token(config, torch.float32), "sequences": 8,
              "tokens_per_sequence": 64}
    before = _listening()
    fleet = start_fleet(folder, RolloutConfig(max_model_len=128, engines=2), seed=0, use_gpu=False, sizing=sizing,
                        workers=[this_worker(False)])
    # the weight group's sockets: on loopback, here and in both engines (Ray's own listen on every interface)
    opened = {"trainer": sorted(_listening() - before),
              "engines": ray.get([e.__ray_call__.remote(lambda self: sorted(_listening())) for e in fleet.engines])}
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(text)["input_ids"] for text in ("one two three", "four five", "six seven eight nine", "ten")]
    greedy = lambda: fleet.sample(prompts, 1, 12, 0.0, prompt_seeds(0, 0, len(prompts), 1))  # noqa: E731
    before = greedy()

    # the same seeds give the same completions split over the two engines as on either engine alone
    seeds = prompt_seeds(0, 100, len(prompts), 2)
    split = fleet.sample(prompts, 2, 12, 1.0, seeds)
    alone = [ray.get(engine.generate.remote(prompts, 2, 12, 1.0, False, seeds)) for engine in fleet.engines]

    def engine_start(self):
        # the engine is a Ray worker started before this test set MALLOC_MMAP_THRESHOLD_: set the same there, so a
        # freed bucket goes back to the system instead of staying in the heap and adding to later measurements
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
        self._anon_peak = AnonPeak()

    def engine_stop(self):
        return self._anon_peak.stop()

    def measured_push(bucket_bytes: int) -> dict:
        ray.get([engine.__ray_call__.remote(engine_start) for engine in fleet.engines])
        trainer = AnonPeak()
        push_weights(model, fleet, torch.float32, bucket_bytes)
        return {"trainer": trainer.stop(),
                "engine": max(ray.get([engine.__ray_call__.remote(engine_stop) for engine in fleet.engines]))}

    def logprob_gap() -> tuple[float, int]:
        # what an async GRPO step weighs its policy against: each engine's log-probability of each token it sampled
        # at temperature 0.7, against the trainer's own of the same tokens at the same temperature
        drawn = fleet.sample(prompts, 2, 12, 0.7, prompt_seeds(0, 200, len(prompts), 2), logprobs=True)
        pairs = [(p, ids, lp) for p, per_prompt in zip(prompts, drawn) for ids, lp in per_prompt]
        batch = pad_completions([(p, ids) for p, ids, _ in pairs], 0, 128)
        with torch.no_grad():
            trainer_logps = token_logps(model, batch, temperature=0.7)
        model.reshard()  # FSDP2 keeps the root module gathered after a forward without backward
        return (max(abs(trainer_logps[i, len(p) - 1 + j].item() - value)
                    for i, (p, _, lp) in enumerate(pairs) for j, value in enumerate(lp)),
                sum(len(lp) for _, _, lp in pairs))

    original = {n: p.to_local().clone() for n, p in model.named_parameters()}
    measured_push(copy // 8)  # warm-up: the first push sets up the transfer path on both sides
    torch.manual_seed(0)
    with torch.no_grad():  # a change the size of the weights' own spread at initialization
        for p in model.parameters():
            p.to_local().add_(0.02 * torch.randn_like(p.to_local()))
    streamed = measured_push(copy // 8)
    changed = greedy()
    gap, sampled_tokens = logprob_gap()  # the engines serve the pushed weights, not the ones they loaded
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(original[n])
    whole = measured_push(4 * copy)  # the check that the measurement sees a whole copy when one is held
    restored = greedy()
    restored_gap, _ = logprob_gap()
    Path(out).write_text(json.dumps({"copy": copy, "streamed": streamed, "whole": whole, "before": before,
                                     "changed": changed, "restored": restored, "logprob_gap": gap,
                                     "sampled_tokens": sampled_tokens, "restored_gap": restored_gap,
                                     "opened": opened, "split": split, "alone": alone}))
    fleet.shutdown()
    dist.destroy_process_group()
    ray.shutdown()


def _listening() -> set[str]:
    """This process's listening TCP sockets bound to one address (not to every interface), as 'ip:port'."""
    import psutil

    return {f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("0.0.0.0", "::")}


def _free_port() -> int:
    from tests.conftest import free_port

    return free_port()


@pytest.mark.e2e
def test_weights_stream_into_the_fleet_within_a_fraction_of_one_copy(ray_cluster, tmp_path, monkeypatch):
    """A fleet of two engines. The same seeds give the same completions whether a rollout's prompts are split over
    both engines or sampled by either alone. GRPO's weight push, every step: the trainer gathers one tensor at a
    time and rank 0 broadcasts buckets of an eighth of the model to both engines over a gloo group, so it grows by
    a small part of one copy of the weights, and an engine (which holds the model already) never by a whole copy;
    the log-probabilities both engines give for what they sample are then the trainer's within 1e-5, at the
    sampling temperature, and pushing the original weights back gives the original samples (greedy). Pushed as
    one bucket, the trainer grows by about a whole copy: the measurement sees a copy when one is held."""
    import torch.multiprocessing as mp

    from tests.base_models import make_base_model

    folder = make_base_model(tmp_path / "model", "llama", hidden=512, layers=4, vocab=4096, dtype="float32")
    out = tmp_path / "push.json"
    # the trainer's large blocks go back to the system when freed, so its resident memory shows what it holds
    # (glibc otherwise raises its mmap threshold and keeps freed blocks for reuse, hiding later peaks)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    mp.spawn(_push_and_measure, args=(ray_cluster.get_runtime_context().gcs_address, str(folder), str(out)),
             nprocs=1)
    got = json.loads(out.read_text())
    copy, streamed, whole = got["copy"], got["streamed"], got["whole"]
    assert got["opened"]["trainer"] and all(e for e in got["opened"]["engines"]), got["opened"]
    assert all(a.startswith("127.0.0.1:") for a in got["opened"]["trainer"] + sum(got["opened"]["engines"], [])), \
        f"the weight group listens on loopback only: {got['opened']}"
    assert got["split"] == got["alone"][0] == got["alone"][1], "completions depend on their seeds alone"
    assert len({tuple(map(tuple, c)) for c in got["split"]}) == 4, "each prompt samples from its own seed"
    assert got["changed"] != got["before"] and got["restored"] == got["before"], got
    assert streamed["trainer"] < 0.5 * copy and streamed["engine"] < copy, got
    assert whole["trainer"] > 0.8 * copy, f"the measurement cannot see a whole copy held: {got}"
    assert got["sampled_tokens"] >= 8 and max(got["logprob_gap"], got["restored_gap"]) < 1e-5, \
        f"both engines' log-probabilities of what they sampled are the trainer's: {got}"


def test_a_colocated_engine_leaves_the_trainer_its_planned_step(tmp_path):
    """The demo recipe's GRPO stage: the pipeline hands its workers what a step adds above the sharded state (the
    plan's activations, logits, gathered blocks…) as a function of the tokens a sequence is padded to, which grows
    with them; the engine's KV budget shrinks by exactly that, and a separate engine's does not."""
    import pickle

    import yaml

    from amalia_ray.cluster.plan import GB, RESIDENT, Dims, plan_stage
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline
    from amalia_ray.pipeline.stages import _step_transient
    from tests.conftest import DEMO_RECIPE

    data = yaml.safe_load(DEMO_RECIPE.read_text())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(data))
    pipeline = Pipeline(load_recipe(tmp_path / "demo.yaml"))
    grpo = next(s for s in pipeline.recipe.train if s.objective == "grpo")
    transient = pickle.loads(pickle.dumps(_step_transient(pipeline, grpo)))  # as it travels to the workers
    planned = plan_stage(grpo.model_copy(update={"seq_len": 96}), pipeline.recipe, Dims.of(pipeline.recipe))
    step = transient(96)
    assert step == int(sum(v for k, v in planned.memory_gb.items() if k not in RESIDENT) * GB) > 0
    assert "activations" in planned.memory_gb and transient(192) > step, "longer sequences, more activations"
    assert _step_transient(pipeline, next(s for s in pipeline.recipe.train if s.objective != "grpo")) is None
    sizing = dict(weight_bytes=GiB, kv_per_token=1024, sequences=10**6, tokens_per_sequence=512, max_model_len=512,
                  free=40 * GiB, total=48 * GiB)
    _, alone = engine_memory(**sizing, trainer_bytes=GiB)
    _, beside = engine_memory(**sizing, trainer_bytes=GiB + step)
    assert alone - beside == step
