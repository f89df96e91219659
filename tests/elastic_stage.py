"""Run by test_e2e in its own process (a Ray cluster of its own): a training stage with `num_workers: [1, 2]` on a
three-node local cluster (`ray.cluster_utils.Cluster`: a head, and two nodes that each fit one training worker);
one node is removed after the first checkpoint and the stage must carry on with the worker that is left.

    python -m tests.elastic_stage PACK_DIR TOKENIZER_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def main(pack_dir: Path, tokenizer_dir: Path, out: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from amalia_ray.core.config import ModelConfig, TrainStageConfig
    from amalia_ray.train.stage import run_train_stage

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    stage = TrainStageConfig(name="elastic", objective="pretrain", steps=30, global_batch_size=8, micro_batch_size=4,
                             num_workers=(1, 2), cpus_per_worker=2, warmup_steps=2, checkpoint_every=5,
                             max_failures=2, log_every=1, lr=0.003)
    model = ModelConfig(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=2,
                        max_position_embeddings=256)
    removed: dict = {}

    def remove_a_node_after_the_first_checkpoint() -> None:
        metrics = out / "elastic" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if ln] if metrics.exists() else []
            if steps and max(steps) >= 7:  # past the checkpoint of step 5
                removed["at_step"] = max(steps)
                cluster.remove_node(nodes[1])
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=remove_a_node_after_the_first_checkpoint, daemon=True)
    watcher.start()
    result = run_train_stage(stage, model, data_dir=pack_dir, tokenizer_dir=tokenizer_dir, init_hf_dir=None,
                             stage_dir=out / "elastic", ray_run_name="elastic", seed=0, use_gpu=False)
    watcher.join(timeout=5)
    (out / "result.json").write_text(json.dumps({"removed_at_step": removed.get("at_step"),
                                                 "final_step": result.get("step")}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
