"""The `train` section of a recipe: one stage model per objective (`objective` picks it), with what every stage
has (schedule, batch, precision, workers, checkpoints), LoRA adapters, the curriculum, the rollout engine and the
proxy a sweep shrinks the stage to."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, TypeAdapter, field_validator, model_validator

from amalia_ray.core.config.eval_config import JudgeConfig
from amalia_ray.core.config.serve_config import EngineConfig
from amalia_ray.core.config.strict import NAME_PATTERN, Strict


def checkpoint_interval(activation_checkpointing: bool | int) -> int:
    """`activation_checkpointing` as every how many blocks one is checkpointed: true 1, false 0, k k."""
    if isinstance(activation_checkpointing, bool):
        return int(activation_checkpointing)
    return activation_checkpointing


class MixPhase(Strict):
    """Source weights in force until a number of training tokens."""
    until_tokens: int | None = Field(None, ge=1, description="this phase holds until so many training tokens "
                                     "(of this stage) were read; null: to the end")
    weights: dict[str, float] = Field(..., min_length=1, description="source name -> sampling weight (>= 0); "
                                      "unnamed sources get 0")

    @model_validator(mode="after")
    def _weights(self) -> MixPhase:
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"phase weights must be >= 0 with at least one > 0, got {self.weights}")
        return self


class CurriculumConfig(Strict):
    """Mix weights over training tokens: piecewise-constant phases, or a hook 'package.module:function' called
    with (tokens seen, source names) that returns a weight per source."""

    phases: list[MixPhase] = []
    hook: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

    @model_validator(mode="after")
    def _one_kind(self) -> CurriculumConfig:
        if bool(self.phases) == bool(self.hook):
            raise ValueError("curriculum needs either phases or hook (exactly one)")
        ends = [p.until_tokens for p in self.phases]
        if None in ends[:-1]:
            raise ValueError("only the last curriculum phase may have until_tokens null")
        bounded = [e for e in ends if e is not None]
        if bounded != sorted(set(bounded)):
            raise ValueError(f"curriculum phases' until_tokens must increase, got {bounded}")
        return self


# the most sequences a rollout engine decodes at once: vLLM sizes its sampler's warm-up (max_num_seqs × vocabulary
# logits) and its CUDA graphs by it, and its default on an H100 (1,024) would outgrow an engine's workspace for large
# vocabularies; below every default max_num_batched_tokens (≥ 2,048), which vLLM requires it not to exceed
ENGINE_MAX_SEQS = 256


class RolloutConfig(EngineConfig):
    """The vLLM engines (the rollout fleet) a grpo or on-policy dpo stage samples from."""
    engines: int = Field(1, ge=1, description="vLLM engines sampling in parallel: each rollout's prompts are split "
                         "across them and the completions gathered in prompt order; the trainer's weights reach "
                         "every engine through one collective broadcast")
    tensor_parallel: int = Field(1, ge=1, description="GPUs each engine shards its model over (vLLM's "
                                 "tensor_parallel_size; 1 on CPU); above 1 the engines need placement: separate")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: engine i on the node of training worker i (of the stage's workers, "
        "in turn), sharing its GPU (asleep between rollouts on GPU), reserving nothing beyond the stage's workers; "
        "separate: actors holding engines × tensor_parallel GPUs of their own, which the cluster must have spare "
        "beside the training workers")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="share of the device's memory an engine may take; default: sized to the "
        "model (its weights in the engine's dtype, the KV cache of its share of a step's sequences, a workspace) "
        "within what the device has free beside the training worker")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs; null: eager on CPU only (vLLM's CPU "
                                       "backend), CUDA graphs on GPU, where decoding is several times faster")

    @model_validator(mode="after")
    def _sharded_engines_are_separate(self) -> RolloutConfig:
        if self.tensor_parallel > 1 and self.placement == "colocated":
            raise ValueError(f"rollout.tensor_parallel {self.tensor_parallel} shards each engine over GPUs of its "
                             "own: set rollout.placement: separate (a colocated engine shares one training "
                             "worker's GPU)")
        return self

    def eager(self, use_gpu: bool) -> bool:
        return (not use_gpu) if self.enforce_eager is None else self.enforce_eager

    def gpus(self, use_gpu: bool) -> int:
        """GPUs the engines hold beside the training workers."""
        return self.engines * self.tensor_parallel if use_gpu and self.placement == "separate" else 0

    def for_length(self, max_model_len: int) -> RolloutConfig:
        """This engine for sequences of `max_model_len` tokens (the stage's seq_len), validated again: a stage's
        shortest seq_len is below the shortest max_model_len an engine takes."""
        return RolloutConfig.model_validate({**self.model_dump(), "max_model_len": max_model_len})


class ProxyConfig(Strict):
    """How a training stage shrinks for a sweep (`amalia sweep`): trials train this smaller model for fewer steps,
    validating every `validate_every` steps so a scheduler can stop the weak ones early."""
    model: dict[str, Any] = Field(default_factory=dict, description="model fields to override, e.g. {num_layers: 1, "
                                  "hidden_size: 64}")
    steps: int | None = Field(None, ge=1, description="steps per trial (default: the stage's)")
    validate_every: int = Field(5, ge=1, description="validation (and the sweep's report) interval in steps")
    num_workers: int | None = Field(None, ge=1, description="workers per trial (default: the stage's minimum)")


class LoraConfig(Strict):
    """Low-rank adapters (PEFT's LoRA) instead of training every weight: the base weights stay frozen, only the
    adapters (and `modules_to_save`) train and are checkpointed."""
    r: int = Field(16, ge=1, description="the adapters' rank")
    alpha: float = Field(32.0, gt=0, description="scaling: the update is alpha / r × B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; "
        "all-linear: every linear layer but the LM head")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full beside the "
                                       "adapters, e.g. [lm_head] after growing the vocabulary")
    merge: bool = Field(False, description="also export the merged full checkpoint (hf/), what a following stage "
                        "starts from; the adapter folder (adapter/) is always written, and the eval stage serves it on "
                        "the engine of the weights it was trained from (one engine for the base and its adapters)")

    @property
    def adapters_only(self) -> bool:
        """Only the adapters train (no module in full): the starting weights stay untouched, so the adapter on the
        starting checkpoint's engine is the trained model, and the policy with its adapters off is the start."""
        return not self.modules_to_save


# positions of the logits the loss upcasts to fp32 at once (train/loss.py); `amalia plan` counts one such chunk
LOSS_CHUNK_POSITIONS = 2048


class TrainStageConfig(Strict):
    """What every training stage has. A stage is one of the objectives below, chosen by `objective`; a field that
    belongs to another objective is an error, not silently ignored."""
    name: str = Field(..., pattern=NAME_PATTERN, description="the stage's folder under the run and its served model's suffix")
    objective: str
    steps: int = Field(..., ge=1, description="optimizer steps")
    global_batch_size: int = Field(8, ge=1, description="sequences per optimizer step, summed over workers")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward pass on one worker")
    lr: float = Field(..., gt=0, description="peak learning rate (each objective has its own default)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the schedule's floor, as a share of lr")
    warmup_steps: int = Field(10, ge=0, description="linear warmup from 0 to lr")
    schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="after warmup: cosine decay, warmup-stable-decay, or constant")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's betas")
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = Field(
        "every_micro_batch", description="when FSDP reduce-scatters the gradients: after every micro-batch (each worker "
        "holds only its shard), or once a step, after the last (fewer collectives; each worker holds the whole model's "
        "unsharded gradients in between, in fp32 whatever reduce_precision says, which `amalia plan` counts)")
    reduce_precision: Literal["bf16", "fp32"] = Field(
        "bf16", description="bf16 runs: the dtype gradients are reduce-scattered in (bf16 moves half the bytes; fp32 "
        "sums many ranks more exactly)")
    activation_checkpointing: bool | int = Field(
        False, description="recompute decoder blocks in the backward pass: true = every block (least activation "
        "memory, about a third more compute), k = every k-th block (less recompute for more memory; `amalia plan` "
        "names the largest k that fits)")

    @field_validator("activation_checkpointing")
    @classmethod
    def _checkpoint_interval(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"activation_checkpointing {v}: true, false or every k-th block with k >= 1")
        return v

    @property
    def recompute_every(self) -> int:
        """Every how many decoder blocks one is recomputed in the backward pass (0: none)."""
        return checkpoint_interval(self.activation_checkpointing)
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each decoder block (fuses the element-wise work; costs a compilation of "
        "~20 s per worker at start); auto: on GPU, where it pays, off on CPU")
    num_workers: int | tuple[int, int] = Field(2, description="workers, or [min, max] for elastic training: "
                                               "starts with what the cluster has (at least min) and carries on "
                                               "with fewer workers when a node goes away (needs max_failures)")
    shard_size: int | None = Field(
        None, ge=1, description="ranks each weight is sharded over. null: all the stage's workers (FSDP); k: HSDP, "
        "sharded within groups of k ranks (a node's GPUs, so each layer's all-gather and reduce-scatter stays inside "
        "the node) and replicated across the groups (one gradient all-reduce per step crosses nodes). Holds 16·P/k "
        "bytes of weights, gradients and AdamW state per GPU instead of 16·P/workers; `amalia plan` names the "
        "smallest k that fits for a multi-node stage. An elastic stage whose worker count k does not divide shards "
        "over all of them, said in the log")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs each worker holds (its torch threads on CPU)")
    elastic_resize_interval_s: float = Field(
        60, gt=0, description="elastic stages: how often Ray Train checks whether more workers fit (then restarts "
        "the worker group bigger from the latest checkpoint)")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how the stage's workers land on nodes (a Ray placement strategy): PACK = as few nodes as "
        "fit, so the gradient all-reduce stays inside a node; SPREAD = one per node where possible, so losing a node "
        "costs fewer workers")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (DCP) and validation losses")
    validation_rows: int | None = Field(
        1024, ge=1, description="validation rows (packed sequences, conversations, pairs) scored per source at each "
        "checkpoint: a sample drawn once from the run's seed, the same rows every time; null scores the whole "
        "validation split (a share of the corpus: at scale, more compute than the training between two checkpoints)")
    checkpoint_async: bool | Literal["auto"] = Field(
        "auto", description="write checkpoints while training goes on (DCP's async_save): the save copies this rank's "
        "shard of the weights and AdamW state into host memory, the next step runs while a thread writes it, and the "
        "checkpoint is registered after that step (a failure during it resumes from the checkpoint before); the last "
        "step's is written before going on, and a stop seen while one is being written stops at it. auto: on "
        "GPU, where the copy out of GPU memory takes a fraction of the write")
    checkpoints_to_keep: int = Field(2, ge=1, description="older checkpoints are deleted")
    max_failures: int = Field(0, ge=-1, description="-1 = retry forever")
    log_every: int = Field(1, ge=1, description="steps between log lines and reports to Ray Train (metrics.jsonl has every step)")
    init_from: Literal["scratch", "previous"] = Field(
        "previous", description="previous: start from the previous policy stage's checkpoint (reward stages are passed "
        "over: they branch off), the base model's before the first (random weights without one); scratch: random "
        "weights"
    )
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="how the stage shrinks for `amalia sweep`")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on the frozen starting weights (PEFT); "
                                    "null: train every weight")

    # how a stage runs, not what it trains: changing one keeps the stage's fingerprint, so an interrupted stage
    # resumes from its checkpoints and a completed one is kept (another worker count sums gradients in another order:
    # the same training up to floating-point rounding)
    OPERATIONAL: ClassVar[frozenset[str]] = frozenset({
        "num_workers", "cpus_per_worker", "elastic_resize_interval_s", "placement", "max_failures",
        "checkpoints_to_keep", "checkpoint_async", "log_every", "proxy"})

    def fingerprinted(self) -> dict:
        """The stage's fields that decide what it trains (all but OPERATIONAL)."""
        return self.model_dump(mode="json", exclude=set(self.OPERATIONAL))

    @property
    def worker_range(self) -> tuple[int, int]:
        return (self.num_workers, self.num_workers) if isinstance(self.num_workers, int) else tuple(self.num_workers)

    def adapter_servable(self, has_start: bool) -> bool:
        """Whether vLLM serves this stage's LoRA adapter on the engine of the checkpoint it trained from: only
        adapters train (lora.adapters_only), from that checkpoint (`has_start`: the previous stage's or a base
        model's weights; random initial weights have no engine)."""
        return bool(self.lora) and self.lora.adapters_only and self.init_from == "previous" and has_start

    @property
    def data_path(self) -> str | None:
        """The stage's own dataset; None: it reads the packed corpus."""
        return None

    @property
    def sampled_rewards(self) -> list[RewardConfig]:
        """The rewards a stage scores what it samples with (GRPO, on-policy DPO); none for a stage that samples
        nothing."""
        return []

    @property
    def sequence_length(self) -> int | None:
        """The stage's own sequence length; None: the packed corpus's (pretraining) or the model's positions."""
        return None

    def engine_gpus(self, use_gpu: bool) -> int:
        """GPUs the stage's rollout engines hold beside its workers: none for a stage that samples nothing."""
        return 0

    @property
    def reward_models_named(self) -> list[str]:
        """The reward models the stage's rewards name, as the recipe names them (a stage or a folder), each once."""
        return list(dict.fromkeys(r.model for r in self.sampled_rewards if r.model is not None))

    @property
    def judge_stages(self) -> list[str]:
        """The stages of the recipe the stage's judge rewards are served from (`judge: {stage: …}`)."""
        return sorted({r.judge.stage for r in self.sampled_rewards
                       if r.judge is not None and r.judge.stage is not None})

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainStageConfig:
        low, high = self.worker_range
        if not 1 <= low <= high:
            raise ValueError(f"num_workers must be >= 1, or [min, max] with 1 <= min <= max; got {self.num_workers}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds steps {self.steps}")
        if self.shard_size and low == high and low % self.shard_size:
            raise ValueError(f"shard_size {self.shard_size} must divide num_workers {low} (replicas of "
                             f"{self.shard_size} ranks each)")
        return self


