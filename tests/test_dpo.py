"""DPO: preference data checks, TRL-compatible tokenization, loss and reward metrics equal to TRL's DPOTrainer on the
same tiny models and batch, and pairs made from the Debian FAQ."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from amalia_ray.core.config import TokenizerConfig
from amalia_ray.data.posttrain.faq_chats import faq_conversations, mismatched_answer_pairs
from amalia_ray.data.tokenize.tokenizer import train_tokenizer
from amalia_ray.train.objectives.dpo import DPO
from amalia_ray.core.formats.preference_pairs import read_preferences
from amalia_ray.train.objectives.dpo import encode_pair

FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")


@pytest.fixture(scope="module")
def faq():
    if not FAQ.exists():
        pytest.skip("debian-faq-pt not installed (make corpus)")
    return faq_conversations(gzip.open(FAQ, "rt", encoding="utf-8").read())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, faq):
    from transformers import AutoTokenizer

    corpus = tmp_path_factory.mktemp("corpus")
    texts = [m["content"] for c in faq for m in c["messages"]]
    pq.write_table(pa.table({"text": texts}), corpus / "part.parquet")
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus, out, TokenizerConfig(vocab_size=1000))
    return AutoTokenizer.from_pretrained(str(out)), out


def tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512))


def test_pairs_from_faq_reject_another_questions_answer(faq):
    pairs = mismatched_answer_pairs(faq, seed=3)
    assert len(pairs) == len(faq) and pairs == mismatched_answer_pairs(faq, seed=3)
    answers = {(json.dumps(c["messages"][:-1]), c["messages"][-1]["content"]) for c in faq}
    for p in pairs:
        assert (json.dumps(p["prompt"]), p["chosen"][0]["content"]) in answers
        assert p["rejected"][0]["content"] != p["chosen"][0]["content"]
        assert p["rejected"][0]["content"] in {a for _, a in answers}


def test_bad_preference_rows_name_file_line_and_field(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": ""}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: field 'chosen'"):
        read_preferences(f)
    f.write_text('{"prompt": [{"role": "user", "content": "q"}], "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: .*all be strings or all be messages"):
        read_preferences(f)
    f.write_text('not json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: not JSON"):
        read_preferences(f)


def test_completion_is_what_the_answer_adds_after_the_prompt(tokenizer):
    tok, _ = tokenizer
    conversational = encode_pair(tok, {"prompt": [{"role": "user", "content": "Olá?"}],
                                       "chosen": [{"role": "assistant", "content": "Bom dia."}],
                                       "rejected": [{"role": "assistant", "content": "Não."}]})
    assert tok.decode(conversational.chosen) == "Bom dia.<|end|>\n"
    assert tok.decode(conversational.prompt).endswith("<|assistant|>\n")
    standard = encode_pair(tok, {"prompt": "Pergunta:\n", "chosen": "sim", "rejected": "não"})
    assert tok.decode(standard.rejected) == "não" + tok.eos_token and standard.clean_split
    merged = encode_pair(tok, {"prompt": "Pergunta: ", "chosen": "sim", "rejected": "não"})
    assert not merged.clean_split  # " sim" is one token: flagged, split as TRL splits it


@pytest.mark.parametrize("conversational", [True, False])
def test_dpo_loss_and_rewards_equal_trl(tokenizer, faq, tmp_path, conversational):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok, tok_dir = tokenizer
    rows = mismatched_answer_pairs(faq[:12], seed=1)
    if not conversational:
        rows = [{"prompt": r["prompt"][0]["content"] + "\n", "chosen": r["chosen"][0]["content"],
                 "rejected": r["rejected"][0]["content"]} for r in rows]
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    seq_len, beta = 192, 0.3

    reference, policy = tiny_llama(len(tok), seed=0), tiny_llama(len(tok), seed=1)
    ours = DPO(data, tok_dir, seq_len, beta, validation_fraction=0.0)
    assert len(ours.pairs["train"]) == len(rows) and ours.dropped == 0
    ours.prepare(reference, micro=5, rank=0, world=1, device=torch.device("cpu"))
    batch = ours.batch(torch.arange(len(rows)).numpy())
    with torch.no_grad():
        loss_sum, n = ours.loss(policy, batch)
    ours_metrics = {k: s / c for k, (s, c) in ours.take_metrics().items()}

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, max_length=seq_len, report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(rows), bf16=False)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list(rows))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    assert torch.equal(trl_batch["input_ids"], batch["input_ids"][:, :trl_batch["input_ids"].shape[1]])
    with torch.no_grad():
        trl_loss = trainer.compute_loss(policy, trl_batch)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}

    assert n == len(rows)
    assert abs(loss_sum.item() / n - trl_loss.item()) < 1e-4
    assert abs(loss_sum.item() / n - 0.6931) > 1e-3  # policy differs from the reference: a real comparison
    for key in DPO.REWARDS:
        assert abs(ours_metrics[key] - trl_metrics[key]) < 1e-4, key


def _fixed_pairs(tok_dir, faq, tmp_path) -> DPO:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mismatched_answer_pairs(faq[:4], 0)))
    return DPO(data, tok_dir, seq_len=256, beta=0.1, validation_fraction=0.0)


def _train(dpo: DPO, model, lr: float, steps: int) -> list[dict]:
    """The objective in a plain loop on all its pairs at every step: each step's loss and metrics."""
    dpo.prepare(model, micro=4, rank=0, world=1, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rows = torch.arange(len(dpo.pairs["train"])).numpy()
    history = []
    for _ in range(steps):
        loss_sum, n = dpo.loss(model, dpo.batch(rows))
        (loss_sum / n).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append({k: s / c for k, (s, c) in dpo.take_metrics().items()} | {"loss": loss_sum.item() / n})
    return history


def test_dpo_training_separates_chosen_from_rejected(tokenizer, faq, tmp_path):
    """The objective in a plain loop: on a few fixed pairs the policy learns to prefer each chosen answer."""
    tok, tok_dir = tokenizer
    history = _train(_fixed_pairs(tok_dir, faq, tmp_path), tiny_llama(len(tok), seed=0), lr=3e-3, steps=25)
    assert abs(history[0]["loss"] - 0.6931) < 1e-3
    assert history[-1]["loss"] < 0.2 and history[-1]["rewards/accuracies"] == 1.0
    assert history[-1]["rewards/margins"] > history[0]["rewards/margins"] + 1.0


def test_dpo_with_lora_adapters_starts_from_the_base_as_its_reference_and_leaves_it_untouched(tokenizer, faq, tmp_path):
    """LoRA on DPO: with B = 0 the adapted policy is the base, so the reference DPO computes once from the starting
    weights is the base without adapters (loss ln 2 at the first step, no second model); only the adapters move."""
    from amalia_ray.core.config import LoraConfig
    from amalia_ray.train.lora import add_adapters, init_adapters

    tok, tok_dir = tokenizer
    model = tiny_llama(len(tok), seed=0)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    add_adapters(model, LoraConfig(r=8, alpha=16.0))
    init_adapters(model, seed=0)
    losses = [h["loss"] for h in _train(_fixed_pairs(tok_dir, faq, tmp_path), model, lr=1e-2, steps=15)]
    assert abs(losses[0] - 0.6931) < 1e-3
    assert losses[-1] < losses[0] - 0.1, losses
    frozen = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if ".lora_" not in n}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[n], base[n]) for n in base)


