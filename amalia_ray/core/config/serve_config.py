"""The `serve` section of a recipe: the vLLM engine and the Ray Serve deployment the eval stage and `amalia serve`
start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from amalia_ray.core.config.strict import Strict


class EngineConfig(Strict):
    """A vLLM engine."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU (see resolved_dtype)")
    max_model_len: int = Field(512, ge=16, description="longest prompt + completion in tokens")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="the share of the device's memory vLLM may take for weights, activations and "
        "KV cache (on CPU: of RAM, reserved at start); null: 0.9 on GPU (vLLM's default), 0.1 on CPU")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs (faster start, slower decoding); null: "
                                       "eager on CPU only")

    def resolved_dtype(self, use_gpu: bool) -> str:
        """What vLLM is asked for. `auto` is bf16 on GPU and fp32 on CPU, as in training: vLLM's own `auto` runs
        bf16 on CPU too, which without native bf16 instructions (AVX2 only) falls back to a scalar-converting dot
        product — 6× slower per scored sequence than fp32 on the machine we measured."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if use_gpu else "float32"

    def memory_share(self, use_gpu: bool) -> float:
        """What vLLM is given as gpu_memory_utilization. On a GPU it is the whole budget of a replica's engine
        (weights, activations, KV cache): a small share starts nothing but the smallest models."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.9 if use_gpu else 0.1

    def eager(self, use_gpu: bool) -> bool:
        return (not use_gpu) if self.enforce_eager is None else self.enforce_eager


class ServeConfig(Strict):
    """Serving every checkpoint behind an OpenAI-compatible API (Ray Serve + vLLM), for `amalia serve` and the eval stage."""
    host: str = Field("127.0.0.1", description="bind address; loopback unless the service must be reached from outside")
    port: int = Field(8000, ge=1, le=65535, description="the HTTP port of Serve's proxy")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="where Serve's HTTP proxies run: on every node with a replica (a load balancer in "
        "front spreads clients over them), or on the head only")
    min_replicas: int = Field(1, ge=0, description="per model; 0 lets an idle model scale to zero")
    max_replicas: int = Field(1, ge=1, description="autoscaling ceiling per model")
    target_ongoing_requests: int = Field(16, ge=1, description="autoscaling: requests in flight per replica it "
                                         "aims for before adding a replica")
    cpus_per_replica: int = Field(1, ge=1, description="CPUs each replica's actor holds (its engine holds as many more)")
    gpus_per_replica: int = Field(0, ge=0, description="GPUs per replica on a GPU cluster (0: 1): the model is split "
                                  "over them, tensor parallel within a node (vLLM's tensor_parallel_size = "
                                  "gpus_per_replica / pipeline_parallel_size)")
    pipeline_parallel_size: int = Field(1, ge=1, description="GPU replicas: pipeline stages, which may sit on "
                                        "different nodes (a model too large for one node's GPUs)")
    engine: EngineConfig = Field(EngineConfig(), description="the vLLM engine of each replica")
    startup_timeout_s: float = Field(900, gt=0, description="how long every model may take to answer before serving fails")
    api_key_env: str = Field("AMALIA_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                             description="environment variable holding the API key; when it is set, every request "
                             "but /health needs 'Authorization: Bearer <key>' (the key itself never goes in a recipe)")
    allow_no_auth: bool = Field(False, description="serve on an address other machines reach (host off loopback) "
                                "with no API key set: anyone who reaches the port may use the models (without "
                                "this, such a start is refused; `amalia serve --allow-no-auth` says the same)")
    max_request_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies are refused with 413")
    access_log: bool = Field(False, description="Serve's per-request access log lines in every replica (costs CPU on "
                             "small machines)")

    @model_validator(mode="after")
    def _replicas(self) -> ServeConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        if self.replica_gpus % self.pipeline_parallel_size:
            raise ValueError(f"gpus_per_replica {self.gpus_per_replica} is not a multiple of pipeline_parallel_size "
                             f"{self.pipeline_parallel_size}")
        return self

    @property
    def replica_gpus(self) -> int:
        """The GPUs one replica holds on a GPU cluster."""
        return max(1, self.gpus_per_replica)

    @property
    def replicas_in_use(self) -> int:
        """The replicas a model holds while it is being asked: min_replicas, and at least one (a request wakes a
        model scaled to zero)."""
        return max(1, self.min_replicas)
