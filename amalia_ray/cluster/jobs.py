"""Ray job submission: run a recipe on a cluster as a Ray job (`python -m jobs.pipeline RECIPE`), with this project
as the job's working directory, and follow, inspect or stop it — `ray.job_submission.JobSubmissionClient` under
the hood, so the same jobs show up in the Ray dashboard and `ray job` commands."""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from pathlib import Path

from amalia_ray.core.errors import AmaliaError

# never uploaded with the working directory: environments, run outputs, caches
# not uploaded with a job: environments, runs, caches, weights — and the repository's history and local secrets
EXCLUDES = [".venv", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", "*.safetensors", "*.distcp", ".git",
            ".env", ".env.*", "*.pem", ".netrc"]


def job_address(address: str | None) -> str:
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise AmaliaError("no cluster to talk to: pass --address http://HEAD:8265 (the Ray dashboard / job server) "
                          "or set RAY_ADDRESS")
    return address if "://" in address else f"http://{address}"


def _client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    url = job_address(address)
    try:
        return JobSubmissionClient(url)
    except Exception as e:  # noqa: BLE001 - connection errors come in many types
        raise AmaliaError(f"cannot reach the Ray job server at {url}: {e}") from None


def entrypoint(recipe: Path, working_dir: Path, until: str | None, python: str) -> str:
    """The job's command. A recipe inside the working directory is named relative to it (the job runs in the
    uploaded copy); one outside must be on storage the cluster sees at the same path."""
    recipe = recipe.resolve()
    try:
        where = str(recipe.relative_to(working_dir.resolve()))
    except ValueError:
        where = str(recipe)
    args = [python, "-m", "jobs.pipeline", where] + (["--until", until] if until else [])
    return shlex.join(args)


def submit(recipe: Path, *, address: str | None, until: str | None = None, env: dict[str, str] | None = None,
           pip: list[str] | None = None, uv: list[str] | None = None, working_dir: Path = Path("."),
           python: str = "python", upload: bool = True, agent_wait_s: float = 120) -> str:
    if not recipe.is_file():
        raise AmaliaError(f"recipe file not found: {recipe}")
    if pip and uv:
        raise AmaliaError("give --pip or --uv, not both")
    runtime_env: dict = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}}
    if upload:  # else the cluster's image or environment has the project installed (e.g. deploy/Dockerfile)
        runtime_env |= {"working_dir": str(working_dir), "excludes": EXCLUDES}
    if pip:
        runtime_env["pip"] = pip
    if uv:
        runtime_env["uv"] = uv
    client = _client(address)
    deadline = time.monotonic() + agent_wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint(recipe, working_dir, until, python),
                                     runtime_env=runtime_env, metadata={"recipe": recipe.name, "by": "amalia"})
        except RuntimeError as e:
            # a cluster that has just started has no job agent yet: the job server asks to try again later
            if "try again later" not in str(e) or time.monotonic() > deadline:
                raise AmaliaError(f"job submission to {job_address(address)} failed: {e}") from None
            time.sleep(2)


def status(job_id: str, address: str | None) -> dict:
    info = _client(address).get_job_info(job_id)
    return {"job_id": job_id, "status": info.status.value, "entrypoint": info.entrypoint, "message": info.message,
            "start_time": info.start_time, "end_time": info.end_time}


def logs(job_id: str, address: str | None) -> str:
    return _client(address).get_job_logs(job_id)


def follow(job_id: str, address: str | None, write) -> str:
    """Stream the job's log to `write` until it ends; returns its final status."""
    client = _client(address)

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            write(lines)

    asyncio.run(tail())
    return client.get_job_status(job_id).value


def stop(job_id: str, address: str | None) -> bool:
    return _client(address).stop_job(job_id)
