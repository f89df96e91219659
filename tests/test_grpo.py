"""GRPO pieces without Ray: rewards, the arithmetic task set, group advantages equal to TRL's GRPOTrainer for the same
rewards, and the clipped-ratio loss with its KL term."""

import math

import pytest
import torch

from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
from amalia_ray.train.objectives.grpo import group_advantages, policy_loss
from amalia_ray.core.formats.rl_tasks import read_tasks
from amalia_ray.core.rewards import exact_answer_reward, format_reward, get_reward


def test_format_reward_wants_think_then_answer():
    assert format_reward("<think>12 + 30 = 42</think> <answer>42</answer>", {}) == 1.0
    assert format_reward("<think>x</think>\n<answer>42</answer>\n", {}) == 1.0
    assert format_reward("A resposta é 42.", {}) == 0.0
    assert format_reward("<answer>42</answer><think>x</think>", {}) == 0.0
    assert format_reward("<think>x</think> <answer>42</answer> e mais texto", {}) == 0.0


@pytest.mark.parametrize("completion,answer,expected", [
    ("<think>…</think><answer>42</answer>", "42", 1.0),
    ("<think>…</think><answer> 42 euros</answer>", "42", 1.0),
    ("<think>41?</think><answer>41</answer>", "42", 0.0),
    ("São 1.234 pessoas", "1234", 1.0),  # pt-PT thousands separator
    ("metade: 2,5", "2.5", 1.0),  # decimal comma
    ("nenhum número", "3", 0.0),
    ("primeiro 3, depois 7", "7", 1.0),  # without tags: the last number
])
def test_exact_answer_reward_compares_numbers(completion, answer, expected):
    assert exact_answer_reward(completion, {"answer": answer}) == expected