class PretrainStage(TrainStageConfig):
    """Causal language modelling on the packed corpus (the pack stage's output)."""
    objective: Literal["pretrain"]
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    document_masking: bool = Field(
        True, description="positions restart at each document in a packed sequence and attention stays within the "
        "document")
    curriculum: CurriculumConfig | None = Field(
        None, description="scheduled source mix; default: every packed sequence equally likely")


class _DatasetStage(TrainStageConfig):
    dataset: str = Field(..., description="jsonl file or folder, relative to the recipe")
    seq_len: int | None = Field(None, ge=8, description="longest sequence (packed row for sft, prompt + answer "
                                "otherwise; longer ones keep their start, but a reward stage leaves out a pair with a "
                                "longer side); default model.max_position_embeddings")

    @property
    def data_path(self) -> str:
        return self.dataset

    @property
    def sequence_length(self) -> int | None:
        return self.seq_len


class SFTStage(_DatasetStage):
    """Supervised fine-tuning on conversations ({messages: [{role, content}]}), loss on the assistant's tokens."""
    objective: Literal["sft"]
    lr: float = Field(2e-5, gt=0, description="peak learning rate (TRL's SFT default)")


class JudgeRewardConfig(JudgeConfig):
    """An LLM judge as a reward, with the evaluation judge's prompt and 1–5 scale: an OpenAI-compatible model grades
    each completion's answer to its prompt against the rubric, and grade g gives the reward (g - 1) / 4. A call
    that still fails after its retries, or a reply without a readable grade, leaves that completion's reward missing:
    it is counted (`rewards/missing`) and gets advantage 0, and the step goes on. A judge that fails for every
    completion of a rollout (a wrong URL, model or key) stops the stage with its first error."""
    # the evaluation judge's fields (api_key_env, chat); reached at base_url, or at the server the pipeline starts
    # for `stage` while the sampled stage trains
    model: str | None = Field(None, description="the judge's model id at base_url (with stage: that stage's)")
    base_url: str | None = Field(None, description="the judge's OpenAI API base URL: a model `amalia serve` serves "
                                 "(http://127.0.0.1:8000/v1) or an external provider's")
    stage: str | None = Field(None, description="instead of base_url: an earlier train stage of the recipe that "
                              "generates (or 'base', the base model), served by Ray Serve + vLLM while this stage "
                              "trains, with the recipe's serve settings (its API key when serve.api_key_env is set)")
    rubric: str | None = Field(None, description="what the grade is for; default: the project's pt-PT rubric, "
                               "as the evaluation judge's (fluency and correctness in European Portuguese, its "
                               "variety, a fitting answer: core/judge.py)")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    timeout_s: float = Field(60, gt=0, description="per request")
    retries: int = Field(2, ge=0, description="retries of a request that fails for a transient reason")
    deadline_s: float = Field(600, gt=0, description="most time the judging of one rollout may take; a completion "
                              "not graded by then has its reward missing")

    @model_validator(mode="after")
    def _one_server(self) -> JudgeRewardConfig:
        if (self.base_url is None) == (self.stage is None):
            raise ValueError("a judge reward is reached at base_url or served from a stage of the recipe (stage), "
                             "exactly one of them")
        if self.base_url is not None and self.model is None:
            raise ValueError("a judge reward at base_url names its model (model: the model id there)")
        if self.stage is not None and (self.model is not None or self.api_key_env is not None):
            raise ValueError("a judge reward served from a stage takes that stage's model id and the recipe's serve "
                             "key: leave model and api_key_env out")
        return self


