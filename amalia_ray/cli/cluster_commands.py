"""Cluster commands: `amalia plan`, `amalia submit`, `amalia logs`, `amalia stop`, `amalia slurm`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from amalia_ray.cli.common import DEFAULT_RECIPE, AddressOpt, RecipeArg, app, console, guarded
from amalia_ray.core.console import figure

PATHS_TO_SECRETS = ("GOOGLE_APPLICATION_CREDENTIALS",)  # named like a secret, holding where one is


@app.command()
@guarded
def submit(
    recipe: RecipeArg,
    address: AddressOpt = None,
    until: Annotated[str | None, typer.Option(help="last stage to run (default: all)")] = None,
    follow: Annotated[bool, typer.Option("--follow", help="stream the job's log until it ends")] = False,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE for the job's environment")] = None,
    pip: Annotated[list[str] | None, typer.Option("--pip", help="pip requirement installed for the job")] = None,
    uv: Annotated[list[str] | None, typer.Option("--uv", help="uv requirement installed for the job")] = None,
    working_dir: Annotated[Path, typer.Option(help="uploaded as the job's working directory")] = Path("."),
    python: Annotated[str, typer.Option(help="the cluster's Python for the entrypoint")] = "python",
    upload: Annotated[bool, typer.Option(help="upload the working directory (--no-upload: the cluster's image "
                                         "already has the project installed)")] = True,
) -> None:
    """Submit a recipe to a Ray cluster as a job (`python -m jobs.pipeline RECIPE`); prints the job id."""
    from amalia_ray.cluster import jobs
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.secrets import holds_secret, is_secret_key

    pairs = [e.split("=", 1) for e in env or []]
    if bad := [e for e, kv in zip(env or [], pairs) if len(kv) != 2 or not kv[0]]:
        raise AmaliaError(f"--env needs KEY=VALUE, got {bad}")
    if secret := [k for k, _ in pairs if is_secret_key(k) and k.upper() not in PATHS_TO_SECRETS]:
        raise AmaliaError(f"--env {secret[0]}=…: a job's environment is shown to anyone who can list the cluster's "
                          "jobs (`ray job list`), so secrets do not go there: set it on the cluster's nodes (KubeRay: "
                          "a Secret as the pods' environment; docs/cluster.md) and the job reads it from there")
    # the same for a secret recognised by its value: a URI's password (an MLflow or database URL, a private
    # package index in --pip, which pip on every node would also show on its command line), a token's shape
    given = [(f"--env {k}", v) for k, v in pairs] + [(f"--{flag} entry {i + 1}", v) for flag, values in
                                                     (("pip", pip), ("uv", uv)) for i, v in enumerate(values or [])]
    if leaky := [where for where, value in given if holds_secret(value)]:
        raise AmaliaError(f"{leaky[0]} holds a secret (a URI's password or a token): a job's runtime environment is "
                          "shown to anyone who can list the cluster's jobs (`ray job list`); give the nodes the "
                          "credential instead (an environment variable, a netrc file, pip's own configuration)")
    job_id = jobs.submit(recipe, address=address, until=until, env=dict(pairs), pip=pip, uv=uv,
                         working_dir=working_dir, python=python, upload=upload)
    console.print(job_id)
    if follow:
        final = jobs.follow(job_id, address, lambda text: console.out(text, end=""))
        console.print(f"job {job_id}: {final}")
        if final != "SUCCEEDED":
            raise typer.Exit(1)


@app.command()
@guarded
def logs(job_id: str, address: AddressOpt = None,
         follow: Annotated[bool, typer.Option("--follow", help="stream until the job ends")] = False) -> None:
    """Print a submitted job's log."""
    from amalia_ray.cluster import jobs

    if follow:
        console.print(f"job {job_id}: {jobs.follow(job_id, address, lambda t: console.out(t, end=''))}")
    else:
        console.out(jobs.logs(job_id, address), end="")


@app.command("stop")
@guarded
def stop_job(job_id: str, address: AddressOpt = None) -> None:
    """Stop a submitted job."""
    from amalia_ray.cluster import jobs

    console.print(f"job {job_id}: " + ("stop requested" if jobs.stop(job_id, address) else "already finished"))


