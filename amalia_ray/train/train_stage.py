"""Run one training stage as a Ray Train `TorchTrainer` (FSDP2 workers), resumable and with a failure budget."""

from __future__ import annotations

import json
import re
from pathlib import Path

from amalia_ray.core.config import ModelConfig, TrainStageConfig
from amalia_ray.core.formats.step_metrics import read_step_records
from amalia_ray.core.vocabulary import read_extension
from amalia_ray.train.loop import LoopConfig, train_loop
from amalia_ray.train.model import base_config, llama_config
from amalia_ray.train.progress import StageProgress


def _plain(error: Exception) -> Exception:
    """A worker's failure to write a checkpoint as the one clear line it is, instead of Ray Train's report of every
    worker's traceback."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.train.checkpoint import CheckpointWriteError

    for failure in (getattr(error, "worker_failures", None) or {}).values():
        cause, depth = failure, 0
        while cause is not None and not isinstance(cause, CheckpointWriteError) and depth < 8:
            # Ray Train wraps a worker's exception (_base_exc), Ray's task errors carry it as `cause`
            cause = cause.__cause__ or getattr(cause, "_base_exc", None) or getattr(cause, "cause", None)
            depth += 1
        if isinstance(cause, CheckpointWriteError):  # its one argument is the message; str() may add a traceback
            return AmaliaError(cause.args[0] if cause.args else str(cause))
    # however Ray wrapped it on the way, the worker's error text names it
    if match := re.search(rf"{CheckpointWriteError.__name__}: (.+)", str(error)):
        return AmaliaError(match.group(1).strip())
    return error


def hf_config_dict(model_cfg: ModelConfig, tokenizer_dir: Path, base_dir: Path | None = None) -> dict:
    """The transformers config of the model a stage trains: the base model's own (with the recipe's RoPE scaling and
    attention kernel), or a new Llama of the recipe's dimensions sized to the trained tokenizer."""
    from transformers import AutoTokenizer

    from amalia_ray.core.errors import AmaliaError

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if model_cfg.base:
        if base_dir is None:
            raise ValueError("a base model's folder is needed to read its config")
        config = base_config(model_cfg, base_dir)
        sized = config if "vocab_size" in config else config.get("text_config") or {}
        vocab = sized.get("vocab_size")
        if vocab and len(tok) > vocab:
            if not read_extension(tokenizer_dir):
                raise AmaliaError(f"the tokenizer in {tokenizer_dir} has {len(tok)} tokens, the base model's "
                                  f"embeddings {vocab}: use the base model's own tokenizer (tokenizer: "
                                  "{from: model}), extended with tokenizer.add_tokens if it needs more")
            sized["vocab_size"] = len(tok)  # the embeddings and LM head grow to the extended vocabulary
        return config
    eos_ids = [tok.eos_token_id] + [i for i in tok.convert_tokens_to_ids(["<|end|>"]) if i != tok.unk_token_id]
    return {**llama_config(model_cfg, len(tok), tok.bos_token_id, eos_ids, tok.pad_token_id).to_dict(),
            "attn_implementation": model_cfg.attn_implementation}


def generation_config_of(folder: Path | None) -> dict | None:
    """A checkpoint's own generation settings (EOS ids, sampling defaults), kept by the export; None if it has none."""
    if folder is None or not (Path(folder) / "generation_config.json").is_file():
        return None
    return json.loads((Path(folder) / "generation_config.json").read_text())