def test_on_policy_pairs_are_kept_for_a_later_attempt_of_the_same_run(tokenizer, tmp_path, monkeypatch):
    """A resumed attempt of an on-policy DPO run trains on the pairs its first attempt sampled (engines and judges
    are not deterministic: sampling again would give other pairs under a data order restored for these); another
    run (another fingerprint) samples its own, and so does an attempt that finds the kept file cut short."""
    import torch.distributed as dist

    from amalia_ray.core.config import train_stage
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from amalia_ray.train import rollout_fleet
    from amalia_ray.train.objectives.dpo import PAIRS
    from tests.conftest import free_port

    tok, tok_dir = tokenizer
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(arithmetic_tasks(6, seed=1), tasks)
    stage = train_stage({"name": "dpo", "objective": "dpo", "dataset": str(tasks), "on_policy": True, "steps": 2,
                         "warmup_steps": 0, "num_generations": 2, "max_completion_length": 8, "seq_len": 160,
                         "rewards": ["has_number"]})
    draws = []

    class Fleet:
        def shutdown(self):
            pass

    def sample_and_score(fleet, tok_, prompts, tasks_, scorer, n, max_tokens, temperature, seed):
        draws.append(1)  # each draw different, as engines and judges give on a GPU
        items = [(p, [5 + len(draws), 6 + k]) for p in prompts for k in range(n)]
        return items, torch.tensor([[float(k + len(draws) % 2)] for _ in prompts for k in range(n)])

    monkeypatch.setattr(rollout_fleet, "fleet_on_model", lambda *a, **k: Fleet())
    monkeypatch.setattr(rollout_fleet, "sample_and_score", sample_and_score)
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    def pairs_of(run_id):
        dpo = DPO.from_policy(tasks, tok_dir, 160, stage, tmp_path, 0, run_id=run_id)
        dpo._make_pairs(model=None)
        return [(p.prompt, p.chosen, p.rejected) for split in ("train", "validation") for p in dpo.pairs[split]]

    try:
        first = pairs_of("dpo-fingerprint1")
        assert len(draws) == 1 and len(first) == 6 and (tmp_path / PAIRS).exists()
        assert pairs_of("dpo-fingerprint1") == first and len(draws) == 1, "the same run: kept, not sampled again"
        assert pairs_of("dpo-fingerprint2") != first and len(draws) == 2, "another run samples its own"
        (tmp_path / PAIRS).write_text((tmp_path / PAIRS).read_text()[:40])
        pairs_of("dpo-fingerprint2")
        assert len(draws) == 3, "a kept file cut short is sampled again"
    finally:
        if ours:
            dist.destroy_process_group()