class RewardConfig(Strict):
    """One reward of a sampled stage and its weight: a rule by name, a trained reward model, or an LLM judge."""
    name: str | None = Field(None, description="a rule reward: format, exact_answer, has_number, pt_variety, or "
                             "module:function(completion, task) -> float")
    model: str | None = Field(None, description="a reward model: the name of an earlier reward stage (objective: "
                              "reward), or a HF sequence-classification checkpoint folder with one output (relative "
                              "to the recipe). Served by Ray Serve beside the stage while it samples (one replica: a "
                              "GPU of its own on GPU clusters, a CPU otherwise), completions scored in batches; its "
                              "score, unbounded, is the reward")
    judge: JudgeRewardConfig | None = Field(None, description="an LLM judge")
    weight: float = Field(1.0, description="the reward's weight in the sum a completion is scored by")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if sum(x is not None for x in (self.name, self.model, self.judge)) != 1:
            raise ValueError("a reward is a rule (name), a reward model (model) or an LLM judge (judge), exactly one "
                             "of them")
        return self

    @property
    def label(self) -> str:
        """How the reward's own metric is named (`rewards/<label>`)."""
        if self.name is not None:
            return self.name
        if self.model is not None:
            return f"model:{self.model}"
        return f"judge:{self.judge.stage if self.judge.stage is not None else self.judge.model}"


