import json

import numpy as np
import pytest

from amalia_ray.core.formats.shards import fillers_per_step
from amalia_ray.train.loop import local_micro_batches
from amalia_ray.train.lr_schedule import lr_at


@pytest.mark.parametrize("world", [1, 2, 4])
def test_micro_batches_partition_the_global_batch(world):
    rows = np.arange(16)
    parts = [m for r in range(world) for m, filler in local_micro_batches(rows, 2, r, world)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(16))
    assert [m.tolist() for m, _ in local_micro_batches(rows, 2, 0, world)][:1] == [[0, 1]], "divisible: in order"


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_any_worker_count_of_an_elastic_range_takes_the_global_batch_whole(micro):
    """1,024 sequences on 56 to 64 workers (node-granular elasticity): every rank runs the same number of
    micro-batches of at most `micro` rows, every row is used exactly once, and a slot without a row is a filler."""
    rows = np.arange(1024)
    for world in range(56, 65):
        ranks = [local_micro_batches(rows, micro, r, world) for r in range(world)]
        assert len({len(mine) for mine in ranks}) == 1, "the same number of passes on every rank"
        real = [m for mine in ranks for m, filler in mine if not filler]
        assert sorted(np.concatenate(real).tolist()) == list(range(1024))
        assert all(1 <= len(m) <= micro for mine in ranks for m, _ in mine)
        assert sum(filler for mine in ranks for _, filler in mine) == fillers_per_step(1024, micro, world)


def test_fillers_leave_the_step_s_loss_and_gradient_those_of_the_whole_batch():
    """The loop's arithmetic over uneven ranks: per-micro-batch loss sums with fillers zeroed, summed over ranks and
    divided by the items, give the whole batch's mean loss and gradient."""
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(10, 3), torch.randn(10)
    weight = torch.randn(3, requires_grad=True)
    ((x @ weight - y) ** 2).mean().backward()
    expected, weight.grad = weight.grad.clone(), None
    world, total, items = 4, 0.0, 0
    for rank in range(world):
        for part, filler in local_micro_batches(np.arange(10), 1, rank, world):
            loss = ((x[part] @ weight - y[part]) ** 2).sum()
            loss, n = (loss * 0.0, 0) if filler else (loss, len(part))
            loss.backward()
            total, items = total + loss.item(), items + n
    assert items == 10 and total / items == pytest.approx(((x @ weight - y) ** 2).mean().item())
    assert torch.allclose(weight.grad / items, expected, atol=1e-6)


