"""LoRA through PEFT under FSDP2 on 2 gloo ranks, against PEFT + transformers on one process: the first SFT and
pretraining steps' losses and the adapters' gradients (with activation checkpointing; compiled blocks too, slow);
only adapters train and are checkpointed, and a run resumed from such a checkpoint takes the next step exactly as the
uninterrupted one; the exported adapter folder loads in PEFT and gives the merged checkpoint's logits; a rollout
engine gets the merged weights; the recipe refuses adapters nothing could serve."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from amalia_ray.core.config import LoraConfig
from amalia_ray.core.errors import RecipeError
from tests.base_models import make_base_model
from tests.conftest import free_port
from tests.test_shards import write_packed_split

LORA = LoraConfig(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], merge=True)
CHATS = [[{"role": "user", "content": f"Pergunta número {i}: como se instala o pacote {i}?"},
          {"role": "assistant", "content": f"Com apt-get install pacote-{i}, como administrador do sistema."}]
         for i in range(12)]


def _sft(folder: Path, work: Path):
    from amalia_ray.train.objectives.sft import SFT

    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CHATS))
    return SFT(data, folder, seq_len=64, validation_fraction=0.0)


def _train_on_ranks(rank: int, world: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from amalia_ray.train import checkpoint, lora
    from amalia_ray.train.hf_weights import export_hf
    from amalia_ray.train.weight_names import plain_name
    from amalia_ray.train.model import base_config, build, config_from_dict
    from amalia_ray.train.parallel import apply_fsdp
    from amalia_ray.core.config import ModelConfig

    folder, out = Path(folder), Path(out)
    config = config_from_dict(base_config(ModelConfig.model_validate({"from": str(folder)}), folder))
    model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", activation_checkpointing=True),
                  init_dir=folder, seed=7, lora=LORA)
    trained = {plain_name(n) for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    pretrain = _first_pretrain_step(model, out / "packed")
    sft = _sft(folder, out / f"work{rank}")
    batch = sft.batch(np.arange(4))
    loss_sum, ntok = sft.loss(model, batch)
    (loss_sum / ntok).backward()
    grads = {plain_name(n): p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    checkpoint.save(out / "dcp" / str(rank), model, optimizer, {"step": 1}, "test-key")
    dist.barrier()
    if rank == 0:  # what ray.train.report does: each rank's files into one checkpoint folder
        for part in (out / "dcp").iterdir():
            shutil.copytree(part, out / "checkpoint", dirs_exist_ok=True)
    dist.barrier()
    # resuming: the same base and adapters' start, then the checkpoint's adapters and Adam moments on top; the next
    # step then moves both copies alike
    resumed = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", activation_checkpointing=True),
                    init_dir=folder, seed=7, lora=LORA)
    resumed_optimizer = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2,
                                          weight_decay=0.0)
    _load(out / "checkpoint", resumed, resumed_optimizer)
    second = []
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        step_loss, step_tokens = sft.loss(m, sft.batch(np.arange(4, 8)))
        (step_loss / step_tokens).backward()
        o.step()
        second.append((step_loss / step_tokens).item())
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), resumed.parameters()))
    # what a rollout engine gets from the trained adapters (GRPO, on-policy DPO): the merged weights, streamed or
    # exported; and GRPO's KL reference, the same model with its adapters switched off
    with torch.no_grad(), lora.adapters_off(model):
        off_sum, off_tokens = sft.loss(model, batch)
    pushed = _push_to_a_recorder(model)
    export_hf(model, config, out / "exported", folder)
    if rank == 0:
        torch.save({"loss": (loss_sum / ntok).item(), "grads": grads, "trained": sorted(trained),
                    "total": sum(p.numel() for p in model.parameters()), "second": second, "same": same,
                    "adapters_off_loss": (off_sum / off_tokens).item(), "pushed": pushed, "pretrain": pretrain},
                   out / "ranks.pt")
    lora.export(model, config, LORA, out / "adapter", out / "hf", folder, None, "float32", str(folder))
    dist.destroy_process_group()


def _first_pretrain_step(model, packed: Path) -> dict:
    """The pretrain objective's loss and adapter gradients on the packed split's first rows (gradients cleared)."""
    from amalia_ray.train.weight_names import plain_name
    from amalia_ray.train.objectives.pretrain import Pretrain

    pretrain = Pretrain(packed)
    loss_sum, ntok = pretrain.loss(model, pretrain.batch(np.arange(4)))
    (loss_sum / ntok).backward()
    grads = {plain_name(n): p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"loss": (loss_sum / ntok).item(), "grads": grads}


def _push_to_a_recorder(model) -> dict[str, torch.Tensor]:
    """push_weights into a fleet that keeps what it is sent (rank 0's record; every rank takes part)."""
    import types
    from concurrent.futures import Future

    from amalia_ray.train.rollout_fleet import push_weights
    from amalia_ray.train.weight_sync import unpack

    got = {}

    def send(bucket):
        got.update({n: t.clone() for n, t in unpack(bucket.header(), bucket.payload())})
        done = Future()
        done.set_result(None)
        return done

    recorder = types.SimpleNamespace(begin_update=lambda: None, end_update=lambda: None, send=send,
                                     wait=Future.result, sender=types.SimpleNamespace(device=torch.device("cpu")))
    push_weights(model, recorder, torch.float32, bucket_bytes=1 << 16)
    return got


def _load(folder: Path, model, optimizer) -> None:
    """What checkpoint.restore does once it has picked a checkpoint whose files are intact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from amalia_ray.train.checkpoint import TRAINED, loading_options

    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=loading_options(model))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    folder = make_base_model(tmp / "llama", "llama", dtype="float32")
    out = tmp / "out"
    for rank in (0, 1):
        (out / f"work{rank}").mkdir(parents=True)
    for split in ("train", "validation"):  # packed documents for the pretrain objective
        write_packed_split(out / "packed" / split, 16, 48, 8, files=1, vocab=640)
    mp.spawn(_train_on_ranks, args=(2, free_port(), str(folder), str(out)), nprocs=2)
    return folder, out, torch.load(out / "ranks.pt")


def test_first_step_loss_and_adapter_gradients_equal_peft_and_transformers(trained):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from amalia_ray.train.lora import init_adapters, peft_config

    folder, out, ours = trained
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    reference = get_peft_model(base, peft_config(LORA))
    init_adapters(reference.base_model.model, seed=7)  # the same adapters' starting values as the ranks drew
    sft = _sft(folder, out)
    batch = sft.batch(np.arange(4))
    loss_sum, ntok = sft.loss(reference, batch)
    loss = loss_sum / ntok
    loss.backward()
    assert abs(loss.item() - ours["loss"]) < 1e-5
    peft_grads = {n.removeprefix("base_model.model."): p.grad for n, p in reference.named_parameters()
                  if p.grad is not None}
    assert set(peft_grads) == set(ours["grads"]) == set(ours["trained"]), "only the adapters train"
    assert all(".lora_A." in n or ".lora_B." in n for n in ours["trained"])
    for name, grad in peft_grads.items():
        assert torch.allclose(grad, ours["grads"][name], rtol=1e-4, atol=1e-6), name
    assert any(ours["grads"][n].abs().sum() > 0 for n in ours["trained"] if ".lora_B." in n)


def test_a_resumed_run_takes_the_next_step_exactly_as_the_uninterrupted_one(trained):
    ours = trained[2]
    assert ours["second"][0] == ours["second"][1] and ours["same"]


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(trained):
    import torch.distributed.checkpoint as dcp

    from amalia_ray.train.weight_names import plain_name

    _, out, ours = trained
    metadata = dcp.FileSystemReader(str(out / "dcp" / "0")).read_metadata()
    model_keys = {plain_name(k.removeprefix("model.")) for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert model_keys == set(ours["trained"])
    optim_keys = {k for k in metadata.state_dict_metadata if k.startswith("optim.state.")}
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    size = sum(f.stat().st_size for d in (out / "dcp").iterdir() for f in d.iterdir())
    assert size < 0.2 * ours["total"] * 4, "adapters and their Adam moments, a small part of the model"


def test_the_adapter_folder_loads_in_peft_and_equals_the_merged_checkpoint(trained):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, out, _ = trained
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in (out / "adapter").iterdir()}
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {"q_proj", "v_proj",
                                                                                                "down_proj"}
    assert all(".lora_" in k for k in load_file(str(out / "adapter" / "adapter_model.safetensors")))
    ids = torch.arange(40).view(2, 20) * 11 % 500
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    before = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32)
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(a, m, atol=1e-4), (a - m).abs().max()
    assert not torch.allclose(before, m, atol=1e-4), "one step moved the adapted model away from the base"
    assert (out / "hf" / "tokenizer_config.json").exists() and (out / "hf" / "generation_config.json").exists()


def test_a_rollout_engine_gets_the_merged_weights_and_the_reference_is_the_base(trained):
    """GRPO and on-policy DPO with adapters: the weights streamed into the rollout engine and the export it starts
    from are PEFT's merge of the trained adapters, under the plain model's names; switching the adapters off gives
    back the base's loss on the first batch (where the adapters, B = 0, did not change it yet)."""
    from safetensors.torch import load_file

    _, out, ours = trained
    peft_merged = load_file(str(out / "hf" / "model.safetensors"))
    exported = load_file(str(out / "exported" / "model.safetensors"))
    assert set(ours["pushed"]) == set(peft_merged) == set(exported)
    for name, want in peft_merged.items():
        assert torch.allclose(ours["pushed"][name], want, atol=1e-6), name
        assert torch.allclose(exported[name], want, atol=1e-6), name
    moved = [n for n in peft_merged if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))]
    base = {n: t for f in trained[0].glob("*.safetensors") for n, t in load_file(str(f)).items()}
    assert moved and all(not torch.equal(peft_merged[n], base[n]) for n in moved), "the adapters trained"
    assert abs(ours["adapters_off_loss"] - ours["loss"]) < 1e-6