class _SampledStage(_DatasetStage):
    """Stages that sample completions from the model through a vLLM rollout engine and score them."""
    rewards: list[str | RewardConfig] = Field(
        ["format", "exact_answer"], min_length=1, description="what completions are scored by, summed with their "
        "weights: rule rewards by name (format, exact_answer, has_number, pt_variety, or module:function(completion, "
        "task) -> float), or objects {name | model: STAGE_OR_PATH | judge: {...}, weight}")
    reward_weights: list[float] | None = Field(None, description="weight of each reward named by a string "
                                               "(default all 1); rewards given as objects carry their own")
    variety_model: str | None = Field(None, description="the variety classifier the pt_variety reward scores "
                                      "completions with (a folder relative to the recipe, or `builtin`); null = "
                                      "the cue scorer")
    num_generations: int = Field(4, ge=2, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(64, ge=1, description="most tokens sampled per completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the vLLM rollout engine "
                                   "(max_model_len is the stage's seq_len)")

    def engine_gpus(self, use_gpu: bool) -> int:
        return self.rollout.gpus(use_gpu)

    @model_validator(mode="after")
    def _weights_match(self) -> _SampledStage:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"train stage '{self.name}': {len(self.reward_weights)} reward_weights for "
                             f"{len(self.rewards)} rewards")
        if self.reward_weights is not None and any(isinstance(r, RewardConfig) for r in self.rewards):
            raise ValueError(f"train stage '{self.name}': reward_weights weigh rewards given by name; a reward "
                             "given as an object carries its own weight")
        return self

    @property
    def sampled_rewards(self) -> list[RewardConfig]:
        return self.reward_sources

    @property
    def reward_sources(self) -> list[RewardConfig]:
        """Every reward as an object with its weight."""
        weights = self.reward_weights or [None] * len(self.rewards)
        return [r if isinstance(r, RewardConfig) else RewardConfig(name=r, weight=1.0 if w is None else w)
                for r, w in zip(self.rewards, weights)]