def run_train_stage(
    stage: TrainStageConfig,
    model_cfg: ModelConfig,
    *,
    data_dir: Path,
    tokenizer_dir: Path,
    init_hf_dir: Path | None,
    stage_dir: Path,
    ray_run_name: str,
    seed: int,
    use_gpu: bool,
    hf_config: dict | None = None,
    base_dir: Path | None = None,
    storage_path: str | None = None,
    storage_filesystem=None,
    callbacks: list | None = None,
    progress: bool = True,
    stop_file: Path | None = None,
    step_transient=None,
    reward_apps: dict[str, str] | None = None,
    judge_servers: dict[str, dict] | None = None,
) -> dict:
    """Train, export `stage_dir/hf`, return the final metrics. Re-running with the same `ray_run_name` resumes from
    the latest checkpoint Ray Train recorded for it. When `stop_file` appears, the workers checkpoint and stop early
    (StageStopped), to be resumed by the next run. Checkpoints go to `storage_path` (a path inside the pyarrow
    `storage_filesystem`, e.g. a bucket prefix), by default `stage_dir/ray`. `init_hf_dir` is the checkpoint the
    stage starts from (a base model's folder or the previous stage's export; None: random weights); `base_dir` the
    base model whose config gives the architecture (model.from); `step_transient(tokens)` what a step adds
    above the sharded training state at sequences of that many tokens (`amalia plan`'s arithmetic), left free beside
    a colocated rollout engine. `reward_apps`: each reward model the stage's rewards name (as the recipe names it)
    -> the Ray Serve application serving it (serve/reward_server.py); `judge_servers`: each judge reward's stage ->
    {base_url, model, api_key_env} of the server the pipeline runs it on."""
    from amalia_ray.train.hf_weights import stored_dtype

    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from amalia_ray.train.parallel import process_group_backend
    from amalia_ray.train.process_group import RendezvousTorchConfig

    from amalia_ray.core.secrets import remember
    from amalia_ray.core.signing import signing_key

    stage_dir.mkdir(parents=True, exist_ok=True)
    export_dir = stage_dir / "hf"
    remember(key := signing_key())
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"run": LoopConfig(
            stage=stage,
            hf_config=hf_config or hf_config_dict(model_cfg, tokenizer_dir, base_dir),
            trust_remote_code=model_cfg.trust_remote_code,
            data_dir=Path(data_dir),
            tokenizer_dir=Path(tokenizer_dir),
            init_hf_dir=Path(init_hf_dir) if init_hf_dir else None,
            # starting from the base with an extended vocabulary: these embedding and LM-head rows are new
            new_token_ids=tuple((read_extension(tokenizer_dir) or {}).get("new_ids", []))
            if init_hf_dir is not None and init_hf_dir == base_dir else (),
            # the export keeps the starting checkpoint's dtype and generation settings (a new model: fp32, its ids)
            export_dtype=stored_dtype(Path(init_hf_dir)) if init_hf_dir else None,
            generation_config=generation_config_of(init_hf_dir or base_dir),
            stage_dir=Path(stage_dir),
            export_dir=Path(export_dir),
            seed=seed,
            stop_file=Path(stop_file) if stop_file else None,
            step_transient=step_transient,
            reward_apps=dict(reward_apps or {}),
            judge_servers=dict(judge_servers or {}),
            run_id=ray_run_name,
            checkpoint_key=key,  # masked wherever it might be printed, and left out of the config's repr
        )},
        torch_config=RendezvousTorchConfig(backend=process_group_backend(use_gpu)),
        scaling_config=ScalingConfig(
            num_workers=stage.num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": stage.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
            placement_strategy=stage.placement,
            elastic_resize_monitor_interval_s=stage.elastic_resize_interval_s,
        ),
        run_config=RunConfig(
            name=ray_run_name,
            storage_path=storage_path or str((stage_dir / "ray").resolve()),
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=stage.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=stage.checkpoints_to_keep),
            callbacks=callbacks,
        ),
    )
    try:
        if progress:
            with StageProgress(stage.name, stage_dir / "metrics.jsonl", stage.steps):
                result = trainer.fit()
        else:
            result = trainer.fit()
        if result.error:
            raise result.error
    except Exception as e:  # noqa: BLE001 - Ray Train raises the workers' failure once the budget is spent
        if (plain := _plain(e)) is e:
            raise
        raise plain from None
    final = dict(result.metrics or {})
    if final.get("step") is not None and final["step"] < stage.steps:
        from amalia_ray.core.stop import StageStopped

        raise StageStopped(f"[{stage.name}] stopped on request at step {final['step']} of {stage.steps}, its "
                           "checkpoint saved: run the same recipe again to carry on from it")
    final.update(summarize_history(read_step_records(stage_dir / "metrics.jsonl"), final.get("loss")))
    final["placement"] = stage.placement
    final["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    return final


def summarize_history(history: list[dict], last_loss: float | None = None) -> dict:
    """What a stage's step records add up to: the first and last loss, tokens trained, the mean number of workers
    (weighted by how long each size trained: an elastic run changes size) and the layouts it ran in."""
    summary: dict = {}
    if history:
        summary["loss"] = last_loss if last_loss is not None else history[-1]["loss"]
        summary["first_loss"] = history[0]["loss"]
    summary["tokens_trained"] = sum(r["tokens"] for r in history)
    busy = sum(r["step_time_s"] for r in history)
    if busy:
        summary["mean_world_size"] = sum(r["step_time_s"] * r["world_size"] for r in history) / busy
    layouts: list[tuple[int, int]] = []  # (workers, nodes) as the run went: an elastic run shrinks or grows
    for r in history:
        if (layout := (r["world_size"], r.get("worker_nodes", 1))) not in layouts[-1:]:
            layouts.append(layout)
    summary["worker_nodes"] = max((n for _, n in layouts), default=None)
    summary["worker_layout"] = " → ".join(f"{w} on {n} node(s)" for w, n in layouts)
    # what each attempt's first step found: the sharding and the network the collectives crossed nodes on
    for key in ("sharding", "transport"):
        if seen := list(dict.fromkeys(r[key] for r in history if r.get(key))):
            summary[key] = " → ".join(seen)
    return summary