def test_rewards_by_name_or_import():
    assert get_reward("format") is format_reward
    assert get_reward("amalia_ray.core.rewards:exact_answer_reward") is exact_answer_reward
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_arithmetic_tasks_are_deterministic_and_right():
    tasks = arithmetic_tasks(300, seed=7)
    assert tasks == arithmetic_tasks(300, seed=7) and tasks != arithmetic_tasks(300, seed=8)
    assert {t["kind"] for t in tasks} == {"add", "sub", "mul", "div"}
    for t in tasks:
        question = t["prompt"][0]["content"]
        numbers = [int(x) for x in __import__("re").findall(r"\d+", question.split("\n")[0])]
        a, b = numbers[0], numbers[-1]
        expected = {"add": a + b, "sub": a - b, "mul": a * b, "div": a // b}[t["kind"]]
        if t["kind"] == "div":
            assert a % b == 0
        assert t["answer"] == str(expected) and int(t["answer"]) >= 0, t


def test_bad_task_rows_name_file_and_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "Quanto é 1 + 1?", "answer": "2"}\n{"answer": "3"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: field 'prompt'"):
        read_tasks(f)


def test_group_advantages_equal_trl(tmp_path):
    """TRL's GRPOTrainer scores and normalizes the same rewards (two weighted reward functions, groups of 4,
    including a group where every completion scores the same) through its own code path."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    G, prompts = 4, 3
    first = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, -1.0, 0.25, 3.0]
    second = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.0]
    weights = [1.0, 0.5]

    def reward_a(completions, **kwargs):
        return first[:len(completions)]

    def reward_b(completions, **kwargs):
        return second[:len(completions)]

    tok = AutoTokenizer.from_pretrained(str(_tiny_tokenizer(tmp_path)))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, per_device_train_batch_size=G * prompts,
                      max_completion_length=4, report_to=[], use_cpu=True, bf16=False, reward_weights=weights)
    rows = [{"prompt": f"Quanto é {i} + {i}?"} for i in range(prompts)]
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_a, reward_b], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows))
    inputs = [rows[i // G] for i in range(G * prompts)]  # TRL's sampler repeats each prompt G times in a row
    trl_advantages = trainer._generate_and_score_completions(inputs)["advantages"]

    rewards = torch.tensor([first, second]).T @ torch.tensor(weights)
    ours = group_advantages(rewards, G)
    assert torch.allclose(ours, trl_advantages.float(), atol=1e-6), (ours, trl_advantages)
    assert torch.all(ours[4:8] == 0)  # a group with one reward value teaches nothing


def _tiny_tokenizer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from amalia_ray.core.config import TokenizerConfig
    from amalia_ray.data.tokenize.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"text": [t["prompt"][0]["content"] for t in arithmetic_tasks(200, 0)]}),
                   corpus / "part.parquet")
    train_tokenizer(corpus, tmp_path / "tok", TokenizerConfig(vocab_size=400))
    return tmp_path / "tok"


def test_policy_loss_and_k3_kl():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    advantages = torch.tensor([2.0])
    loss, kl, _ = policy_loss(logps, advantages)
    assert kl is None and torch.allclose(loss, torch.tensor([[-2.0, -2.0]]))
    loss.sum().backward()
    assert torch.allclose(logps.grad, torch.tensor([[-2.0, -2.0]]))  # on-policy: gradient of -A·log p

    # k3 = exp(ref - logp) - (ref - logp) - 1: zero at the reference, positive elsewhere
    logps = torch.tensor([[-1.0, -1.0]])
    _, kl, _ = policy_loss(logps, torch.tensor([0.0]), torch.tensor([[-1.0, -2.0]]), kl_coef=0.1)
    assert kl[0, 0] == 0 and torch.isclose(kl[0, 1], torch.tensor(math.exp(-1.0) + 1.0 - 1.0))


def _kl_both_ways(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from amalia_ray.train.completions import pad_completions, token_logps
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    sharded = build(AutoConfig.from_pretrained(folder), cpu, lambda m: apply_fsdp(m, "fp32", False),
                    init_dir=Path(folder), seed=0).requires_grad_(False).eval()
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(rank)
    batch = pad_completions([(torch.randint(3, 500, (6,)).tolist(), torch.randint(3, 500, (9,)).tolist())
                             for _ in range(3)], 0, 32)
    policy = torch.randn(3, batch["input_ids"].size(1) - 1) * 0.1 - 5.0
    with torch.no_grad():
        kls = [policy_loss(policy, torch.ones(3), token_logps(ref, batch), 0.05)[1]
               for ref in (sharded, whole)]
    sharded.reshard()  # what GRPO does after each reference pass: FSDP2 leaves the root gathered after a forward
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "max_diff": (kls[0] - kls[1]).abs().max().item(), "kl": kls[1].mean().item(),
        "shard_rows": sharded.model.embed_tokens.weight.to_local().shape[0]}))
    dist.destroy_process_group()


def test_the_sharded_reference_gives_the_kl_of_an_unsharded_one(tmp_path):
    """GRPO's KL reference is built and sharded over the workers like the policy (each holds part of it), and
    its k3 KL equals that of a whole unsharded copy on every rank."""
    import json

    import torch.multiprocessing as mp

    from tests.base_models import make_base_model
    from tests.conftest import free_port

    folder = make_base_model(tmp_path / "model", "llama", with_tokenizer=False)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_kl_both_ways, args=(2, free_port(), str(folder), str(out)), nprocs=2)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["max_diff"] < 1e-5 and got["kl"] > 0, got
        assert got["shard_rows"] == vocab // 2, "each rank holds half of the reference"


def test_a_missing_reward_is_left_out_of_its_group_and_teaches_nothing():
    nan = float("nan")
    rewards = torch.tensor([1.0, 0.0, nan, 0.5, 2.0, 2.0, 1.0, 0.0])
    advantages = group_advantages(rewards, 4)
    present = torch.tensor([1.0, 0.0, 0.5])
    assert advantages[2] == 0.0
    assert torch.allclose(advantages[[0, 1, 3]], (present - present.mean()) / (present.std() + 1e-4))
    assert torch.allclose(advantages[4:], group_advantages(rewards[4:], 4)), "a group without a missing reward as TRL"


def test_judge_rewards_grade_over_http_and_a_judge_that_fails_leaves_the_reward_missing(monkeypatch):
    """An LLM judge reward (the evaluation judge's prompt and 1–5 scale, (g - 1) / 4) beside a rule reward: the judge
    is shown the question and the reference answer and sent its key; a judge that keeps failing or replies without
    a grade leaves that completion's reward missing (NaN), and scoring goes on."""
    import json

    import httpx

    from amalia_ray.core.config import train_stage
    from amalia_ray.train.reward_scoring import RewardScorer

    asked = []

    def judge(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][-1]["content"]
        asked.append((text, request.headers.get("authorization")))
        if "falha" in text:
            return httpx.Response(503, text="overloaded")
        reply = "Não sei avaliar." if "confuso" in text else "Nota: 4"
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": reply}}]})

    stage = train_stage({"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 20, "rewards": [
        "has_number", {"judge": {"base_url": "http://judge.test/v1", "model": "juiz", "retries": 1,
                                 "api_key_env": "JUDGE_KEY"}, "weight": 2.0}]})
    monkeypatch.setenv("JUDGE_KEY", "judge-key-0123")
    scorer = RewardScorer(stage.reward_sources, transport=httpx.MockTransport(judge))
    scores = scorer.score(["Quanto é 2 + 2?", [{"role": "user", "content": "Diz olá"}], "Outra"],
                          ["<think>2 e 2</think> <answer>4</answer>", "falha", "confuso"],
                          [{"answer": "4"}, {}, {}])
    assert scorer.labels == ["has_number", "judge:juiz"]
    assert scores[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert scores[0, 1] == 0.75 and scores[1:, 1].isnan().all()
    totals = scorer.totals(scores)
    assert totals[0] == 1.0 + 2 * 0.75 and totals[1:].isnan().all()
    first = next(text for text, _ in asked if "Quanto é 2 + 2?" in text)
    assert "Resposta de referência: 4" in first and "Resposta a avaliar: 4" in first, "the final answer is graded"
    assert all(auth == "Bearer judge-key-0123" for _, auth in asked)
    assert sum("falha" in text for text, _ in asked) == 2, "retried once, then missing"


def test_rewards_are_names_or_objects_of_one_source_each():
    from pydantic import ValidationError

    from amalia_ray.core.config import train_stage

    fields = {"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 20}
    stage = train_stage({**fields, "rewards": ["format", "exact_answer"], "reward_weights": [0.5, 1.0]})
    assert [(r.label, r.weight) for r in stage.reward_sources] == [("format", 0.5), ("exact_answer", 1.0)]
    assert train_stage({**fields, "rewards": [{"model": "rm-stage"}]}).reward_sources[0].label == "model:rm-stage"
    for two in [{"name": "format", "judge": {"base_url": "http://j/v1", "model": "j"}},
                {"name": "format", "model": "rm"}, {}]:
        with pytest.raises(ValidationError, match="exactly one of them"):
            train_stage({**fields, "rewards": [two]})
    with pytest.raises(ValidationError, match="carries its own weight"):
        train_stage({**fields, "rewards": ["format", {"name": "has_number"}], "reward_weights": [1, 2]})


def test_a_judge_that_fails_every_completion_stops_the_stage_and_one_only_logged_drops_none():
    import httpx

    from amalia_ray.core.config import train_stage
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.train.reward_scoring import RewardScorer

    judge = {"base_url": "http://judge.test/v1", "model": "juiz", "retries": 0}
    stage = train_stage({"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 20, "rewards": [
        "has_number", {"judge": judge, "weight": 0.0}, {"judge": {**judge, "rubric": "outra"}}]})
    refused = RewardScorer(stage.reward_sources, transport=httpx.MockTransport(
        lambda request: httpx.Response(401, text="bad key")))
    assert refused.labels == ["has_number", "judge:juiz#1", "judge:juiz#2"], "two judges of one model, two metrics"
    with pytest.raises(AmaliaError, match=r"failed for all 2 completions of the rollout; the first: .*401"):
        refused.score(["q", "q"], ["1", "2"], [{}, {}])
    scores = torch.tensor([[1.0, float("nan"), 0.5], [0.0, float("nan"), float("nan")]])
    assert refused.totals(scores)[0] == 1.5 and refused.totals(scores)[1].isnan(), "a weight-0 reward only logs"