def test_schedules():
    kw = dict(total=100, peak=1.0, warmup=10, min_ratio=0.1)
    assert lr_at(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(99, schedule="cosine", **kw) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(50, schedule="wsd", **kw) == 1.0
    assert lr_at(99, schedule="wsd", **kw) == pytest.approx(0.1)
    assert lr_at(50, schedule="constant", **kw) == 1.0


@pytest.mark.parametrize("kernel", ["sdpa", "flex_attention"])
def test_document_masking_keeps_attention_within_each_document(tmp_path, kernel, monkeypatch):
    """Restarting positions make transformers mask attention across packed documents (sdpa through a dense mask,
    flex_attention through a block mask): the logits of the second document do not depend on the first and equal
    those of the document alone. (flex_attention runs uncompiled here; the compiled kernel is torch's.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from transformers import LlamaConfig, LlamaForCausalLM

    from amalia_ray.core.formats.shards import PackedSplit
    from amalia_ray.train.objectives.pretrain import Pretrain, logits

    monkeypatch.setattr("transformers.integrations.flex_attention.compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                                         attn_implementation=kernel))
    second = [7, 8, 9, 10, 11]
    tokens = np.array([[1, 2, 3] + second, [4, 5, 6] + second])
    objective = Pretrain.__new__(Pretrain)
    pq.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), 8),
                             "doc_starts": [[0, 3], [0, 3]], "source": ["a", "a"]}), tmp_path / "part-0.parquet")
    objective.train = PackedSplit.read(tmp_path)
    objective.document_masking = True
    batch = objective.batch(np.array([0, 1]))
    with torch.no_grad():
        masked = logits(model, batch)
        plain = logits(model, {"input_ids": batch["input_ids"]})
        alone = model(input_ids=torch.tensor([second])).logits
    assert model.config._attn_implementation == kernel
    assert torch.allclose(masked[0, 3:], masked[1, 3:], atol=1e-5), "document 2 sees only itself"
    assert torch.allclose(masked[0, 3:], alone[0], atol=1e-5), "as if it were alone"
    assert not torch.allclose(plain[0, 3:], plain[1, 3:], atol=1e-3), "without masking it sees document 1"


def test_validation_loss_per_source_adds_up_to_the_overall(tmp_path):
    """Per-source validation losses (what data-mix ablations compare) and the overall loss come from the same sums:
    the overall is their token-weighted mean, and a source the model has learnt scores lower."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from amalia_ray.train.loop import validation_losses

    class Objective:  # 6 validation rows of two sources: "same" repeats one token, "noise" is random
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.rows = torch.cat([torch.full((3, 16), 5), torch.randint(0, 50, (3, 16), generator=g)])

        def num_validation(self):
            return 6

        def validation_groups(self):
            return {"same": np.arange(3), "noise": np.arange(3, 6)}

        def batch(self, rows, split="validation"):
            return {"input_ids": self.rows[rows]}

        def loss(self, model, batch):
            ids = batch["input_ids"]
            logits = model(ids)
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1),
                                                     reduction="sum"), ids[:, 1:].numel()

    grad_enabled = []

    class Model(torch.nn.Module):  # predicts token 5 with high confidence
        def forward(self, ids):
            grad_enabled.append(torch.is_grad_enabled())
            out = torch.zeros(*ids.shape, 50)
            out[..., 5] = 6.0
            return out

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        overall, per_source = validation_losses(Model(), Objective(), micro=2, rank=0, world=1,
                                                device=torch.device("cpu"))
        # at most 2 rows of each source, the same two at every validation, others with another seed
        read = []
        objective = Objective()
        objective.batch = lambda rows, split="validation": read.append(rows.tolist()) or {
            "input_ids": objective.rows[rows]}
        limited = [validation_losses(Model(), objective, 8, 0, 1, torch.device("cpu"), limit=2, seed=seed)
                   for seed in (0, 0, 1)]
    finally:
        dist.destroy_process_group()
    assert grad_enabled and not any(grad_enabled), "validation builds no autograd graph"
    assert set(per_source) == {"same", "noise"} and per_source["same"] < per_source["noise"]
    assert abs(overall - (per_source["same"] + per_source["noise"]) / 2) < 1e-9, "equal token counts: plain mean"
    assert all(len(rows) == 2 and rows == sorted(rows) for rows in read) and len(read) == 6
    assert read[:2] == read[2:4] and read[:2] != read[4:] and limited[0] == limited[1]
    assert read[0][0] < 3 <= read[1][0], "two of each source"
    assert limited[0][1]["same"] == per_source["same"], "a source of one repeated token scores alike on any rows"


def test_the_chunked_loss_equals_cross_entropy_and_keeps_no_full_fp32_logits():
    """Loss and gradients equal a plain cross-entropy's; for the backward pass nothing of the logits' size is kept
    in fp32 (a plain cross-entropy on bf16 logits keeps an fp32 log-softmax of (batch, length, vocab))."""
    import torch
    import torch.nn.functional as F

    from amalia_ray.train.loss import next_token_loss

    torch.manual_seed(0)
    batch, length, vocab = 3, 40, 1000
    labels = torch.randint(0, vocab, (batch, length))
    labels[0, :5] = -100  # not targets (a prompt, padding)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        logits = torch.randn(batch, length, vocab).to(dtype).requires_grad_()
        saved = []

        def keep(t):
            saved.append((t.dtype, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss, count = next_token_loss(logits, labels)
        loss.backward()
        grad = logits.grad.clone()
        logits.grad = None
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        plain = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), ignore_index=-100,
                                reduction="sum")
        plain.backward()
        assert count == int((targets != -100).sum())
        assert abs(loss.item() - plain.item()) <= tol * abs(plain.item())
        assert torch.allclose(grad.float(), logits.grad.float(), atol=tol)
        if dtype == torch.bfloat16:
            assert not [n for d, n in saved if d == torch.float32 and n >= length * vocab], saved