SAMPLING_FIELDS = frozenset(_SampledStage.model_fields) - frozenset(_DatasetStage.model_fields)


class DPOStage(_SampledStage):
    """Direct preference optimization: on {prompt, chosen, rejected} pairs, or (on_policy) on pairs the stage's
    initial model makes from task prompts, ranked by the rewards."""
    objective: Literal["dpo"]
    lr: float = Field(1e-6, gt=0, description="peak learning rate (TRL's DPO default)")
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference model")
    on_policy: bool = Field(False, description="make the pairs with the stage's initial model (AMALIA): dataset = "
                            "tasks; num_generations candidates per prompt sampled by the rollout engine, ranked by the "
                            "rewards (best = chosen, worst = rejected)")

    @property
    def sampled_rewards(self) -> list[RewardConfig]:
        return self.reward_sources if self.on_policy else []

    @model_validator(mode="after")
    def _sampling_needs_on_policy(self) -> DPOStage:
        given = sorted(f for f in SAMPLING_FIELDS if getattr(self, f) != DPOStage.model_fields[f].get_default(
            call_default_factory=True))
        if not self.on_policy and given:
            raise ValueError(f"train stage '{self.name}': {', '.join(given)} apply to on-policy dpo only (the pairs "
                             "are sampled); set on_policy: true, or remove them")
        return self