def _on_policy_ranks(rank: int, world: int, port: int, tasks: str, tok_dir: str, work: str, run_id: str) -> None:
    """One of two gloo ranks making on-policy pairs, the fleet and the sampling replaced by stand-ins that count the
    draws in a file: writes the pairs this rank got."""
    import os

    import torch.distributed as dist

    from amalia_ray.core.config import train_stage
    from amalia_ray.train import rollout_fleet

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    draws = Path(work) / "draws"

    def sample_and_score(fleet, tok_, prompts, tasks_, scorer, n, *args):
        draws.write_text(draws.read_text() + "x" if draws.exists() else "x")
        return [(p, [7, 8 + k]) for p in prompts for k in range(n)], torch.tensor(
            [[float(k)] for _ in prompts for k in range(n)])

    rollout_fleet.fleet_on_model = lambda *a, **k: type("Fleet", (), {"shutdown": lambda self: None})() \
        if dist.get_rank() == 0 else None
    rollout_fleet.sample_and_score = sample_and_score
    stage = train_stage({"name": "dpo", "objective": "dpo", "dataset": tasks, "on_policy": True, "steps": 2,
                         "warmup_steps": 0, "num_generations": 2, "max_completion_length": 8, "seq_len": 160,
                         "rewards": ["has_number"]})
    dpo = DPO.from_policy(Path(tasks), Path(tok_dir), 160, stage, Path(work), 0, run_id=run_id)
    dpo._make_pairs(model=None)
    got = [[p.prompt, p.chosen, p.rejected] for split in ("train", "validation") for p in dpo.pairs[split]]
    (Path(work) / f"rank{rank}-{run_id}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_two_ranks_get_the_same_on_policy_pairs_sampled_once_then_kept(tokenizer, tmp_path):
    """Two ranks: the first samples (the other waits in the long-wait group), both get the same pairs; an attempt
    of the same run reads them back on the first rank and sends them once, sampling nothing."""
    import torch.multiprocessing as mp

    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from tests.conftest import free_port

    _, tok_dir = tokenizer
    write_tasks(arithmetic_tasks(6, seed=1), tmp_path / "tasks.jsonl")
    for _ in range(2):
        mp.spawn(_on_policy_ranks, args=(2, free_port(), str(tmp_path / "tasks.jsonl"), str(tok_dir), str(tmp_path),
                                         "dpo-f1"), nprocs=2)
        ranks = [json.loads((tmp_path / f"rank{r}-dpo-f1.json").read_text()) for r in range(2)]
        assert ranks[0] == ranks[1] and len(ranks[0]) == 6
    assert (tmp_path / "draws").read_text() == "x", "sampled by the first attempt only"
