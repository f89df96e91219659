"""The recipe: pydantic models for the whole pipeline, mirrored 1:1 by the YAML files under `recipes/`.

This module imports nothing else of ours, so every layer can depend on it. Loading and error formatting (YAML path,
line, allowed values) live in `core/recipe.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

class Strict(BaseModel):
    """Every recipe section rejects unknown fields so a typo never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(Strict):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="run folder name under output_dir")
    output_dir: str = Field("runs", description="where runs/<name>/ lives; relative paths are taken from the cwd")
    seed: int = 1234


class ResourcesConfig(Strict):
    address: str | None = Field(None, description="Ray cluster address; None = RAY_ADDRESS or an embedded local Ray")
    num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of the embedded Ray; default max(8, cores) so Serve can schedule"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"


class SourceConfig(Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    paths: list[str] = Field(..., min_length=1, description="files or globs; .gz is read transparently")
    format: Literal["text"] = "text"
    split: Literal["file", "paragraph", "separator"] = Field(
        "paragraph", description="what one document is: a whole file, a blank-line paragraph, or a separator block"
    )
    separator: str = Field("%", description="line that separates documents when split=separator (fortune files)")
    weight: float = Field(1.0, gt=0)


class DataConfig(Strict):
    sources: list[SourceConfig] = Field(..., min_length=1)
    normalization: Literal["NFC", "NFKC"] = "NFC"
    min_chars: int = Field(200, ge=0, description="documents shorter than this after cleaning are dropped")
    dedup: Literal["exact", "none"] = "exact"

    @model_validator(mode="after")
    def _unique_source_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        return self


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TokenizerConfig(Strict):
    kind: Literal["byte_bpe"] = "byte_bpe"
    vocab_size: int = Field(4096, ge=300, le=262144)
    min_frequency: int = Field(2, ge=1)
    chat_template: str = DEFAULT_CHAT_TEMPLATE


class PackConfig(Strict):
    seq_len: int = Field(256, ge=8)
    validation_fraction: float = Field(0.05, ge=0, lt=0.5)


class ModelConfig(Strict):
    architecture: Literal["llama"] = "llama"
    hidden_size: int = Field(256, ge=8)
    intermediate_size: int = Field(768, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    max_position_embeddings: int = Field(512, ge=8)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self


class TrainStageConfig(Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    objective: Literal["pretrain", "sft", "dpo", "grpo"]
    steps: int = Field(..., ge=1)
    global_batch_size: int = Field(8, ge=1, description="sequences per optimizer step, summed over workers")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward pass on one worker")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    activation_checkpointing: bool = False
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: int = Field(1, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    checkpoints_to_keep: int = Field(2, ge=1)
    max_failures: int = Field(0, ge=-1, description="-1 = retry forever")
    log_every: int = Field(1, ge=1)
    init_from: Literal["scratch", "previous"] = Field(
        "previous", description="previous: start from the previous training stage's checkpoint (scratch for the first)"
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainStageConfig:
        per_step = self.micro_batch_size * self.num_workers
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} must be a multiple of "
                f"micro_batch_size × num_workers = {per_step}"
            )
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds steps {self.steps}")
        return self


class EngineConfig(Strict):
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="auto: bf16")
    max_model_len: int = Field(512, ge=16)
    gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="on CPU vLLM reads this as the share of RAM it reserves: keep it small"
    )
    enforce_eager: bool = True


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    cpus_per_replica: int = Field(1, ge=1)
    gpus_per_replica: int = Field(0, ge=0)
    engine: EngineConfig = EngineConfig()
    startup_timeout_s: float = Field(900, gt=0)

    @model_validator(mode="after")
    def _replicas(self) -> ServeConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        return self


class EvalTaskConfig(Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    path: str
    kind: Literal["mc_loglik"] = "mc_loglik"
    limit: int | None = Field(None, ge=1, description="score only the first N items")


class EvalConfig(Strict):
    tasks: list[EvalTaskConfig] = Field(default_factory=list)
    concurrency: int = Field(8, ge=1)
    request_timeout_s: float = Field(120, gt=0)
    retries: int = Field(3, ge=0)


class Recipe(Strict):
    run: RunConfig = RunConfig()
    resources: ResourcesConfig = ResourcesConfig()
    data: DataConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    pack: PackConfig = PackConfig()
    model: ModelConfig = ModelConfig()
    train: Annotated[list[TrainStageConfig], Field(min_length=1)]
    serve: ServeConfig = ServeConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _stages(self) -> Recipe:
        names = [s.name for s in self.train]
        if len(set(names)) != len(names):
            raise ValueError(f"train stage names must be unique, got {names}")
        reserved = {"data", "tokenizer", "pack", "serve", "eval", "report"}
        if clash := reserved.intersection(names):
            raise ValueError(f"train stage names {sorted(clash)} clash with pipeline stages {sorted(reserved)}")
        if self.pack.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"pack.seq_len {self.pack.seq_len} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}"
            )
        return self