class GRPOStage(_SampledStage):
    """Group relative policy optimization (DeepSeek-R1) on task prompts, scored by rule rewards, reward models or LLM
    judges."""
    objective: Literal["grpo"]
    lr: float = Field(1e-6, gt=0, description="peak learning rate (TRL's GRPO default)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL penalty to the initial model (0: none, no "
                           "reference model held)")
    num_iterations: int = Field(1, ge=1, description="optimizer steps taken on each rollout (TRL's num_iterations, "
                                "μ): from the second on the policy has moved away from the one that sampled, and the "
                                "ratio of the two is clipped")
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO clip: the policy ratio is held to [1 - epsilon, "
                           "1 + epsilon_high] (acts once the policy is not the one that sampled: num_iterations > 1 "
                           "or async_rollout)")
    epsilon_high: float | None = Field(None, gt=0, description="upper clip (DAPO's clip-higher, e.g. 0.28); "
                                       "null = epsilon")
    async_rollout: bool = Field(False, description="one step off-policy: the next rollout is sampled while the "
                                "last step on the current one trains, with the weights that step starts from; the "
                                "policy ratio is then taken against the engine's own log-probabilities of what it "
                                "sampled, and clipped. On GPU it needs rollout.placement: separate")

    @model_validator(mode="after")
    def _groups_divide(self) -> GRPOStage:
        if self.global_batch_size % self.num_generations:
            raise ValueError(f"train stage '{self.name}': global_batch_size {self.global_batch_size} counts "
                             f"completions and must be a multiple of num_generations {self.num_generations}")
        return self


class RewardStage(_DatasetStage):
    """A reward model, as TRL's RewardTrainer trains one: the stage's starting model with a one-output score head
    (a transformers sequence classifier reading the last token that is not padding), trained with the Bradley–Terry
    loss -log σ(r(chosen) - r(rejected) - margin) on preference pairs ({prompt, chosen, rejected}, or {chosen,
    rejected} whole conversations or texts; an optional per-pair `margin`). Exported as a HF sequence-classification
    checkpoint (hf/), which sampled stages score completions with (`rewards: [{model: <this stage>}]`). It branches
    off the policy: a later stage with init_from previous starts from the policy stage before it, and the eval stage
    does not serve it (it does not generate)."""
    objective: Literal["reward"]
    lr: float = Field(1e-4, gt=0, description="peak learning rate (TRL's RewardTrainer default)")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="adds c × mean((r(chosen) + r(rejected))²) to the loss, pulling the rewards towards "
        "zero mean (TRL's center_rewards_coefficient; 0.01 in its docs); null: none")

    @model_validator(mode="after")
    def _whole_weights(self) -> RewardStage:
        if self.lora is not None:
            raise ValueError(f"train stage '{self.name}': LoRA on a reward stage is not available (the score head "
                             "would have to train beside the adapters); train every weight: remove lora")
        return self


TrainStage = Annotated[PretrainStage | SFTStage | DPOStage | GRPOStage | RewardStage,
                       Field(discriminator="objective")]
# objective -> its stage model, read off the models' `objective` literals: the names are written once, there
STAGE_TYPES: dict[str, type[TrainStageConfig]] = {
    get_args(model.model_fields["objective"].annotation)[0]: model for model in get_args(get_args(TrainStage)[0])}


def train_stage(fields: dict[str, Any]) -> TrainStageConfig:
    """A training stage from its fields, as the recipe's `train` list validates it (by `objective`)."""
    return TypeAdapter(TrainStage).validate_python(fields)
