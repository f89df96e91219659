"""Starting from a Hugging Face model: the recipe's `model.from` / `tokenizer.from`, strict and sharded weight
loading into FSDP2 (each rank reads its own rows), bit-identical export, RoPE scaling, and clear errors offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from amalia_ray.core.config import ModelConfig, Recipe
from amalia_ray.core.errors import AmaliaError
from tests.base_models import FAMILIES, FAQ, make_base_model
from tests.conftest import DEMO_RECIPE, free_port

pytestmark = pytest.mark.skipif(not FAQ.exists(), reason="debian-faq-pt not installed (make corpus)")


def _recipe(**sections) -> dict:
    data = yaml.safe_load(DEMO_RECIPE.read_text())
    data["train"] = data["train"][:1]
    data["train"][0].pop("proxy")
    data.update(sections)
    return data


def test_a_base_model_replaces_the_dimensions_and_brings_its_tokenizer():
    r = Recipe.model_validate(_recipe(model={"from": "org/model", "revision": "v1"}, tokenizer={"from": "model"}))
    assert r.model.base == "org/model" and r.model.revision == "v1" and r.tokenizer.from_ == "model"
    with pytest.raises(ValueError, match=r"remove \['hidden_size'\]"):
        Recipe.model_validate(_recipe(model={"from": "org/model", "hidden_size": 64}, tokenizer={"from": "model"}))
    with pytest.raises(ValueError, match="set tokenizer: {from: model}"):
        Recipe.model_validate(_recipe(model={"from": "org/model"}))
    with pytest.raises(ValueError, match="needs a base model"):
        Recipe.model_validate(_recipe(tokenizer={"from": "model"}))
    with pytest.raises(ValueError, match="keeps the base model's vocabulary"):
        Recipe.model_validate(_recipe(model={"from": "m"}, tokenizer={"from": "model", "vocab_size": 1000}))
    with pytest.raises(ValueError, match="apply to a base model"):
        ModelConfig.model_validate({"revision": "main"})


def test_a_hub_model_missing_offline_is_one_clear_line(monkeypatch, tmp_path):
    from amalia_ray.core import hf_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(AmaliaError) as e:
        hf_model.resolve("nobody-here/no-such-model")
    message = str(e.value)
    assert "nobody-here/no-such-model" in message and "HF_HUB_OFFLINE" in message and str(tmp_path) in message
    assert "\n" not in message
    with pytest.raises(AmaliaError, match="no config.json"):
        hf_model.resolve(str(tmp_path))


def test_an_architecture_training_cannot_shard_names_the_supported_ones():
    from transformers import BertConfig

    from amalia_ray.train.model import check_config

    with pytest.raises(AmaliaError, match="supported: llama, qwen2, qwen3, mistral, gemma2, gemma3_text"):
        check_config(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).to_dict())
    for family in FAMILIES:  # every tested family passes the same check, on the meta device
        import transformers

        cls, _ = FAMILIES[family]
        check_config(getattr(transformers, cls)(hidden_size=64, num_attention_heads=4, head_dim=16).to_dict())


def test_rope_scaling_extends_the_context_once():
    from amalia_ray.core.hf_model import with_overrides

    base = {"model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 10000.0}
    cfg = ModelConfig.model_validate({"from": "x", "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                                                    "original_max_position_embeddings": 4096}})
    once = with_overrides(base, cfg)
    assert once["max_position_embeddings"] == 32768
    assert once["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 8.0,
                                       "original_max_position_embeddings": 4096}
    assert with_overrides(once, cfg)["max_position_embeddings"] == 32768  # a later stage's export: not again
    from amalia_ray.train.model import config_from_dict

    config = config_from_dict(once)
    assert config.rope_parameters["rope_type"] == "yarn" and config.max_position_embeddings == 32768


def test_checkpoint_names_are_checked_strictly(tmp_path):
    from safetensors.torch import load_file, save_file

    from amalia_ray.train.hf_weights import load_sharded
    from amalia_ray.train.model import base_config, config_from_dict, instantiate, materialize

    folder = make_base_model(tmp_path / "m", "llama", shard_size=None, with_tokenizer=False)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = config_from_dict(base_config(ModelConfig.model_validate({"from": str(folder)}), folder))
    model = instantiate(config, empty=True)
    materialize(model, torch.device("cpu"))
    with pytest.raises(AmaliaError) as e:
        load_sharded(model, folder)
    assert "lacks: ['model.norm.weight']" in str(e.value)
    assert "does not have: ['model.layers.0.mlp.extra.weight']" in str(e.value)


def _load_on_ranks(rank: int, world: int, port: int, folders: list[str], out: str) -> None:
    """Each family through FSDP2 on `world` gloo ranks: built on meta, read shard by shard, a forward pass, and the
    export written straight back (0 steps)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from amalia_ray.train.hf_weights import export_hf, stored_dtype
    from amalia_ray.train.model import base_config, build, config_from_dict
    from amalia_ray.train.parallel import apply_fsdp

    ids = torch.arange(48).view(2, 24) * 7 % 600
    for folder in map(Path, folders):
        config = config_from_dict(base_config(ModelConfig.model_validate({"from": str(folder)}), folder))
        model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", activation_checkpointing=True),
                      init_dir=folder, seed=0)
        logits = model(input_ids=ids).logits.detach()
        if rank == 0:
            torch.save(logits, Path(out) / f"{folder.name}.pt")
        export_hf(model, config, Path(out) / folder.name, folder, None, stored_dtype(folder))
    dist.destroy_process_group()