@app.command()
@guarded
def plan(
    recipe: RecipeArg = DEFAULT_RECIPE,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Estimate per training stage: memory per GPU under FSDP2, step time at the recipe's MFU, GPU-hours, cost and
    energy. Exits 1 naming what to change when a stage cannot fit."""
    import dataclasses

    from amalia_ray.cluster.plan import Dims, parameter_count
    from amalia_ray.cluster.plan import plan as make_plan
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.recipe import load_recipe

    loaded = load_recipe(recipe)
    r = loaded.recipe
    hf_config = _base_config(loaded)
    dims = Dims.of(r, hf_config)
    plans = make_plan(r, hf_config)
    if as_json:
        console.print_json(json.dumps([dataclasses.asdict(p) | {"memory_total_gb": p.total_memory_gb}
                                       for p in plans]))
    else:
        params = parameter_count(dims)[0]
        hw = r.plan
        model = f"{r.model.base} ({params / 1e9:.2f} B parameters)" if r.model.base else f"{params / 1e9:.2f} B parameters"
        _print_plans([f"{recipe}: {model}", f"on {hw.gpu} ({hw.peak_tflops:.0f} TFLOP/s peak, MFU {hw.mfu:.0%}, "
                                            f"${hw.usd_per_gpu_hour}/GPU-h, {hw.watts_per_gpu:.0f} W/GPU)"], plans)
    if misfits := [p for p in plans if not p.fits]:
        raise AmaliaError("; ".join(f"stage '{p.stage}' cannot fit: {p.advice}" for p in misfits))


PLAN_COLUMNS = ("GPUs", "seq", "tokens/step", "memory/GPU (GB)", "step (s)", "GPU-hours", "cost ($)", "energy (kWh)",
                "tokens/J", "implied MFU")
NARROW_COLUMNS = 100  # at this width and below, and wherever the table would not fit whole: one block per stage


def _print_plans(title: list[str], plans: list) -> None:
    """A table, one row per stage, where it fits the terminal whole; else one block of `label: value` lines per
    stage (a table squeezed into 80 columns cuts its figures to a letter or two)."""
    from rich.measure import Measurement
    from rich.table import Table

    rows = {p.stage: [str(p.gpus), str(p.seq_len), f"{p.tokens_per_step:,}",
                      f"{p.total_memory_gb:.1f}" + ("" if p.fits else " ✗ does not fit"), figure(p.step_time_s),
                      figure(p.gpu_hours), figure(p.cost_usd), figure(p.energy_kwh), figure(p.tokens_per_joule),
                      f"{p.implied_mfu:.1%}" if p.implied_mfu else "–"] for p in plans}
    table = Table(title=" ".join(title))
    for col in ("stage", *PLAN_COLUMNS):
        table.add_column(col, justify="right", no_wrap=True)
    for stage, cells in rows.items():
        table.add_row(stage, *cells)
    width = console.width
    natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if width > NARROW_COLUMNS and natural <= width:
        console.print(table)
        for p in plans:
            console.print(f"{p.stage}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.memory_gb.items()) + " GB")
        _print_notes(plans)
        return
    console.print("\n".join(title), markup=False, soft_wrap=False)  # a long recipe path wraps, not the figures
    label_width = max(len(c) for c in (*PLAN_COLUMNS, *(k for p in plans for k in p.memory_gb))) + 4
    for p in plans:
        console.print(f"\n[bold]{p.stage}[/]")
        for label, value in zip(PLAN_COLUMNS, rows[p.stage]):
            console.print(f"  {label:<{label_width}}{value}", markup=False)
            if label == "memory/GPU (GB)":
                for item, gb in p.memory_gb.items():
                    console.print(f"    {item:<{label_width - 2}}{gb:.1f}", markup=False)
    _print_notes(plans)


def _print_notes(plans: list) -> None:
    for p in plans:
        for note in p.notes:
            console.print(f"{p.stage} ({p.nodes} node{'s' if p.nodes > 1 else ''}): {note}", markup=False)


def _base_config(loaded) -> dict | None:
    """A base model's config.json (model.config_file beside the recipe, else fetched alone); None without one."""
    from amalia_ray.core.hf_model import anchored, recipe_config

    r = loaded.recipe
    return recipe_config(anchored(r.model, loaded.resolve), loaded.resolve) if r.model.base else None


def _plans(loaded) -> list:
    from amalia_ray.cluster.plan import plan as make_plan

    return make_plan(loaded.recipe, _base_config(loaded))


@app.command()
@guarded
def slurm(
    recipe: RecipeArg = DEFAULT_RECIPE,
    nodes: Annotated[int, typer.Option(help="nodes of the allocation: Ray's head on the first, workers on the rest")] = 1,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (sbatch --gpus-per-node)")] = 0,
    cpus_per_node: Annotated[int | None, typer.Option(help="CPUs per node (default: whole nodes, --exclusive)")] = None,
    partition: Annotated[str | None, typer.Option(help="sbatch --partition")] = None,
    account: Annotated[str | None, typer.Option(help="sbatch --account (the project the hours are billed to)")] = None,
    time_limit: Annotated[str | None, typer.Option("--time", help="sbatch --time, e.g. 48:00:00")] = None,
    qos: Annotated[str | None, typer.Option(help="sbatch --qos")] = None,
    until: Annotated[str | None, typer.Option(help="last stage to run (default: all)")] = None,
    submit: Annotated[bool, typer.Option("--submit", help="sbatch the script and print the job id(s)")] = False,
    follow: Annotated[bool, typer.Option("--follow", help="print the jobs' output until they end")] = False,
    chain: Annotated[int, typer.Option(help="submit K jobs, each after the one before: a run longer than the "
                                       "time limit carries on from its checkpoint in the next")] = 1,
    sbatch_arg: Annotated[list[str] | None, typer.Option("--sbatch-arg", help="another #SBATCH line, e.g. "
                                                         "--sbatch-arg=--mem=0")] = None,
    module: Annotated[list[str] | None, typer.Option("--module", help="`module load` this first")] = None,
    setup: Annotated[Path | None, typer.Option(help="a shell script the job sources first")] = None,
    venv: Annotated[Path | None, typer.Option(help="virtual environment the job activates (default: this one)")] = None,
    scratch: Annotated[str, typer.Option(help="node-local folder for Ray's temporary files")] = "${TMPDIR:-/tmp}",
    ray_port: Annotated[int | None, typer.Option(help="port of Ray's head (default: a free one of the head node, "
                                                 "picked as the job starts)")] = None,
    dashboard_port: Annotated[int | None, typer.Option(help="port of Ray's dashboard on the head (default: a free "
                                                       "one)")] = None,
    stop_before: Annotated[int | None, typer.Option(
        help="seconds before the time limit the run checkpoints and stops (default: 1.5 × a step and a checkpoint "
             "of the slowest training stage, planned or measured in the run, plus 60 s; at least 120)")] = None,
    assume_shared: Annotated[bool, typer.Option("--assume-shared", help="skip the check that the run folder is on "
                                                "a filesystem every node sees")] = False,
    allow_no_auth: Annotated[bool, typer.Option("--allow-no-auth", help="start Ray without token auth: anyone "
                                                "who reaches the allocation's nodes can use it")] = False,
) -> None:
    """Run a recipe on a Slurm allocation: write the batch script (runs/<name>/slurm/job.sbatch) that starts Ray
    on the allocated nodes and runs the pipeline on it; --submit sends it to sbatch."""
    from amalia_ray.cluster import slurm as slurm_jobs
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline

    loaded = load_recipe(recipe)
    pipeline = Pipeline(loaded)
    pipeline.select(until)  # an unknown stage fails here, not in the queue
    if stop_before is None:
        try:
            plans = _plans(loaded)
        except (AmaliaError, ValueError) as e:  # a base model whose config cannot be had here: the floor
            plans = []
            console.print(f"(no plan to size the stop margin by: {e})")
        stop_before, why = slurm_jobs.stop_margin(plans, pipeline.run_dir)
        console.print(f"stopping {stop_before} s before the time limit ({why})")
    job = slurm_jobs.SlurmJob(
        recipe=recipe.resolve(), run_dir=pipeline.run_dir, nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node, partition=partition, account=account, qos=qos, time=time_limit, until=until,
        sbatch_args=sbatch_arg or [], modules=module or [], setup=setup.resolve() if setup else None,
        venv=(venv.resolve() if venv else slurm_jobs.default_venv()), scratch=scratch, ray_port=ray_port,
        dashboard_port=dashboard_port, stop_before_s=stop_before,
        token_path=None if allow_no_auth else slurm_jobs.auth_token(pipeline.run_dir / "slurm"))
    if not assume_shared:
        slurm_jobs.check_shared(job)
    script = slurm_jobs.write_script(job)
    console.print(f"batch script: {script}")
    if not submit:
        if follow or chain != 1:
            console.print("(--follow and --chain apply with --submit)")
        return
    ids = slurm_jobs.submit(job, script, chain)
    console.print(" ".join(ids))
    if follow:
        finals = slurm_jobs.follow(job, ids, lambda text: console.out(text, end=""))
        for job_id, state in finals.items():
            console.print(f"job {job_id}: {state}")
        if "COMPLETED" not in finals.values():  # only a job whose pipeline finished the run exits 0
            raise typer.Exit(1)
