"""What a sampled stage (GRPO, on-policy DPO) scores its completions with: its rewards (`rewards:`), each a rule
(core/rewards.py, called per completion) or an LLM judge (core/judge.py: every completion of a rollout graded over
HTTP, concurrently, with retries and a timeout). A score is missing (NaN) where a judge could not grade; the caller
leaves such a completion out of what it learns from and counts it, and the step goes on."""

from __future__ import annotations

import asyncio
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


class RewardScorer:
    def __init__(self, sources: list[RewardConfig], variety_model: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.sources, self.transport = sources, transport  # transport: the judges' HTTP, replaced in tests
        self.labels = [r.label for r in sources]
        self.weights = torch.tensor([r.weight for r in sources], dtype=torch.float32)
        self.rules = {i: get_reward(r.name, variety_model) for i, r in enumerate(sources) if r.name is not None}
        self.judges = {i: r.judge for i, r in enumerate(sources) if r.judge is not None}

    def score(self, prompts: list, completions: list[str], tasks: list[dict]) -> torch.Tensor:
        """(completions, rewards): each reward's score of each completion (of the prompt and task at the same
        index), NaN where a judge gave no grade."""
        out = torch.full((len(completions), len(self.sources)), math.nan, dtype=torch.float32)
        for i, fn in self.rules.items():
            out[:, i] = torch.tensor([float(fn(c, t)) for c, t in zip(completions, tasks)], dtype=torch.float32)
        for i, judge in self.judges.items():
            grades = asyncio.run(judge_grades(judge, [question_of(p) for p in prompts], completions,
                                              [reference_of(t) for t in tasks], self.transport))
            out[:, i] = torch.tensor([math.nan if g is None else (g - 1) / 4 for g in grades], dtype=torch.float32)
        return out

    def totals(self, scores: torch.Tensor) -> torch.Tensor:
        """Each completion's weighted sum of its rewards; NaN where one of them is missing."""
        return scores @ self.weights


async def judge_grades(cfg: JudgeRewardConfig, questions: list[str], answers: list[str],
                       references: list[str | None], transport: httpx.AsyncBaseTransport | None = None
                       ) -> list[int | None]:
    """The judge's grade (1–5) of every answer, None where the request failed after its retries or the reply held
    no readable grade."""
    key = None
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise AmaliaError(f"the judge reward's key variable {cfg.api_key_env} is not set where the stage trains "
                              "(its first worker's node)")
        remember(key)

    async with OpenAIClient(cfg.base_url, cfg.model, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                            retries=cfg.retries, api_key=key, transport=transport) as judge:
        async def one(question: str, answer: str, reference: str | None) -> int | None:
            try:
                score, _ = await grade(judge, question, answer, rubric=cfg.rubric, reference=reference,
                                       chat=cfg.chat)
            except AmaliaError:  # failed after its retries, or refused: this completion's reward is missing
                return None
            return score

        return list(await asyncio.gather(*(one(q, a, r) for q, a, r in zip(questions, answers, references))))


def question_of(prompt) -> str:
    """What the judge reads as the question: the prompt, or its messages' text (each turn after its role)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def reference_of(task: dict) -> str | None:
    """The reference answer the judge is shown: the task's `reference`, else its `answer`, when it has one."""
    value = task.get("reference", task.get("answer"))
    return None if value is None else str(value)