def test_every_family_loads_sharded_into_fsdp2_and_exports_bit_identical(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folders = [make_base_model(tmp_path / family, family) for family in FAMILIES]
    assert len(list(folders[0].glob("model-*-of-*.safetensors"))) > 1  # the hub's sharded layout, with an index
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_load_on_ranks, args=(2, free_port(), [str(f) for f in folders], str(out)), nprocs=2)
    ids = torch.arange(48).view(2, 24) * 7 % 600
    for folder in folders:
        reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert torch.equal(reference(input_ids=ids).logits, torch.load(out / f"{folder.name}.pt")), folder.name

        def tensors(f: Path) -> dict:
            return {k: v for shard in sorted(f.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}

        before, after = tensors(folder), tensors(out / folder.name)
        assert before.keys() == after.keys(), folder.name
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
        exported = json.loads((out / folder.name / "config.json").read_text())
        assert exported["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
        assert (out / folder.name / "chat_template.jinja").exists() or "chat_template" in json.loads(
            (out / folder.name / "tokenizer_config.json").read_text())


def _status_kb(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


def _rss_while_loading(rank: int, world: int, port: int, folder: str, out: str, new: bool = False) -> None:
    """Peak resident memory while building the model of `folder` sharded: loaded from it, or (`new`) a new model of
    its shape with random weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from amalia_ray.train.model import base_config, build, config_from_dict
    from amalia_ray.train.parallel import apply_fsdp

    config = config_from_dict(base_config(ModelConfig.model_validate({"from": folder}), Path(folder)))
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak resident size starts again from now
    before = _status_kb("VmRSS") * 1024
    build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", False), init_dir=None if new else Path(folder),
          seed=0)
    peak = _status_kb("VmHWM") * 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before, "peak": peak}))
    dist.destroy_process_group()


def test_no_worker_holds_the_whole_model_while_loading(tmp_path):
    """2 workers load a 90 M-parameter model (358 MB in fp32, stored in bf16): each worker's peak resident memory
    grows by its half of the fp32 parameters plus the file pages it reads (0.62 of the model measured), never the
    whole model (a rank that built or read it whole would grow by more than 1.0). A new model of that shape with
    random weights: each module's weights are drawn whole, then only the rank's shard kept (0.82 measured: its half
    and the largest module, the embeddings, whole while drawn; built whole before sharding it was 1.10)."""
    folder = make_base_model(tmp_path / "big", "llama", hidden=1024, layers=6, vocab=16000, shard_size="50MB",
                             with_tokenizer=False)
    full_fp32 = 4 * sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(
        __import__("transformers").AutoConfig.from_pretrained(str(folder))).parameters())
    for new in (False, True):  # loaded, and a new model of its shape (trained from scratch)
        out = tmp_path / f"rss-{new}"
        out.mkdir()
        mp.spawn(_rss_while_loading, args=(2, free_port(), str(folder), str(out), new), nprocs=2)
        for rank in range(2):
            r = json.loads((out / f"rank{rank}.json").read_text())
            grew = r["peak"] - r["before"]
            assert (0 if new else 0.3) * full_fp32 < grew < (0.9 if new else 0.75) * full_fp32, \
                f"rank {rank} grew {grew / 1e6:.0f} MB building a {full_fp32 / 1e6:.0f} MB model (new: {new})"


def test_a_hub_snapshot_is_recorded_by_its_commit_not_reread(tmp_path):
    """A stage's fingerprint names a cached hub model by its commit instead of hashing its weights every run; any
    other folder (a local model, the previous stage's export) is still hashed."""
    from amalia_ray.core.hf_model import snapshot_commit
    from amalia_ray.pipeline.stages import by_content

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--utter-project--EuroLLM-9B" / "snapshots" / commit
    local = tmp_path / "my-model"
    assert snapshot_commit(snapshot) == f"utter-project/EuroLLM-9B@{commit}"
    assert snapshot_commit(local) is None and snapshot_commit(snapshot.parent / "main") is None
    hashed, named = by_content({"init_checkpoint": snapshot, "tokenizer": local})
    assert hashed == {"tokenizer": local} and named == {"init_checkpoint": f"utter-project/EuroLLM-9B@{commit}"}


def test_a_hub_snapshot_is_placed_in_the_run_folder_every_node_sees(tmp_path):
    """The Hugging Face cache is one machine's: a hub model's snapshot (links into the cache's blob store) is placed
    in the run folder, in the cache's layout so its commit still names it, hard-linked where the filesystem allows;
    a second run finds it there; a local model folder is used where it is."""
    import os

    from amalia_ray.core.hf_model import snapshot_commit, stage_snapshot

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--model"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    (snapshot / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "model.safetensors": b"w" * 1000, "sub/tokenizer.json": b"t",
             "pytorch_model.bin": b"old weights", "original/consolidated.pth": b"more"}
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        blob = repo / "blobs" / f"{abs(hash(name)):x}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    staged = stage_snapshot(snapshot, tmp_path / "run" / "hub")
    assert staged == tmp_path / "run" / "hub" / "models--org--model" / "snapshots" / commit
    assert snapshot_commit(staged) == snapshot_commit(snapshot) == f"org/model@{commit}"
    assert {str(f.relative_to(staged)): f.read_bytes() for f in staged.rglob("*") if f.is_file()} == {
        "config.json": b"{}", "model.safetensors": b"w" * 1000, "sub/tokenizer.json": b"t"}, "what a model needs"
    assert not any(f.is_symlink() for f in staged.rglob("*")), "real files: the cache's blobs are not on every node"
    assert (staged / "model.safetensors").stat().st_ino == (snapshot / "model.safetensors").resolve().stat().st_ino
    assert stage_snapshot(snapshot, tmp_path / "run" / "hub") == staged and not list(staged.parent.glob(".*"))
    local = tmp_path / "my-model"
    assert stage_snapshot(local, tmp_path / "run" / "hub") == local


def test_flash_and_flex_attention_off_a_cuda_node_are_one_clear_line():
    """What a GPU node without flash-attn (or a CPU worker) meets: the recipe field named, not transformers'
    ImportError from inside the model's constructor; and flex_attention on CPU, whose backward pass torch lacks,
    fails before the first step instead of in it."""
    from transformers import LlamaConfig

    from amalia_ray.train.model import build, config_from_dict

    def config(kernel):
        return config_from_dict({**LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                               vocab_size=64).to_dict(), "attn_implementation": kernel})
    with pytest.raises(AmaliaError, match="attn_implementation flash_attention_2 needs CUDA GPUs and the flash-attn "
                                          "package on every training node .device cpu"):
        build(config("flash_attention_2"), torch.device("cpu"), lambda m: None, init_dir=None, seed=0)
    with pytest.raises(AmaliaError, match="attn_implementation flex_attention trains on CUDA GPUs only: .* has no "
                                          "backward pass on cpu; use sdpa there"):
        build(config("flex_attention"), torch.device("cpu"), lambda m: None, init_dir=None, seed=0)


def test_the_embedded_cluster_has_room_to_serve_the_base_beside_its_stages():
    from amalia_ray.pipeline.stages import logical_cpus_needed

    data = _recipe()
    data["train"].append({**data["train"][0], "name": "more"})
    new = Recipe.model_validate(data)
    based = Recipe.model_validate({**data, "model": {"from": "org/model"}, "tokenizer": {"from": "model"}})
    # a vLLM replica holds its actor's CPU and its engine's: two stages, or two stages and the base, plus 4
    assert logical_cpus_needed(new) == 2 * 2 + 4 and logical_cpus_needed(based) == 2 * 3 + 4