def _recipe(tmp_path, stages, tasks=None):
    import yaml

    from tests.conftest import write_recipe

    path = write_recipe(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["train"] += stages
    data["eval"]["tasks"] = data["eval"]["tasks"] if tasks is None else tasks
    path.write_text(yaml.safe_dump(data))
    return path


def _compiled_pretrain_step_on_ranks(rank: int, world: int, port: int, folder: str, packed: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from amalia_ray.core.config import ModelConfig
    from amalia_ray.train.model import base_config, build, config_from_dict
    from amalia_ray.train.parallel import apply_fsdp

    folder = Path(folder)
    config = config_from_dict(base_config(ModelConfig.model_validate({"from": str(folder)}), folder))
    model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", True, compile_blocks=True),
                  init_dir=folder, seed=7, lora=LORA)
    step = _first_pretrain_step(model, Path(packed))
    if rank == 0:
        torch.save({"pretrain": step}, Path(out) / "compiled.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("compile_blocks", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_pretraining_adapters_with_checkpointed_and_compiled_blocks_equal_peft(trained, tmp_path, compile_blocks):
    """The pretrain objective (packed documents, positions restarting at each) with adapters, on 2 FSDP2 ranks with
    activation checkpointing, compiled blocks or not: the first step's loss and adapter gradients are PEFT +
    transformers' on one process."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from amalia_ray.train.lora import init_adapters, peft_config
    from amalia_ray.train.objectives.pretrain import Pretrain

    folder, out, ours = trained
    if compile_blocks:
        mp.spawn(_compiled_pretrain_step_on_ranks, nprocs=2, args=(
            2, free_port(), str(folder), str(out / "packed"), str(tmp_path)))
        ours = torch.load(tmp_path / "compiled.pt")
    ours = ours["pretrain"]

    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
                               peft_config(LORA))
    init_adapters(reference.base_model.model, seed=7)
    pretrain = Pretrain(out / "packed")
    batch = pretrain.batch(np.arange(4))
    assert len(set(batch["position_ids"][:, 1:].eq(0).nonzero()[:, 0].tolist())) > 1, "several documents per row"
    loss_sum, ntok = pretrain.loss(reference, batch)
    (loss_sum / ntok).backward()
    assert abs((loss_sum / ntok).item() - ours["loss"]) < 1e-5
    peft_grads = {n.removeprefix("base_model.model."): p.grad for n, p in reference.named_parameters()
                  if p.grad is not None}
    assert set(peft_grads) == set(ours["grads"]) and all(".lora_" in n for n in peft_grads), "only the adapters train"
    for name, grad in peft_grads.items():
        assert torch.allclose(grad, ours["grads"][name], rtol=1e-4, atol=1e-6), name


def test_the_recipe_refuses_adapters_that_nothing_could_serve_or_continue_from(tmp_path):
    from amalia_ray.core.recipe import load_recipe

    sft = {"name": "sft", "objective": "sft", "dataset": "chats.jsonl", "steps": 20, "lora": {"r": 8}}
    dpo = {"name": "dpo", "objective": "dpo", "dataset": "pairs.jsonl", "steps": 20}
    with pytest.raises(RecipeError, match="set lora.merge: true on 'sft'"):
        load_recipe(_recipe(tmp_path, [sft, dpo], tasks=[]))
    with pytest.raises(RecipeError, match="vLLM's LoRA engine cannot serve an adapter with modules_to_save"):
        load_recipe(_recipe(tmp_path, [{**sft, "lora": {"modules_to_save": ["lm_head"]}}]))
    with pytest.raises(RecipeError, match="its adapters train on random initial weights"):
        load_recipe(_recipe(tmp_path, [{**sft, "init_from": "scratch"}]))
    with pytest.raises(RecipeError, match="lora"):
        load_recipe(_recipe(tmp_path, [{**sft, "lora": {"rank": 8}}], tasks=[]))
    merged = load_recipe(_recipe(tmp_path, [{**sft, "lora": {"r": 8, "merge": True}}, dpo])).recipe
    assert merged.train[1].lora.r == 8 and merged.train[1].lora.target_modules == "all-linear"


@pytest.mark.parametrize("stages, engines, adapters", [
    ([{"lora": {"merge": True}}, {}], ["pretrain", "dpo"], {"pretrain": ["sft"]}),
    ([{}, {"lora": {}}], ["pretrain", "sft"], {"sft": ["dpo"]}),
    ([{"lora": {"merge": True}}, {"lora": {}}], ["pretrain", "sft"], {"sft": ["dpo"]}),
    ([{"lora": {"merge": True}}, {"lora": {"merge": True}}], ["pretrain", "sft"], {"sft": ["dpo"]}),
    ([{"lora": {"merge": True, "modules_to_save": ["lm_head"]}}, {"lora": {}}], ["pretrain", "sft"], {"sft": ["dpo"]}),
    ([{}, {}], ["pretrain", "sft", "dpo"], {}),
])
def test_the_eval_stage_serves_each_adapter_on_the_checkpoint_it_was_trained_from(tmp_path, stages, engines, adapters):
    """Each LoRA stage's adapter runs on the engine of the checkpoint it was trained from (one engine for a base and
    its adapters); a LoRA stage that a later adapter was trained on, or whose adapter vLLM cannot serve, is served in
    full from its merged export."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline
    from amalia_ray.pipeline.stages import _in_stage_order, served_models

    sft = {"name": "sft", "objective": "sft", "dataset": "chats.jsonl", "steps": 20, **stages[0]}
    dpo = {"name": "dpo", "objective": "dpo", "dataset": "pairs.jsonl", "steps": 20, **stages[1]}
    pipeline = Pipeline(load_recipe(_recipe(tmp_path, [sft, dpo])))
    models, on = served_models(pipeline)
    run = pipeline.run_name
    assert models == {f"{run}-{s}": pipeline.checkpoint_of(s) for s in engines}
    assert on == {f"{run}-{b}": {a: pipeline.run_dir / a / "adapter" for a in named} for b, named in adapters.items()}
    by_adapter = {f"{b}:{a}": b for b, named in on.items() for a in named}
    order = _in_stage_order(pipeline, [*models, *by_adapter], by_adapter)
    assert [m.rsplit(":", 1)[-1].removeprefix(f"{run}-") for m in order] == ["pretrain", "sft", "dpo"], \
        "the report's columns in the recipe's order"


def test_a_stage_named_base_in_a_recipe_without_a_base_model_is_served_from_its_own_export(tmp_path):
    """'base' names the base model only where the recipe has one (model.from); otherwise it may name a stage."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline
    from amalia_ray.pipeline.stages import judge_checkpoint, served_models

    stages = [{"name": "base", "objective": "sft", "dataset": "chats.jsonl", "steps": 20},
              {"name": "dpo", "objective": "dpo", "dataset": "pairs.jsonl", "steps": 20, "lora": {}}]
    pipeline = Pipeline(load_recipe(_recipe(tmp_path, stages)))
    run = pipeline.run_name
    assert served_models(pipeline) == ({f"{run}-pretrain": pipeline.checkpoint_of("pretrain"),
                                        f"{run}-base": pipeline.checkpoint_of("base")},
                                       {f"{run}-base": {"dpo": pipeline.run_dir / "dpo" / "adapter"}})
    assert judge_checkpoint(pipeline, "base") == pipeline.checkpoint_of("base")
    assert pipeline.recipe.engine_serving("dpo") == "base"
    with pytest.raises(ValueError, match="'nope' is not served"):
        pipeline.recipe.engine_serving("nope")


def test_modules_to_save_train_in_full_and_travel_with_the_adapter(trained, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from amalia_ray.core.config import ModelConfig
    from amalia_ray.train import lora
    from amalia_ray.train.model import base_config, build, config_from_dict

    folder = trained[0]
    cfg = LORA.model_copy(update={"target_modules": ["o_proj"], "modules_to_save": ["lm_head"]})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = config_from_dict(base_config(ModelConfig.model_validate({"from": str(folder)}), folder))
        model = build(config, torch.device("cpu"), lambda m: None, init_dir=folder, seed=1, lora=cfg)
        assert {n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n} == {"lm_head.weight"}
        ids = torch.arange(40).view(2, 20) * 11 % 500
        model(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
        lora.export(model, config, cfg, tmp_path / "adapter", tmp_path / "hf", folder, None, "float32", str(folder))
        lora.export(model, config, cfg, tmp_path / "alone", None, folder, None, "float32", str(folder))
    finally:
        dist.destroy_process_group()
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
    # without a merge only the trained weights are gathered: the same adapter folder
    alone, merged_too = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("alone", "adapter"))
    assert alone.keys() == merged_too.keys() and all(torch.equal(alone[k], merged_too[k]) for k in alone)
    fresh = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)  # `base` now carries the adapter
    assert not torch.allclose(fresh.lm_head.weight, merged.lm_head.weight), "the LM head trained in full"


def test_the_report_compares_each_adapter_with_the_checkpoint_it_runs_on(tmp_path):
    from amalia_ray.pipeline.report import evaluation_section

    def scored(acc):
        return {"acc": acc, "acc_stderr": 0.01, "n": 10, "chance": 0.25, "metric": "acc"}

    metrics = {"base_url": "http://x/v1", "adapters": {"run-pretrain:sft": "run-pretrain"},
               "results": {"run-pretrain/mc": scored(0.5), "run-pretrain:sft/mc": scored(0.625)}}
    text = "\n".join(evaluation_section(tmp_path, metrics))
    assert "run-pretrain:sft on run-pretrain" in text
    assert "0.625 ± 0.010 (+0.125)" in text and "0.500 ± 0.010 |" in text
