"""The `eval` section of a recipe: the benchmark tasks and how they are scored, and the LLM judge."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from amalia_ray.core.config.strict import NAME_PATTERN, Strict
from amalia_ray.core.config.variety_config import VarietyScoring


TaskFormat = Literal["mcq", "pheb", "binary", "cloze", "judge", "variety", "answer", "euroeval"]
CHOICE_TASKS = ("mcq", "pheb", "binary", "euroeval")


TASK_REFERENCE = ("the name of one of eval.tasks; any other string is a task file or folder (relative to the "
                  "recipe; its format told by its fields, as `amalia eval --task` tells it); or a task of its own "
                  "{name, path, format} like eval.tasks")


class EvalTaskConfig(Strict):
    """One benchmark: a task file in one of the formats `amalia_ray/evals/tasks.py` reads."""
    name: str = Field(..., pattern=NAME_PATTERN, description="names the task in results and the report")
    path: str = Field(..., description="the task file or folder (JSON lines, JSON; euroeval: a `datasets` folder or "
                      "Parquet / Arrow / JSON file), relative to the recipe")
    format: TaskFormat = Field("mcq", description="the file's schema and how items are scored")
    method: Literal["loglik", "generate"] | None = Field(
        None, description="mcq / pheb / binary / euroeval: score the choices by log-likelihood (the default) or generate and "
        "extract the answer (a letter or \\boxed{}); the other formats always generate")
    chat: bool = Field(False, description="instruction-tuned models: generation through /v1/chat/completions; "
                       "log-likelihood over the context rendered by the served model's chat template (lm-eval's "
                       "apply_chat_template)")
    system_prompt: str | None = Field(None, description="chat tasks: the system turn before each prompt")
    max_tokens: int = Field(32, ge=1, description="generated tokens per item (generation, cloze, judge, variety)")
    limit: int | None = Field(None, ge=1, description="score only the first N items")
    n: int = Field(1, ge=1, le=256, description="answer tasks: samples per item; above 1 the task reports pass@1, "
                   "pass@n (the unbiased estimator) and maj@n (the most frequent answer) instead of exact_match")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of every generation (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of every generation")
    seed: int = Field(0, description="sampling seed: item i's request carries seed + i (recorded per item)")
    num_fewshot: int = Field(0, ge=0, description="answered examples before each item (log-likelihood choice "
                             "tasks), drawn as lm-eval draws them: per item in order, from one seeded generator")
    fewshot_path: str | None = Field(
        None, description="where the examples come from (a task file, or a dataset: its train split), relative to the "
        "recipe; default: the dataset's train split where it has one, else the task's own items (never the item "
        "itself)")
    fewshot_seed: int = Field(1234, description="the examples' random seed (lm-eval's default fewshot seed)")
    fewshot_as_multiturn: bool | None = Field(
        None, description="chat tasks: each example as a user turn and an assistant turn (the default with chat, as "
        "lm-eval's), or false: all in one user turn")

    @model_validator(mode="after")
    def _method(self) -> EvalTaskConfig:
        if self.method == "loglik" and self.format not in CHOICE_TASKS:
            raise ValueError(f"task '{self.name}': method 'loglik' applies to {', '.join(CHOICE_TASKS)} tasks, "
                             f"not '{self.format}'")
        if self.n > 1 and self.format != "answer":
            raise ValueError(f"task '{self.name}': n (samples per item) applies to answer tasks, not '{self.format}'")
        if self.system_prompt and not self.chat:
            raise ValueError(f"task '{self.name}': system_prompt applies to chat tasks (chat: true)")
        if self.fewshot_as_multiturn and not self.chat:
            raise ValueError(f"task '{self.name}': fewshot_as_multiturn applies to chat tasks")
        if self.num_fewshot and self.scoring != "loglik":
            raise ValueError(f"task '{self.name}': few-shot examples are implemented for log-likelihood choice tasks "
                             f"only (mcq, pheb, binary, euroeval scored by loglik), not yet for generation")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"task '{self.name}': n = {self.n} greedy samples would all be the same answer: "
                             "set a temperature above 0")
        return self

    @property
    def multiturn(self) -> bool:
        """Few-shot examples as turns of their own: lm-eval's default with a chat template."""
        return self.chat if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn

    @property
    def scoring(self) -> str:
        return self.method or ("loglik" if self.format in CHOICE_TASKS else "generate")


class JudgeConfig(Strict):
    """An LLM judge reached over the OpenAI API."""
    model: str = Field(..., description="model id of the judge: one of the run's served checkpoints, or a model "
                       "at base_url")
    base_url: str | None = Field(None, description="OpenAI API base URL of the judge; default: the run's own server")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="environment variable holding the judge's API key")
    chat: bool = Field(True, description="ask through /v1/chat/completions")
    max_tokens: int = Field(32, ge=1, description="tokens the judge's reply may take (a reasoning judge needs "
                            "hundreds): a reply cut there counts only with its \"Nota: N\"")
    rubric: str | None = Field(None, description="default rubric for items without their own; default: the "
                               "project's pt-PT rubric (fluency and correctness in European Portuguese, its variety, "
                               "a fitting answer: core/judge.py)")


class EvalConfig(Strict):
    """The eval stage: every task scored on every served checkpoint, over HTTP."""
    tasks: list[EvalTaskConfig] = Field(default_factory=list, description="the benchmarks")
    concurrency: int = Field(8, ge=1, description="requests in flight per task")
    prompts_per_request: int = Field(24, ge=1, description="log-likelihood scoring: prompts (each item's context and "
                                     "context+choice) sent in one request; an item's prompts always travel together")
    request_timeout_s: float = Field(120, gt=0, description="a request taking longer is retried, then fails the item")
    retries: int = Field(3, ge=0, description="retries of a request on a transient error (connection, 408/429/5xx)")
    judge: JudgeConfig | None = Field(None, description="the model that grades `judge` tasks")
    variety: VarietyScoring = Field(default_factory=VarietyScoring, description="how `variety` tasks score "
                                    "generations pt-PT / pt-BR")
    contamination_of: list[str] = Field(
        default_factory=list, description="training text each item is checked against (13-gram overlap): run "
        "folders (their curated corpus) or jsonl/Parquet corpora, relative to the recipe; `this_run` is this run's "
        "curated corpus. Results flag the items seen and score the unseen ones apart (scores_clean)")

    @model_validator(mode="after")
    def _judge(self) -> EvalConfig:
        if any(t.format == "judge" for t in self.tasks) and self.judge is None:
            raise ValueError("a 'judge' task needs eval.judge (the served model that grades the answers)")
        names = [t.name for t in self.tasks]
        if dup := sorted({n for n in names if names.count(n) > 1}):  # results are keyed by model and task name
            raise ValueError(f"eval.tasks: each name once; given more than once: {', '.join(dup)}")
        return self
