"""Run by tests/test_multinode.py in its own process: a hub base model on a two-node Ray cluster whose nodes have
Hugging Face caches of their own (`ray.cluster_utils.Cluster`, each node's raylet, and so its workers, started with
its own HF_HOME). The model is in the head's cache only, as `huggingface-cli download` on the head would leave it;
the worker node's cache is empty and offline. The driver resolves the hub id and places the snapshot in the run
folder as the pipeline does (`pipeline/stages.py` `base_model_dir`), the head's cache is then deleted (what a worker
on another machine sees of it: nothing), and an SFT stage trains from the base on the worker node and exports.

    python -m tests.hub_cache_job OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tests.conftest import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny-base"


def hub_cache(cache: Path, model: Path) -> None:
    """`model`'s files laid out as huggingface_hub caches a download: blobs, a snapshot of links, refs/main."""
    repo = cache / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        blob = repo / "blobs" / f"{abs(hash(str(f.relative_to(model)))):x}"
        shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def main(out: Path) -> None:
    head_cache, worker_cache = out / "head-hf", out / "worker-hf"
    worker_cache.mkdir()
    os.environ.update(HF_HOME=str(head_cache), HF_HUB_OFFLINE="1")  # before huggingface_hub reads them
    import ray
    from ray.cluster_utils import Cluster

    from amalia_ray.core import hf_model
    from amalia_ray.core.config import ModelConfig, SFTStage
    from amalia_ray.data.posttrain.faq_chats import write_faq_conversations
    from amalia_ray.train.train_stage import run_train_stage
    from tests.base_models import FAQ, make_base_model

    hub_cache(head_cache, make_base_model(out / "published", "llama"))
    shutil.rmtree(out / "published")
    chats = out / "faq-chat.jsonl"
    write_faq_conversations(FAQ, chats)
    # the head fits no training worker (1 CPU): the stage's one worker of 2 CPUs lands on the worker node
    head = {"num_cpus": 1, "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port(), "env_vars": {"HF_HOME": str(head_cache)}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=3, dashboard_agent_listen_port=free_port(), metrics_export_port=free_port(),
                     runtime_env_agent_port=free_port(),
                     env_vars={"HF_HOME": str(worker_cache), "HF_HUB_OFFLINE": "1"})
    cluster.wait_for_nodes()
    result: dict = {}
    try:
        ray.init(address=cluster.address)
        run_dir = out / "run"
        base = hf_model.stage_snapshot(hf_model.resolve(REPO), run_dir / "hub")  # as base_model_dir does
        result["base"] = str(base)
        shutil.rmtree(head_cache)  # nothing of the head's cache is left for any worker to read
        stage = SFTStage(name="sft", objective="sft", dataset=str(chats), steps=2, seq_len=128,
                         global_batch_size=2, micro_batch_size=2, num_workers=1, cpus_per_worker=2, warmup_steps=0,
                         lr=1e-3, checkpoint_every=2, log_every=1)
        metrics = run_train_stage(stage, ModelConfig.model_validate({"from": REPO}), data_dir=chats,
                                  tokenizer_dir=base, init_hf_dir=base, base_dir=base, stage_dir=run_dir / "sft",
                                  ray_run_name="sft", seed=0, use_gpu=False, progress=False)
        result["metrics"] = {k: metrics.get(k) for k in ("step", "loss", "worker_nodes")}
        result["head_node"] = ray.get_runtime_context().get_node_id()
        result["exported"] = sorted(p.name for p in (run_dir / "sft" / "hf").iterdir())
        history = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines() if line]
        result["steps"] = [h["step"] for h in history]
        result["worker_caches"] = sorted(str(p.relative_to(worker_cache)) for p in worker_cache.rglob("*"))
    except Exception as e:  # noqa: BLE001 - reported to the test with the traceback
        import traceback

        result["error"] = "".join(traceback.format_exception(e))[-6000:]
    finally:
        (out / "result.json").write_text(json.dumps(result))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)
    main(Path(sys.argv[1]))
