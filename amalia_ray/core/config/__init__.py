"""The recipe: pydantic models for the whole pipeline, mirrored 1:1 by the YAML files under `recipes/`, one module
per section (run_config, data_config, model_config, train_config, serve_config, eval_config; variety_config shared by
data and eval; strict, the base of them all) and the `Recipe` that ties them together, here. Everything is
importable from `amalia_ray.core.config`.

This package imports nothing else of ours, so every layer can depend on it. Loading and error formatting (YAML path,
line, allowed values) live in `core/recipe.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

# every section's models, importable from here
from amalia_ray.core.config.strict import NAME_PATTERN, Strict
from amalia_ray.core.config.run_config import (
    AccountingConfig, PlanConfig, ResourcesConfig, RunConfig, TrackingConfig, WandbConfig)
from amalia_ray.core.config.variety_config import VarietyScoring
from amalia_ray.core.config.data_config import (
    CleaningConfig, DataConfig, DecontaminationConfig, DEFAULT_CHAT_TEMPLATE, FineWebConfig, GopherQualityConfig,
    GopherRepetitionConfig, KEEP_RULES, KeepRule, LanguageConfig, NearDedupConfig, PackConfig, QualityConfig,
    SiteBoilerplateConfig, SourceConfig, TokenizerConfig, VarietyConfig)
from amalia_ray.core.config.eval_config import (
    CHOICE_TASKS, EvalConfig, EvalTaskConfig, JudgeConfig, TASK_REFERENCE, TaskFormat)
from amalia_ray.core.config.model_config import DIMENSIONS, ModelConfig
from amalia_ray.core.config.serve_config import EngineConfig, ServeConfig
from amalia_ray.core.config.train_config import (
    checkpoint_interval, CurriculumConfig, DPOStage, ENGINE_MAX_SEQS, GRPOStage, JudgeRewardConfig, LoraConfig,
    LOSS_CHUNK_POSITIONS, MixPhase, PretrainStage, ProxyConfig, RewardConfig, RewardStage, RolloutConfig,
    SAMPLING_FIELDS, SFTStage, STAGE_TYPES, train_stage, TrainStage, TrainStageConfig)

__all__ = [
    "AccountingConfig", "checkpoint_interval", "CHOICE_TASKS", "CleaningConfig", "CurriculumConfig", "DataConfig",
    "DecontaminationConfig", "DEFAULT_CHAT_TEMPLATE", "DIMENSIONS", "DPOStage", "ENGINE_MAX_SEQS", "EngineConfig",
    "EvalConfig", "EvalTaskConfig", "FineWebConfig", "GopherQualityConfig", "GopherRepetitionConfig", "GRPOStage",
    "JudgeConfig", "JudgeRewardConfig", "KEEP_RULES", "KeepRule", "LanguageConfig", "LoraConfig", "LOSS_CHUNK_POSITIONS", "MixPhase",
    "ModelConfig", "NAME_PATTERN", "NearDedupConfig", "PackConfig", "PlanConfig", "PretrainStage", "ProxyConfig",
    "QualityConfig", "Recipe", "ResourcesConfig", "RewardConfig", "RewardStage", "RolloutConfig", "RunConfig", "SAMPLING_FIELDS",
    "ServeConfig", "SFTStage", "SiteBoilerplateConfig", "SourceConfig", "STAGE_TYPES", "Strict", "TASK_REFERENCE",
    "TaskFormat", "TokenizerConfig", "TrackingConfig", "train_stage", "TrainStage", "TrainStageConfig", "VarietyConfig",
    "VarietyScoring", "WandbConfig",
]


class Recipe(Strict):
    run: RunConfig = RunConfig()
    resources: ResourcesConfig = ResourcesConfig()
    data: DataConfig
    tokenizer: TokenizerConfig | None = Field(
        None, description="the tokenizer stage; defaults apply when the recipe trains, and a recipe without train "
        "stages runs it only when this section (or pack) is given")
    pack: PackConfig | None = Field(
        None, description="the pack stage; defaults apply when the recipe trains, and a recipe without train stages "
        "runs it only when this section is given")
    model: ModelConfig = ModelConfig()
    train: list[TrainStage] = Field(
        default_factory=list, description="the training stages, in order; each starts from the previous one's "
        "checkpoint unless init_from: scratch (a reward stage branches off: the stage after it starts from the one "
        "before it); none: a curation recipe (data, and tokenizer/pack when given)")
    serve: ServeConfig = ServeConfig()
    eval: EvalConfig = EvalConfig()
    plan: PlanConfig = PlanConfig()
    accounting: AccountingConfig = AccountingConfig()
    tracking: TrackingConfig = TrackingConfig()
    provenance: list[dict[str, Any]] = Field(
        default_factory=list, description="where promoted values came from (written by `amalia promote`: sweep id, "
        "stage, winning values and their metric, the proxy); copied into the run manifest")

    @model_validator(mode="before")
    @classmethod
    def _data_stages(cls, data: Any) -> Any:
        """Training reads packed tokens, so a recipe that trains has a tokenizer and a pack stage (defaults unless
        given); packing needs a tokenizer too."""
        if isinstance(data, dict):
            wanted = ("tokenizer", "pack") if data.get("train") else ("tokenizer",) if data.get("pack") is not None \
                else ()
            data = {**data, **{k: {} for k in wanted if data.get(k) is None}}
        return data

    @property
    def data_stages(self) -> list[str]:
        return ["data", *(["tokenizer"] if self.tokenizer else []), *(["pack"] if self.pack else [])]

    def key_variables(self) -> list[str]:
        """The environment variables the recipe's LLM judges read their API keys from (eval.judge, judge rewards)."""
        judges = [*([self.eval.judge] if self.eval.judge else []),
                  *(r.judge for s in self.train for r in s.sampled_rewards if r.judge)]
        return [j.api_key_env for j in judges if j.api_key_env]

    def previous_policy(self, i: int) -> int | None:
        """The stage whose weights train stage i starts from with init_from previous: the nearest earlier stage that
        is not a reward model (a reward stage branches off the policy); None: the base model, or random weights."""
        return next((j for j in range(i - 1, -1, -1) if self.train[j].objective != "reward"), None)

    def names_base_model(self, name: str) -> bool:
        """Whether `name` (a served engine, a judge's stage) is the base model: 'base' in a recipe that has one
        (model.from, and then no stage may be named 'base'); without one, 'base' may be a stage's name."""
        return name == "base" and bool(self.model.base)

    def starts_from_checkpoint(self, i: int) -> bool:
        """Whether train stage i starts from weights that exist before it: the previous policy stage's, or the base
        model's (else it starts from random weights)."""
        return self.train[i].init_from == "previous" and (self.previous_policy(i) is not None or bool(self.model.base))

    def served_engines(self) -> dict[str, list[str]]:
        """What the pipeline serves (the eval stage all of it, a sampling stage its judges), by name: the checkpoints
        that get a vLLM engine each ('base': the base model, so the report shows what each stage changed; and every
        policy stage trained in full; not the reward models)
        -> the LoRA stages whose adapters run on that engine, the one of the checkpoint each was trained from. A LoRA
        stage is served in full (its merged export) instead when a later LoRA stage was trained on its merged weights
        (that one's adapter needs them as its engine) or when vLLM cannot serve its adapter (modules_to_save, or no
        starting checkpoint to run on: random initial weights)."""
        previous = [self.previous_policy(i) for i in range(len(self.train))]
        as_adapter = [s.adapter_servable(self.starts_from_checkpoint(i)) for i, s in enumerate(self.train)]
        for j in range(len(self.train)):
            if as_adapter[j] and previous[j] is not None:
                as_adapter[previous[j]] = False
        engines: dict[str, list[str]] = {"base": []} if self.model.base else {}
        for i, stage in enumerate(self.train):
            if stage.objective == "reward":  # a reward model scores text; it does not generate
                continue
            if as_adapter[i]:  # its start is an engine already: an earlier stage served in full, or the base model
                engines[self.train[previous[i]].name if previous[i] is not None else "base"].append(stage.name)
            else:
                engines[stage.name] = []
        return engines

    def engine_serving(self, name: str) -> str:
        """The engine (a key of served_engines) that serves stage `name` ('base': the base model): its own, or the
        one its adapter runs on."""
        engines = self.served_engines()
        if name in engines:
            return name
        if (engine := next((e for e, adapters in engines.items() if name in adapters), None)) is None:
            raise ValueError(f"'{name}' is not served: served are {sorted(engines)} and the LoRA stages on them, "
                             "not the reward models")
        return engine

    @property
    def policy_stages(self) -> list:
        """The stages that train a generating model (every one but the reward models): what the eval stage serves."""
        return [s for s in self.train if s.objective != "reward"]

    @model_validator(mode="after")
    def _stages(self) -> Recipe:
        if self.eval.tasks and not self.policy_stages and not self.model.base:
            raise ValueError("eval.tasks: nothing to evaluate: the recipe has no train stages (but reward models, "
                             "which do not generate) and no base model (model.from)")
        names = [s.name for s in self.train]
        if len(set(names)) != len(names):
            raise ValueError(f"train stage names must be unique, got {names}")
        reserved = {"data", "tokenizer", "pack", "serve", "eval", "report", "hub"}  # hub: the staged base model
        if clash := reserved.intersection(names):
            raise ValueError(f"train stage names {sorted(clash)} clash with pipeline stages {sorted(reserved)}")
        if unknown := set(self.plan.reported_gpu_hours) - set(names):
            raise ValueError(f"plan.reported_gpu_hours names unknown train stage(s) {sorted(unknown)}; "
                             f"stages: {names}")
        if unknown := set(self.plan.reported_rollout_s) - {s.name for s in self.train if s.objective == "grpo"}:
            raise ValueError(f"plan.reported_rollout_s names train stage(s) {sorted(unknown)} that are not GRPO "
                             f"stages (the ones with rollouts); stages: {names}")
        if self.model.base and self.tokenizer and self.tokenizer.from_ != "model":
            raise ValueError("model.from starts from a base model, whose embeddings fit its own tokenizer: set "
                             "tokenizer: {from: model}")
        if self.tokenizer and self.tokenizer.from_ == "model" and not self.model.base:
            raise ValueError("tokenizer.from: model needs a base model (model.from)")
        if self.model.base and "base" in names:
            raise ValueError("train stage name 'base' is taken by the base model (model.from) in serving and reports")
        if self.model.base:
            for stage in self.train:
                if stage.proxy.model:
                    raise ValueError(f"train stage '{stage.name}': proxy.model resizes a new model; a base model's "
                                     "dimensions are fixed (model.from)")
        for stage in self.train:
            if stage.proxy.model:
                try:
                    ModelConfig.model_validate({**self.model.model_dump(), **stage.proxy.model})
                except ValueError as e:
                    raise ValueError(f"train stage '{stage.name}': proxy.model does not make a valid model: {e}") from None
        for i, stage in enumerate(self.train):
            if not stage.lora:
                continue
            if stage.lora.merge:
                continue
            for j in range(i + 1, len(self.train)):
                if self.train[j].init_from == "previous" and self.previous_policy(j) == i:
                    raise ValueError(f"train stage '{self.train[j].name}' starts from '{stage.name}', a LoRA stage: "
                                     f"set lora.merge: true on '{stage.name}' so it exports the merged weights")
            judge_of = [later.name for later in self.train[i + 1:] if stage.name in later.judge_stages]
            if not self.eval.tasks and not judge_of:
                continue
            # served as an adapter on the engine of the weights it was trained from (see served_engines), to be
            # evaluated or to judge a later stage's samples
            if stage.adapter_servable(self.starts_from_checkpoint(i)):
                continue
            why = f"(it judges stage(s) {', '.join(judge_of)})" if judge_of else "(the eval stage serves it)"
            if not stage.lora.adapters_only:
                raise ValueError(f"train stage '{stage.name}': vLLM's LoRA engine cannot serve an adapter with "
                                 f"modules_to_save {why}; set lora.merge: true to serve the merged weights")
            raise ValueError(f"train stage '{stage.name}': its adapters train on random initial weights, which "
                             f"no engine serves {why}; set lora.merge: true to serve the merged weights")
        for i, stage in enumerate(self.train):
            for reward in stage.sampled_rewards:
                judged_by = reward.judge.stage if reward.judge else None
                if judged_by is not None and not self.names_base_model(judged_by) and (
                        judged_by not in names[:i] or self.train[names.index(judged_by)].objective == "reward"):
                    raise ValueError(f"train stage '{stage.name}': a judge reward's stage '{judged_by}' is not an "
                                     "earlier stage that generates (nor 'base' with a base model): a judge served "
                                     "from the recipe is one of its policy stages before this one")
                if reward.model in names and (names.index(reward.model) >= i
                                              or self.train[names.index(reward.model)].objective != "reward"):
                    raise ValueError(f"train stage '{stage.name}': rewards model '{reward.model}' names a train stage "
                                     "that is not a reward stage before it (objective: reward); a reward model is "
                                     "an earlier reward stage or a checkpoint folder")
        sources = {s.name for s in self.data.sources}
        for stage in self.train:
            curriculum = stage.curriculum if isinstance(stage, PretrainStage) else None
            for phase in (curriculum.phases if curriculum else []):
                if unknown := set(phase.weights) - sources:
                    raise ValueError(f"train stage '{stage.name}': curriculum names unknown source(s) "
                                     f"{sorted(unknown)}; data.sources are {sorted(sources)}")
        # a base model's positions limit comes from its config.json, checked once the model is at hand
        if self.pack and not self.model.base and self.pack.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"pack.seq_len {self.pack.seq_len} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}"
            )
        return self
