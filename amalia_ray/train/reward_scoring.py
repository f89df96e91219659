"""What a sampled stage (GRPO, on-policy DPO) scores its completions with: its rewards (`rewards:`), each a rule
(core/rewards.py, called per completion), a reward model (served by Ray Serve: every completion of a rollout sent
through the application's handle at once, and batched there) or an LLM judge (core/judge.py: every completion of a
rollout graded over HTTP, concurrently, with retries and a timeout). A score is missing (NaN) where a judge could not grade; the caller
leaves such a completion out of what it learns from and counts it, and the step goes on."""

from __future__ import annotations

import asyncio
import logging
import math
import os

import httpx
import torch

from amalia_ray.core.config import JudgeRewardConfig, RewardConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.judge import grade
from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.core.rewards import get_reward
from amalia_ray.core.secrets import remember

log = logging.getLogger("amalia_ray.train")


class RewardScorer:
    def __init__(self, sources: list[RewardConfig], variety_model: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, reward_apps: dict[str, str] | None = None,
                 judge_servers: dict[str, dict] | None = None):
        self.sources, self.transport = sources, transport  # transport: the judges' HTTP, replaced in tests
        self.labels = reward_labels(sources)
        self.weights = torch.tensor([r.weight for r in sources], dtype=torch.float32)
        self.rules = {i: get_reward(r.name, variety_model) for i, r in enumerate(sources) if r.name is not None}
        self.judges = {i: served_judge(r.judge, judge_servers or {}) for i, r in enumerate(sources)
                       if r.judge is not None}
        self.models = {i: r.model for i, r in enumerate(sources) if r.model is not None}
        if unserved := sorted({m for m in self.models.values() if m not in (reward_apps or {})}):
            raise AmaliaError(f"reward model(s) {unserved} are not served: a stage run by the pipeline has them "
                              "served beside it; run on its own, serve each (serve/reward_server.py `start`) and "
                              "pass reward_apps={model: application name}")
        self.reward_apps = dict(reward_apps or {})

    def score(self, prompts: list, completions: list[str], tasks: list[dict]) -> torch.Tensor:
        """(completions, rewards): each reward's score of each completion (of the prompt and task at the same
        index), NaN where a judge gave no grade."""
        out = torch.full((len(completions), len(self.sources)), math.nan, dtype=torch.float32)
        for i, fn in self.rules.items():
            out[:, i] = torch.tensor([float(fn(c, t)) for c, t in zip(completions, tasks)], dtype=torch.float32)
        for i, model in self.models.items():
            out[:, i] = torch.tensor(model_scores(self.reward_apps[model], prompts, completions), dtype=torch.float32)
        for i, judge in self.judges.items():
            grades = asyncio.run(judge_grades(judge, [question_of(p) for p in prompts], completions,
                                              [reference_of(t) for t in tasks], self.transport))
            out[:, i] = torch.tensor([math.nan if g is None else (g - 1) / 4 for g in grades], dtype=torch.float32)
        return out

    def totals(self, scores: torch.Tensor) -> torch.Tensor:
        """Each completion's weighted sum of its rewards; NaN where one with a weight is missing (a reward of
        weight 0 is only logged)."""
        counted = self.weights != 0
        return torch.where(counted | ~scores.isnan(), scores, 0.0) @ self.weights


def served_judge(judge: JudgeRewardConfig, servers: dict[str, dict]) -> JudgeRewardConfig:
    """A judge reward as it is reached: at its own base_url, or, served from a stage of the recipe, at the server
    the pipeline runs that stage on (`servers`: stage -> {base_url, model, api_key_env})."""
    if judge.stage is None:
        return judge
    if judge.stage not in servers:
        raise AmaliaError(f"the judge reward's stage '{judge.stage}' is not served: a stage run by the pipeline has "
                          "it served beside it; run on its own, serve it (`amalia serve`) and give the judge its "
                          "base_url and model instead")
    return judge.model_copy(update={**servers[judge.stage], "stage": None})