def test_a_worker_given_gpus_that_cuda_cannot_see_fails_naming_why():
    """Ray gave the worker a GPU, torch cannot use CUDA (here: a CPU-only build; on a node: a driver older than the
    CUDA build): the worker fails saying so instead of training on the CPU."""
    import torch

    from amalia_ray.train.parallel import worker_device

    with pytest.raises(RuntimeError, match=r"given GPU\(s\) \[0\] but CUDA is unavailable to torch .*CPU-only build"):
        worker_device([0], cuda_available=False)
    assert worker_device([], cuda_available=False) == torch.device("cpu")
    assert worker_device([], cuda_available=True) == torch.device("cpu"), "a GPU it was not given is not its own"


def test_bf16_runs_reduce_gradients_in_bf16_unless_asked_for_fp32():
    import torch

    from amalia_ray.core.config import PretrainStage
    from amalia_ray.train.parallel import mixed_precision

    default = PretrainStage.model_fields["reduce_precision"].default
    assert mixed_precision("bf16", default).reduce_dtype == torch.bfloat16
    assert mixed_precision("bf16", "fp32").reduce_dtype == torch.float32
    assert mixed_precision("bf16", default).param_dtype == torch.bfloat16
    assert mixed_precision("fp32", default).param_dtype is None, "fp32 runs stay fp32"
    assert mixed_precision("bf16", default, sync_once=True).reduce_dtype == torch.float32, \
        "micro-batches summed between syncs are summed in fp32"


