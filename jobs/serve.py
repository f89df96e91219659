"""Deploy a run's trained checkpoints with Ray Serve + vLLM on the cluster the job was submitted to, and leave them
serving after the job ends (Serve applications outlive the driver), as the application `amalia-<run>-serve`.
Stop with `amalia serve --stop --app amalia-<run>-serve --address …`.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.serve RECIPE [--stage sft]
"""

from __future__ import annotations

import argparse
import os
import sys

from amalia_ray.cluster.local import ray_session, resolve_use_gpu
from amalia_ray.core import secrets
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline
from amalia_ray.pipeline.stages import served_models
from amalia_ray.serve import app as serve_app
from jobs.pipeline import failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--run-name")
    parser.add_argument("--stage", action="append", help="serve this train stage's checkpoint (repeatable; "
                        "default: every train stage)")
    parser.add_argument("--allow-no-auth", action="store_true", help="serve off loopback with no API key: anyone "
                        "who reaches the port may use the models")
    args = parser.parse_args(argv)
    secrets.install_log_masking()
    try:
        if not os.environ.get("RAY_ADDRESS"):
            raise AmaliaError("jobs.serve deploys onto a cluster (RAY_ADDRESS is not set); on this machine use "
                              "`amalia serve CHECKPOINT...`")
        pipeline = Pipeline(load_recipe(args.recipe), run_name=args.run_name)
        names = args.stage or [s.name for s in pipeline.recipe.policy_stages]
        if unknown := set(names) - {s.name for s in pipeline.recipe.train}:
            raise AmaliaError(f"unknown train stage(s) {sorted(unknown)}")
        if scorers := sorted(set(names) - {s.name for s in pipeline.recipe.policy_stages}):
            raise AmaliaError(f"train stage(s) {scorers} train reward models, which score text and do not generate: "
                              "there is nothing of them to serve on the OpenAI API")
        # as the eval stage serves them: LoRA stages as adapters on the engine of the checkpoint they were trained from
        engines, adapters = served_models(pipeline)
        wanted = {pipeline.model_id(n) for n in names}
        adapters = {m: {a: path for a, path in named.items() if pipeline.model_id(a) in wanted}
                    for m, named in adapters.items()}
        adapters = {m: named for m, named in adapters.items() if named}
        models = {m: path for m, path in engines.items() if m in wanted or m in adapters}
        if missing := [str(p) for p in models.values() if not (p / "config.json").exists()] + [
                str(p) for named in adapters.values() for p in named.values() if not p.is_dir()]:
            raise AmaliaError(f"no exported checkpoint at {', '.join(missing)}: run the training stages first")
        with ray_session():
            name = serve_app.app_name(f"{pipeline.run_name}-serve")
            cfg = pipeline.recipe.serve.model_copy(update={"allow_no_auth": True}) if args.allow_no_auth \
                else pipeline.recipe.serve
            url = serve_app.start(models, cfg, resolve_use_gpu(pipeline.recipe.resources.device), name,
                                  adapters).base_url
        served = [*models, *(serve_app.adapter_id(m, a) for m, named in adapters.items() for a in named)]
    except Exception as e:  # noqa: BLE001 - the job's log is where a user reads why it failed
        return failed(e)
    print(f"serving {', '.join(served)} at {url} as Serve application '{name}' (stop: amalia serve --stop --app "
          f"{name} --address …)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