# how long a rollout's completions may wait for the reward model's scores
MODEL_TIMEOUT_S = 1800


def model_scores(app: str, prompts: list, completions: list[str]) -> list[float]:
    """The reward model served as the Serve application `app`: each (prompt, completion) sent as its own request at
    once, so the replica gathers them into batches; the scores in order. A reward model that fails stops the stage
    (it scores every completion: there is no partial answer to go on with)."""
    import time

    from ray import serve

    handle = serve.get_app_handle(app)
    pending = [handle.score.remote((p, c)) for p, c in zip(prompts, completions)]
    deadline = time.monotonic() + MODEL_TIMEOUT_S  # one for the whole rollout
    try:
        return [float(r.result(timeout_s=max(deadline - time.monotonic(), 0.0))) for r in pending]
    except Exception as e:  # noqa: BLE001 - Serve raises the replica's error, or a timeout
        raise AmaliaError(f"the reward model served as '{app}' failed to score the rollout: {type(e).__name__}: "
                          f"{e}") from None


async def judge_grades(cfg: JudgeRewardConfig, questions: list[str], answers: list[str],
                       references: list[str | None], transport: httpx.AsyncBaseTransport | None = None
                       ) -> list[int | None]:
    """The judge's grade (1–5) of every answer; None where the request failed after its retries, the reply held no
    readable grade, or the rollout's judging ran past `cfg.deadline_s`. A judge that fails for every answer is
    misconfigured (a wrong URL, model or key), not unlucky: that is an error naming its first failure."""
    key = None
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise AmaliaError(f"the judge reward's key variable {cfg.api_key_env} is not set where the stage trains "
                              "(its first worker's node)")
        remember(key)
    failures: list[str] = []

    async with OpenAIClient(cfg.base_url, cfg.model, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                            retries=cfg.retries, api_key=key, transport=transport) as judge:
        async def one(question: str, answer: str, reference: str | None) -> int | None:
            try:
                score, _ = await grade(judge, question, answer, rubric=cfg.rubric, reference=reference,
                                       chat=cfg.chat, max_tokens=cfg.max_tokens)
            # failed after its retries, refused, or answered with something that is not a completion
            except (AmaliaError, httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
                failures.append(f"{type(e).__name__}: {e}")
                return None
            return score

        tasks = [asyncio.ensure_future(one(q, a, r)) for q, a, r in zip(questions, answers, references)]
        done, late = await asyncio.wait(tasks, timeout=cfg.deadline_s) if tasks else (set(), set())
        for task in late:
            task.cancel()
        grades = [t.result() if t in done else None for t in tasks]
    if tasks and len(failures) == len(tasks):
        raise AmaliaError(f"the judge reward ({cfg.model} at {cfg.base_url}) failed for all {len(tasks)} "
                          f"completions of the rollout; the first: {failures[0]}")
    if failures or late:
        log.warning(f"judge reward {cfg.model}: {len(failures)} of {len(tasks)} completions not graded (the first: "
                    f"{failures[0] if failures else '-'}), {len(late)} past the {cfg.deadline_s:.0f} s deadline")
    return grades


def question_of(prompt) -> str:
    """What the judge reads as the question: the prompt, or its messages' text (each turn after its role)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def reference_of(task: dict) -> str | None:
    """The reference answer the judge is shown: the task's `reference`, else its `answer`, when it has one."""
    value = task.get("reference", task.get("answer"))
    return None if value is None else str(value)


def reward_labels(sources: list[RewardConfig]) -> list[str]:
    """Each reward's metric name (`rewards/<label>`): its name, `model:<model>` or `judge:<model>`, numbered when two
    share one."""
    labels = [r.label for r in sources]
    return [label if labels.count(label) == 1 else f"{label}#{labels[:i + 1].count(label)}"
            for i, label in enumerate(labels)]
