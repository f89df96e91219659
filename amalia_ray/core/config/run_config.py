"""The run-level sections of a recipe: `run` (name, seed, storage), `resources`, `plan` (the cluster `amalia plan`
sizes for), `accounting` (what a device-hour costs) and `tracking` (MLflow, W&B)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, field_validator

from amalia_ray.core.config.strict import NAME_PATTERN, Strict


class RunConfig(Strict):
    """Where the run lives and what makes it reproducible."""
    name: str = Field("demo", pattern=NAME_PATTERN, description="run folder name under output_dir")
    output_dir: str = Field("runs", description="where runs/<name>/ lives (the working copy the stages read and "
                            "write); relative paths are taken from the cwd")
    storage: str | None = Field(None, description="durable copy of the run: a path or URI (s3://bucket/prefix, "
                                "gs://…, file://…, any fsspec scheme); each finished stage is mirrored to "
                                "<storage>/<name>/, Ray Train checkpoints go there directly, and a fresh machine "
                                "pulls from it to skip or resume. None: the run folder only")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the storage's filesystem, e.g. {endpoint_override: "
        "http://minio:9000} for an S3-compatible store; credentials come from the environment (AWS_ACCESS_KEY_ID…)")
    seed: int = Field(1234, description="seeds the shuffles, the data split, model initialization and sampling")
    trusted_modules: list[str] = Field(default_factory=list, description="modules (or packages) whose functions the "
                                       "recipe may name as rewards or curriculum hooks ('package.module:function'): "
                                       "a recipe runs the code it names, so any other module is refused; this "
                                       "package's own are always allowed")


class ResourcesConfig(Strict):
    """Which Ray cluster runs the stages, and on what devices."""
    address: str | None = Field(None, description="Ray cluster address; None = RAY_ADDRESS or an embedded local Ray")
    num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of the embedded Ray; default max(8, cores) so Serve can schedule"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: GPUs when the cluster has them or its autoscaler can start nodes that have them")


class PlanConfig(Strict):
    """Hardware and price assumptions for `amalia plan` (estimates only; nothing runs)."""
    gpu: str = "H100-SXM-80GB"
    gpu_memory_gb: float = Field(80, gt=0)
    peak_tflops: float = Field(989, gt=0, description="dense bf16 peak of one GPU")
    mfu: float = Field(0.40, gt=0, le=1, description="model FLOPs utilization the step time is estimated with")
    usd_per_gpu_hour: float = Field(2.5, ge=0)
    watts_per_gpu: float = Field(700, gt=0, description="per GPU, including its share of the node, for energy")
    headroom_gb: float = Field(6, ge=0, description="per GPU for the CUDA context, NCCL buffers and fragmentation")
    memory_tb_per_s: float = Field(3.35, gt=0, description="memory bandwidth of one GPU (TB/s): each token a rollout "
                                   "engine decodes reads its weights and its sequences' KV cache")
    decode_bandwidth_utilization: float = Field(
        0.6, gt=0, le=1, description="share of memory_tb_per_s a decoding step achieves (prefill runs at mfu)")
    storage_write_gb_per_s: float = Field(5, gt=0, description="what the run's storage takes in, all ranks writing "
                                          "at once: a checkpoint's save time (and with it when a batch job must be "
                                          "told to stop) follows from it")
    gpus_per_node: int = Field(8, ge=1, description="GPUs of one node: a stage on more spans nodes (HSDP's shard "
                               "groups are a node's GPUs)")
    interconnect: Literal["tcp", "efa", "infiniband"] = Field(
        "tcp", description="what links the nodes for NCCL: tcp (sockets; a multi-node stage is warned about: at tens "
        "of GPUs the all-gathers take most of the step), efa (AWS, through the aws-ofi-nccl plugin the cluster files "
        "wire) or infiniband. The first training step logs the transport NCCL chose on each node")
    reported_gpu_hours: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="train stage name -> GPU-hours a past run reported: the plan states the "
        "MFU those imply for the stage's batch shape")
    reported_rollout_s: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="GRPO stage name -> seconds one rollout took in a past run (the "
        "`rollout_wait_s` its steps that sampled record in the stage's metrics.jsonl; asynchronous, only the first "
        "step waits for a whole rollout): the plan states the share of memory_tb_per_s its decoding implies, the "
        "figure to put in decode_bandwidth_utilization")


class AccountingConfig(Strict):
    """What a stage cost on the hardware it ran on: device-hours are what the stage held (CPUs, GPUs, by Ray resource
    name) times how long it ran; energy and money follow from these per-device figures."""
    watts: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 10.0, "GPU": 700.0},
        description="watts per device by Ray resource name, including its share of the node (one CPU = one core)")
    usd_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.04, "GPU": 2.5}, description="price of one device-hour by resource name")
    pue: float = Field(1.0, ge=1, description="data-centre power usage effectiveness the device energy is scaled by")

    @field_validator("watts", "usd_per_hour")
    @classmethod
    def _non_negative(cls, v: dict[str, float], info) -> dict[str, float]:
        if bad := {k: x for k, x in v.items() if x < 0}:
            raise ValueError(f"{info.field_name}: negative values {bad}")
        return v


class WandbConfig(Strict):
    """A Weights & Biases project the stages are also logged to."""
    project: str = Field(..., description="the W&B project the run's stages go to (one W&B run per stage, grouped "
                         "by the run's name)")
    entity: str | None = Field(None, description="team or user; default: the logged-in user's")
    mode: Literal["online", "offline"] = Field("online", description="offline: written under runs/<name>/wandb "
                                               "for `wandb sync` later")


class TrackingConfig(Strict):
    """Experiment tracking. MLflow by default: one MLflow run per `amalia run` with a nested run per stage that ran
    (the stage's config as params, every logged metric per step, its cost), the recipe, report and plots as
    artifacts."""
    mlflow: bool = Field(True, description="track with MLflow")
    mlflow_uri: str | None = Field(None, description="an MLflow tracking server (http://…) or database URI; "
                                   "default: a SQLite store in the run folder, runs/<name>/mlruns/mlflow.db")
    wandb: WandbConfig | None = Field(None, description="also track with Weights & Biases (needs the wandb package)")