class _NextTokens:
    """A stand-in objective: next-token cross-entropy over fixed rows of tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def batch(self, rows, split="train"):
        return {"input_ids": self.tokens[rows]}

    def loss(self, model, batch):
        import torch.nn.functional as F

        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        targets = batch["input_ids"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"), targets.numel()

    def take_metrics(self):
        return {}


def _grads_both_ways(rank, world, port, folder, out):
    import json
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from amalia_ray.train.loop import accumulate_gradients
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    model = build(AutoConfig.from_pretrained(folder), cpu, lambda m: apply_fsdp(m, "fp32", 2),  # every 2nd block
                  init_dir=Path(folder), seed=0)
    recomputed = ["CheckpointWrapper" in type(layer).__name__ for layer in model.model.layers]
    objective = _NextTokens(torch.randint(3, 500, (12, 16), generator=torch.Generator().manual_seed(0)))
    passes = local_micro_batches(np.arange(12), 2, rank, world)
    grads, losses = [], []
    for sync_once in (False, True):
        loss, items, _, _ = accumulate_gradients(model, objective, passes, cpu, sync_once=sync_once)
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        losses.append(loss)
        model.zero_grad(set_to_none=True)
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"diff": diff, "losses": losses, "passes": len(passes),
                                                         "recomputed": recomputed}))
    dist.destroy_process_group()


def test_syncing_gradients_once_a_step_gives_the_gradients_of_syncing_every_micro_batch(tmp_path):
    """FSDP2 on 2 gloo ranks, 3 micro-batches each: reduce-scattering after the last micro-batch only gives the same
    gradients (within 1e-6) and losses as after every one. (Selective activation checkpointing: every 2nd block.)"""
    import json

    import torch.multiprocessing as mp

    from tests.base_models import make_base_model
    from tests.conftest import free_port

    folder = make_base_model(tmp_path / "model", "llama", with_tokenizer=False)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_grads_both_ways, args=(2, free_port(), str(folder), str(out)), nprocs=2)
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["passes"] == 3 and got["diff"] < 1e-6 and got["losses"][0] == pytest.approx(got["losses"][1]), got
        assert got["recomputed"] == [i % 2 == 0 for i in range(len(got["recomputed"]))] and len(got["recomputed"]) > 1


def test_compile_auto_compiles_on_gpu_only():
    import torch

    from amalia_ray.core.config import PretrainStage
    from amalia_ray.train.parallel import resolve_compile

    default = PretrainStage.model_fields["compile"].default
    assert resolve_compile(default, torch.device("cuda", 0)) and not resolve_compile(default, torch.device("cpu"))
    assert resolve_compile(True, torch.device("cpu")) and not resolve_compile(False, torch.device("cuda", 0))


def test_each_recipe_objective_is_one_registered_class_built_from_its_own_typed_stage(tmp_path):
    """One table from the recipe's `objective` to the class the loop builds, the stage model it is built from, the
    metrics a sweep may ask of it and the report panel it is drawn on; the stage reaches it typed, never as a dict."""
    import re
    from pathlib import Path

    from amalia_ray.core.config import STAGE_TYPES, train_stage
    from amalia_ray.pipeline.report import LOSS_PANELS
    from amalia_ray.train.objectives.base import StageInputs
    from amalia_ray.train.objectives.registry import OBJECTIVES, build_objective

    assert {name: cls.config for name, cls in OBJECTIVES.items()} == STAGE_TYPES
    assert all(cls.loss_panel in LOSS_PANELS for cls in OBJECTIVES.values())
    grpo = train_stage({"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 20,
                        "rewards": ["format", "has_number"]})
    assert {"reward", "kl", "rewards/has_number", "loss"} <= OBJECTIVES["grpo"].reported(grpo)
    pretrain = train_stage({"name": "pt", "objective": "pretrain", "steps": 20})
    assert "val_loss/web" in OBJECTIVES["pretrain"].reported(pretrain, ["web"])
    with pytest.raises(TypeError, match="built from a SFTStage"):
        build_objective(pretrain.model_copy(update={"objective": "sft"}), StageInputs(tmp_path, tmp_path, 8, tmp_path, 0))
    train = Path(__file__).resolve().parent.parent / "amalia_ray" / "train"
    dict_reads = [f"{f.name}:{n}" for f in train.rglob("*.py") for n, line in enumerate(f.read_text().splitlines(), 1)
                  if re.search(r"\bstage(\[[\"']|\.get\()", line)]
    assert not dict_reads, f"a training stage read as a dict: {dict_reads}"


def test_the_text_ray_train_keeps_of_a_workers_config_holds_no_secret(tmp_path):
    """Ray Train keeps the text of `train_loop_config` in its run state: the checkpoint signing key and the recipe
    (storage credentials) stay out of it."""
    from pathlib import Path

    from amalia_ray.cluster.plan import StepTransient
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.train.loop import LoopConfig

    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml").recipe
    recipe = recipe.model_copy(update={"run": recipe.run.model_copy(
        update={"storage_options": {"secret_key": "storage-secret-0123"}})})
    config = {"run": LoopConfig(stage=recipe.train[0], hf_config={}, data_dir=tmp_path, tokenizer_dir=tmp_path,
                                stage_dir=tmp_path, export_dir=tmp_path, seed=0, checkpoint_key="signing-key-4567",
                                step_transient=StepTransient(recipe.train[0], recipe, None))}
    text = str(config)
    assert "storage-secret-0123" not in text and "signing-key-4567" not in text
    assert "StepTransient(stage=" in text, "what the workers are given is still readable"


def _hsdp_against_fsdp(rank, world, port, folder, out):
    """Two optimizer steps of the same model sharded over all ranks (FSDP) and within pairs of ranks (HSDP), from
    a checkpoint whose vocabulary grows by 8 rows; then the HSDP state saved with DCP and loaded into a flat model."""
    import json
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import Replicate, Shard
    from transformers import AutoConfig

    from amalia_ray.train.loop import accumulate_gradients
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp, data_parallel_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    config = AutoConfig.from_pretrained(folder)
    grown = config.vocab_size + 8
    config.vocab_size = grown
    objective = _NextTokens(torch.randint(3, grown, (16, 16), generator=torch.Generator().manual_seed(0)))
    passes = local_micro_batches(np.arange(16), 2, rank, world)

    def trained(mesh):
        model = build(config, cpu, lambda m: apply_fsdp(m, "fp32", False, mesh=mesh), init_dir=Path(folder), seed=0,
                      new_token_ids=list(range(grown - 8, grown)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for _ in range(2):
            loss, items, _, _ = accumulate_gradients(model, objective, passes, cpu)
            total = torch.tensor([loss, float(items)], dtype=torch.float64)
            dist.all_reduce(total)
            for p in model.parameters():  # the loop's rescaling: FSDP averages over ranks, the loss is per token
                p.grad.mul_(world / total[1].item())
            grads.append([p.grad.full_tensor() for p in model.parameters()])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total[0].item() / total[1].item())
        return model, losses, grads

    flat, flat_losses, flat_grads = trained(None)
    mesh = data_parallel_mesh("cpu", world, 2)
    hsdp, hsdp_losses, hsdp_grads = trained(mesh)
    weight = hsdp.model.embed_tokens.weight
    grad_diff = max((a - b).abs().max().item() for step in range(2) for a, b in zip(flat_grads[step], hsdp_grads[step]))
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(flat.parameters(), hsdp.parameters()))
    dcp.save(get_model_state_dict(hsdp), checkpoint_id=str(Path(out) / "dcp"))
    reloaded = build(config, cpu, lambda m: apply_fsdp(m, "fp32", False), init_dir=None, seed=1)
    state = get_model_state_dict(reloaded)
    dcp.load(state, checkpoint_id=str(Path(out) / "dcp"))
    reload_diff = max((state[k].full_tensor() - v.full_tensor()).abs().max().item()
                      for k, v in get_model_state_dict(hsdp).items())
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "flat": flat_losses, "hsdp": hsdp_losses, "grad_diff": grad_diff, "diff": diff, "reload_diff": reload_diff,
        "mesh": list(mesh.shape), "hsdp_placements": [type(p).__name__ for p in weight.placements],
        "hsdp_local_rows": weight.to_local().shape[0],
        "flat_local_rows": flat.model.embed_tokens.weight.to_local().shape[0],
        "sharded": [type(p).__name__ for p in weight.placements] == [Replicate.__name__, Shard.__name__],
        "fallback": data_parallel_mesh("cpu", world, 3) is None and data_parallel_mesh("cpu", world, 4) is None}))
    dist.destroy_process_group()


def test_hsdp_trains_as_fsdp_does_with_each_weight_split_within_a_group_only(tmp_path):
    """4 gloo ranks: HSDP (2 replicas × 2 shards) and FSDP over all 4 give the same losses and gradients in two
    AdamW steps (within 1e-6; the weights within 1e-3 of a step: Adam divides out a gradient's size, so the last
    bit of the smallest gradients, summed in another order, shows), starting from a checkpoint whose vocabulary grew (new rows at the mean of the shard
    group's rows); each HSDP rank holds half of each weight, not a quarter; a DCP checkpoint of the HSDP model loads
    into the flat one. A shard size that does not divide the world (3) or covers it (4) shards over every rank."""
    import json

    import torch.multiprocessing as mp

    from tests.base_models import make_base_model
    from tests.conftest import free_port

    folder = make_base_model(tmp_path / "model", "llama", with_tokenizer=False, dtype="float32")
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_hsdp_against_fsdp, args=(4, free_port(), str(folder), str(out)), nprocs=4)
    for rank in range(4):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["hsdp"] == pytest.approx(got["flat"], abs=1e-6) and got["grad_diff"] < 1e-6, got
        assert got["diff"] < 1e-3 * 1e-2, got  # lr 1e-2
        assert got["hsdp"][1] < got["hsdp"][0], got
        assert got["mesh"] == [2, 2] and got["sharded"] and got["fallback"], got
        assert got["hsdp_local_rows"] == 2 * got["flat_local_rows"], got
        assert got["reload_diff"] == 0.0, got


@pytest.mark.parametrize("stop_at", [None, 3, 4])
def test_a_stop_seen_while_a_checkpoint_is_written_stops_at_that_checkpoint(monkeypatch, stop_at):
    """The loop's order with checkpoints written in the background (checkpoint_every 2, 5 steps): each is finished
    and reported after the step that follows it, the last step's is written in place. A stop seen at step 3, while
    step 2's checkpoint is being written, finishes that one and stops there without saving step 3 (the time before
    the limit holds one save, not two); a stop seen at step 4 saves step 4 in place."""
    import types

    import ray.train

    from amalia_ray.train import loop

    calls = []
    stage = types.SimpleNamespace(name="s", steps=5, checkpoint_every=2, log_every=1, micro_batch_size=1,
                                  validation_rows=None)
    t = types.SimpleNamespace(stage=stage, start_step=0, rank=0, world=1, model=None, objective=None, device=None,
                              board=None, pending=None, run=types.SimpleNamespace(seed=0))

    def save(t, record, wait):
        calls.append(("save", record["step"], "in place" if wait else "background"))
        t.pending = None if wait else record["step"]

    def finish(t):
        if t.pending is not None:
            calls.append(("finished", t.pending))
            t.pending = None

    monkeypatch.setattr(loop, "setup", lambda run: t)
    monkeypatch.setattr(loop, "_announce", lambda t: None)
    monkeypatch.setattr(loop, "train_step", lambda t, step: ({"step": step + 1}, step + 1 == stop_at))
    monkeypatch.setattr(loop, "describe_collectives", lambda t: {})
    monkeypatch.setattr(loop, "validation_losses", lambda *a: (1.0, {}))
    monkeypatch.setattr(loop, "_write_record", lambda t, record, save_now: None)
    monkeypatch.setattr(loop, "save_checkpoint", save)
    monkeypatch.setattr(loop, "finish_checkpoint", finish)
    monkeypatch.setattr(loop, "export", lambda t: calls.append(("export",)))
    monkeypatch.setattr(ray.train, "report", lambda record, **kw: calls.append(("report", record["step"])))
    loop.train_loop({"run": None})
    if stop_at is None:
        assert calls == [("report", 1), ("save", 2, "background"), ("finished", 2), ("report", 3),
                         ("save", 4, "background"), ("finished", 4), ("save", 5, "in place"), ("export",)], calls
    elif stop_at == 3:
        assert calls == [("report", 1), ("save", 2, "background"), ("finished", 2)], calls
    else:
        assert calls == [("report", 1), ("save", 2, "background"), ("finished", 2), ("report", 3),
                         ("save", 4, "in place")], calls


def test_a_metrics_line_cut_short_is_left_out_not_fatal(tmp_path):
    """Rank 0 killed while it appended a step: the next attempt, dropping the steps after its checkpoint, keeps the
    whole records and leaves out the cut one (it raised JSONDecodeError on every later attempt); the driver's
    summary and the report read the same records."""
    from amalia_ray.core.formats.step_metrics import read_step_records
    from amalia_ray.train.loop import _log

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert [r["step"] for r in read_step_records(path)] == [1, 2, 3, 4]
    _log(path, {"step": 4, "loss": 0.3}, keep_through=3)
    assert [(r["step"], r["loss"]) for r in read_step_records(path)] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.3)]
    assert path.read_text().count("\n") == 4 and not (tmp_path / "metrics.jsonl.partial").exists()


def _new_model_on_ranks(rank: int, world: int, port: int, out: str) -> None:
    """A new tiny Llama built sharded over `world` gloo ranks: its full weights, gathered, saved by rank 0."""
    import os

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", False), init_dir=None, seed=3)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(out, f"world{world}.pt"))
    dist.destroy_process_group()


def test_a_new_model_is_initialized_as_transformers_does_whatever_the_ranks_without_a_whole_copy(tmp_path):
    """A model trained from scratch is built on the meta device and sharded before it has weights (at 9B a whole
    fp32 copy per rank is 36 GB of host memory, times 8 ranks a node): transformers' _init_weights fills each
    module's weights as it would (norms 1, linear and embedding weights N(0, initializer_range)), from a seed per
    module, so 1 rank and 2 ranks give the same model; another seed another one."""
    import torch
    import torch.multiprocessing as mp
    from transformers import LlamaConfig

    from amalia_ray.train.model import build
    from tests.conftest import free_port

    for world in (1, 2):
        mp.spawn(_new_model_on_ranks, args=(world, free_port(), str(tmp_path)), nprocs=world)
    one, two = (torch.load(tmp_path / f"world{w}.pt", weights_only=True) for w in (1, 2))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    norms = [k for k in one if "norm" in k]
    assert norms and all(torch.equal(one[k], torch.ones_like(one[k])) for k in norms)
    for k in (k for k in one if k not in norms):
        assert abs(one[k].std().item() - 0.02) < 0.002 and abs(one[k].mean().item()) < 0.002, k
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    other = build(config, torch.device("cpu"), lambda m: None, init_dir=None, seed=4)
    assert not torch.equal(dict(other.named_parameters())["model.embed_tokens.weight"].detach(),
                           one["model.embed_tokens.weight"])
