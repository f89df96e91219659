"""Ray on a Slurm allocation, the way Ray documents it: one batch job whose first node runs Ray's head and whose other
nodes run Ray workers (each started with `srun ... ray start --block`), then the recipe's pipeline as the driver on
the head node, then Ray stopped. Written as a batch script kept in the run folder (`runs/<name>/slurm/job.sbatch`),
submitted with `sbatch`.

Time limits: the script asks Slurm for a signal before the limit (`--signal=B:USR1@<seconds>`) and turns it into the
run's stop file, on which the pipeline checkpoints the training stage at the step it is on and stops (core/stop.py);
the next job of a chain (`--chain K`: K jobs, each depending on the one before) runs the same script, and the
pipeline resumes from that checkpoint, skipping the stages already done. A job that finishes the run (or fails for
another reason) cancels the rest of its chain."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.formats.step_metrics import read_step_records
from amalia_ray.core.secrets import secret_file
from amalia_ray.core.stop import EXIT_STOPPED, STOP_FILE

SCRIPT = "job.sbatch"
# the ports `ray start` would take at fixed numbers on every node, left to the OS instead (0: any free port)
FREE_PORTS = "--dashboard-agent-listen-port=0 --min-worker-port=0 --max-worker-port=0"
# interfaces only this node reaches through: Docker's, libvirt's, container networks'
VIRTUAL = ("docker", "br-", "veth", "virbr", "cni", "flannel", "cali", "podman", "lxc")
CHAIN = "chain.txt"
TIME_PATTERN = re.compile(r"^(?:\d+-)?\d+(?::\d{1,2}){0,2}$")  # the formats sbatch --time takes
# filesystems every node of a cluster mounts alike; a run folder elsewhere is seen by one node only
SHARED_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "cifs", "smb3", "wekafs",
                      "fuse.sshfs", "fuse.juicefs", "fuse.ceph", "fuse.glusterfs", "glusterfs", "panfs", "pvfs2",
                      "orangefs", "ocfs2", "gfs2", "virtiofs", "9p"}


CONTROL = re.compile(r"[\x00-\x1f\x7f]")
SBATCH_UNSAFE = re.compile(r"[\s#%'\"\\]")  # what an #SBATCH line's path cannot hold


@dataclass
class SlurmJob:
    recipe: Path
    run_dir: Path
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int | None = None  # None: whole nodes (--exclusive), Ray gets every CPU of each
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    until: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    setup: Path | None = None  # a shell script sourced first (site settings, proxies, caches)
    venv: Path | None = None
    scratch: str = "${TMPDIR:-/tmp}"  # node-local: Ray's sockets, logs and spilled objects
    ray_port: int | None = None  # None: a free port of the head node, picked when the job starts
    dashboard_port: int | None = None
    stop_before_s: int = 120
    join_timeout_s: int = 600
    token_path: Path | None = None  # Ray's auth token (a file only its owner reads); None: --allow-no-auth
    workdir: Path = field(default_factory=Path.cwd)  # where the job runs, as `amalia run` would have

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 0 or (self.cpus_per_node is not None and self.cpus_per_node < 1):
            raise AmaliaError("--nodes must be at least 1, --gpus-per-node at least 0, --cpus-per-node at least 1")
        if self.time and not TIME_PATTERN.match(self.time):
            raise AmaliaError(f"--time {self.time!r}: use a format sbatch takes, e.g. 02:00:00, 90, 1-12:00:00")
        if self.time and self.stop_before_s >= seconds_of(self.time):
            raise AmaliaError(f"--stop-before {self.stop_before_s}s leaves no time to run within --time {self.time}")
        for name in ("partition", "account", "qos"):
            if (value := getattr(self, name)) is not None and not re.fullmatch(r"[\w.,-]+", value):
                raise AmaliaError(f"--{name} {value!r}: letters, digits, '_', '.', ',' and '-' only")
        # a newline in a value written to the script (an #SBATCH line, a path) would start a line of its own
        values = {"recipe": self.recipe, "run folder (run.output_dir / run.name)": self.run_dir, "--until": self.until,
                  "--setup": self.setup, "--venv": self.venv, "--scratch": self.scratch, "--chdir": self.workdir,
                  **{f"--sbatch-arg {a!r}": a for a in self.sbatch_args}, **{f"--module {m!r}": m for m in self.modules}}
        for name, value in values.items():
            if value is not None and CONTROL.search(str(value)):
                raise AmaliaError(f"{name}: a control character (newline, tab, …) in {str(value)!r}: it would be "
                                  "written into the batch script")
        # sbatch reads an #SBATCH line's arguments split at spaces, up to a '#', with its own quoting, and expands
        # '%' patterns in --output: the folders written on such lines must hold none of those
        for name, value in (("the working directory (--chdir)", self.workdir),
                            ("run folder (run.output_dir / run.name)", self.run_dir)):
            if bad := sorted(set(SBATCH_UNSAFE.findall(str(value)))):
                raise AmaliaError(f"{name} {str(value)!r} holds {' '.join(map(repr, bad))}: sbatch would split or "
                                  "cut its #SBATCH line there; run from, or write the run to, a path without them")

    @property
    def folder(self) -> Path:
        return self.run_dir / "slurm"


def stop_margin(plans: list, run_dir: Path, floor: int = 120) -> tuple[int, str]:
    """How long before the time limit a run must be told to stop, and why: the stop is seen at the end of a step,
    then a checkpoint is saved, so 1.5 × (a step + a save) of the slowest training stage plus a minute, at least
    `floor` s. A step is the longest one: planned, one that waits for a whole rollout (GRPO samples before one
    step in `num_iterations`); measured, the slowest after the first (which compiles and warms up). The run's own
    measured steps and saves (slowest) replace the plan's (`plan.StagePlan`) where it has any, except that a stage
    that samples keeps its planned step where that is longer (the steps measured so far may hold no rollout)."""
    worst, why = 0.0, ""
    for p in plans:
        planned = max(p.step_time_s, p.longest_step_s)
        step, save, basis = planned, p.checkpoint_s, "planned"
        metrics = run_dir / p.stage / "metrics.jsonl"
        if metrics.exists():
            rows = read_step_records(metrics)
            if steps := [r["step_time_s"] for r in rows if "step_time_s" in r]:
                measured = max(steps[1:] or steps)
                step, basis = (planned, "planned") if p.rollout_s and planned > measured else (measured, "measured")
            if saves := [r["last_checkpoint_s"] for r in rows if "last_checkpoint_s" in r]:
                save = max(saves)
        if (need := 1.5 * (step + save) + 60) > worst:
            worst, why = need, f"{p.stage}: a step {step:.0f} s + a checkpoint {save:.0f} s, {basis}"
    seconds = max(floor, math.ceil(worst))
    return seconds, why if seconds > floor else f"at least {floor} s" + (f"; {why}" if why else "")


def seconds_of(limit: str) -> int:
    """sbatch's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def filesystem_of(path: Path) -> tuple[str, str]:
    """(filesystem type, mount point) of the mount holding `path`, from /proc/self/mountinfo."""
    path = Path(os.path.realpath(path))
    best = ("", "/")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        mount = left.split()[4].encode().decode("unicode_escape")
        fstype = right.split()[0] if right else ""
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best[1]):
            best = (fstype, mount)
    return best


def check_shared(job: SlurmJob) -> None:
    """A job on several nodes needs the run folder and the recipe where every node sees them."""
    if job.nodes == 1:
        return
    for what, path in (("the run folder", job.run_dir), ("the recipe", job.recipe)):
        existing = next(p for p in [path, *path.parents] if p.exists())
        fstype, mount = filesystem_of(existing)
        if fstype and fstype not in SHARED_FILESYSTEMS:
            raise AmaliaError(
                f"{what} {path} is on {mount} ({fstype}), which the other {job.nodes - 1} node(s) do not see: put "
                "run.output_dir (and the recipe) on the cluster's shared filesystem (e.g. your project or home "
                "folder on GPFS or Lustre), or pass --assume-shared if this one is mounted on every node")


def default_venv() -> Path | None:
    """The virtual environment running this command, if any: the job runs with the same one."""
    return Path(sys.prefix) if sys.prefix != sys.base_prefix else None


def batch_script(job: SlurmJob) -> str:
    q = shlex.quote
    out = job.folder / "%j.out"
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q('amalia-' + job.run_dir.name)}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive" if job.cpus_per_node is None else f"#SBATCH --cpus-per-task={job.cpus_per_node}",
        # a whole node's memory too: --exclusive alone leaves the site's default memory per CPU, often a few GB
        *(["#SBATCH --mem=0"] if job.cpus_per_node is None and not any(a.startswith("--mem") for a in job.sbatch_args)
          else []),
        *([f"#SBATCH --gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"#SBATCH --time={job.time}"] if job.time else []),
        *([f"#SBATCH --partition={job.partition}"] if job.partition else []),
        *([f"#SBATCH --account={job.account}"] if job.account else []),
        *([f"#SBATCH --qos={job.qos}"] if job.qos else []),
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={out}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{job.stop_before_s}",
        *[f"#SBATCH {arg}" for arg in job.sbatch_args],
    ]
    until = f" --until {q(job.until)}" if job.until else ""
    setup = [f"module load {q(m)}" for m in job.modules]
    if job.setup:
        setup.append(f"source {q(str(job.setup))}")
    if job.venv:
        setup.append(f"source {q(str(job.venv / 'bin' / 'activate'))}")
    # without --gpus-per-node, what the site's own request (--sbatch-arg=--gres=gpu:G) gave the node, else none
    gpus = f" --num-gpus={job.gpus_per_node}" if job.gpus_per_node else ' --num-gpus="${SLURM_GPUS_ON_NODE:-0}"'
    # other users of the allocation's nodes can reach Ray's ports: every Ray process, and each client, holds the
    # token (a file only this user can read); --allow-no-auth turns that off by name
    auth = (f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={q(str(job.token_path))}" if job.token_path else
            "export RAY_AUTH_MODE=disabled  # --allow-no-auth: anyone who reaches these nodes can use this Ray")
    body = f"""
set -uo pipefail
say() {{ echo "[amalia $(date +%H:%M:%S)] $*"; }}
{chr(10).join(setup)}
{auth}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head_node=${{nodes[0]}}
# the head's address as the other nodes reach it, and free ports there (two jobs may share a node); the last line
# printed, whatever a site's Python start-up prints before it
read -r head_ip ray_port dashboard_port client_port < <(srun --nodes=1 --ntasks=1 --overlap -w "$head_node" \\
  python -c "from amalia_ray.cluster.slurm import head_endpoint; print(head_endpoint({job.ray_port}, {job.dashboard_port}))" \\
  | tail -n 1)
if [ -z "${{client_port:-}}" ]; then say "could not read the head node's address"; exit 1; fi
client_server=$( [ "$client_port" != 0 ] && echo "--ray-client-server-port=$client_port" )
export RAY_ADDRESS=$head_ip:$ray_port  # Ray's own processes too: a node may run other Ray instances
ray_address=$RAY_ADDRESS
ray_tmp={job.scratch}/ray-$SLURM_JOB_ID
cpus=${{SLURM_CPUS_ON_NODE:-$(nproc)}}
say "job $SLURM_JOB_ID on ${{#nodes[@]}} node(s): Ray head on $head_node ($ray_address, dashboard port $dashboard_port)"

# Ray's head on the first node, a worker on each of the others; --block keeps each one a job step, given the
# node's CPUs (a step without --cpus-per-task is bound to one CPU: srun does not inherit sbatch's since Slurm 22.05).
# Every other port Ray would take at a fixed number (the dashboard agent's 52365, workers' 10002-19999) is left to
# the OS, so a second job's Ray on the same node does not collide with this one's
srun --nodes=1 --ntasks=1 --overlap --cpus-per-task="$cpus" -w "$head_node" \\
  ray start --head --node-ip-address="$head_ip" --port="$ray_port" --dashboard-port="$dashboard_port" \\
  $client_server {FREE_PORTS} \\
  --num-cpus="$cpus"{gpus} --temp-dir="$ray_tmp" --block &
sleep 5
for node in "${{nodes[@]:1}}"; do
  srun --nodes=1 --ntasks=1 --overlap --cpus-per-task="$cpus" -w "$node" \\
    ray start --address="$ray_address" {FREE_PORTS} --num-cpus="$cpus"{gpus} --temp-dir="$ray_tmp" --block &
done
if ! python -c "from amalia_ray.cluster.slurm import wait_for_nodes; wait_for_nodes('$ray_address', ${{#nodes[@]}}, {job.join_timeout_s})"; then
  say "Ray did not come up on every node"; kill $(jobs -p) 2>/dev/null; wait; exit 1
fi

# the pipeline; when Slurm warns that the time limit is near, the stop file tells it to checkpoint and stop
stop_file={q(str(job.run_dir / STOP_FILE))}
trap 'say "time limit near: the pipeline checkpoints and stops"; echo "time limit of job $SLURM_JOB_ID" > "$stop_file"' USR1
python -u -m jobs.pipeline {q(str(job.recipe))}{until} &
pipeline=$!
wait "$pipeline"; rc=$?
while kill -0 "$pipeline" 2>/dev/null; do wait "$pipeline"; rc=$?; done  # a trap ends `wait` early
trap - USR1

if [ "$rc" -eq {EXIT_STOPPED} ]; then
  say "stopped at a checkpoint: the next job of the chain carries on"
else
  if [ "$rc" -eq 0 ]; then say "the run is complete"; else say "the pipeline failed (exit $rc)"; fi
  chain={q(str(job.folder / CHAIN))}
  later=$( [ -f "$chain" ] && awk -v me="$SLURM_JOB_ID" 'found {{print}} $1 == me {{found = 1}}' "$chain" )
  if [ -n "$later" ]; then say "cancelling the rest of the chain: $later"; scancel $later; fi
fi
kill $(jobs -p) 2>/dev/null   # srun passes it on: each `ray start --block` stops its node's Ray
wait
exit "$rc"
"""
    return "\n".join(head) + "\n" + body


def auth_token(folder: Path) -> Path:
    """The Ray auth token of a run's Slurm jobs: the site's where RAY_AUTH_TOKEN_PATH names one, else a random token
    in `folder/auth_token`, made once, readable by its owner only (the run folder is on a filesystem every node
    sees, so every node's Ray reads the same)."""
    if site := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return Path(site)
    return secret_file(folder / "auth_token")


def write_script(job: SlurmJob) -> Path:
    job.folder.mkdir(parents=True, exist_ok=True)
    path = job.folder / SCRIPT
    path.write_text(batch_script(job))
    path.chmod(0o755)
    return path


def _slurm(*args: str) -> str:
    if shutil.which(args[0]) is None:
        raise AmaliaError(f"`{args[0]}` not found: run this on a Slurm login node (or install Slurm's client tools)")
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise AmaliaError(f"{' '.join(args[:2])} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


def submit(job: SlurmJob, script: Path, chain: int = 1) -> list[str]:
    """sbatch the script `chain` times, each job after the one before has ended (however it ended); returns the job
    ids and records them, in order, in the chain file the script reads."""
    if chain < 1:
        raise AmaliaError("--chain must be at least 1")
    ids: list[str] = []
    for _ in range(chain):
        after = [f"--dependency=afterany:{ids[-1]}"] if ids else []
        ids.append(_slurm("sbatch", "--parsable", *after, str(script)).split(";")[0])
    (job.folder / CHAIN).write_text("".join(f"{i}\n" for i in ids))
    return ids


def job_state(job_id: str) -> tuple[str | None, int | None]:
    """Slurm's state of a job (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...) and, once it has ended,
    its exit code; (None, None) once Slurm has forgotten it."""
    queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if queued.returncode == 0 and queued.stdout.strip():
        return queued.stdout.split()[0], None
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    if shown.returncode == 0 and (state := re.search(r"JobState=(\S+)", shown.stdout)):
        code = re.search(r"\bExitCode=(\d+):", shown.stdout)
        return state.group(1), int(code.group(1)) if code else None
    return None, None


ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def follow(job: SlurmJob, job_ids: list[str], emit: Callable[[str], None], poll_s: float = 2.0) -> dict[str, str]:
    """Print each job's output as it grows, job after job, until each has ended; returns how each ended (Slurm's
    state; STOPPED for a job that checkpointed and stopped for the next one to carry on)."""
    finals: dict[str, str] = {}
    for job_id in job_ids:
        out, offset = job.folder / f"{job_id}.out", 0
        while True:
            state, code = job_state(job_id)
            if out.exists():
                with out.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                if chunk:
                    emit(chunk.decode("utf-8", errors="replace"))
            if state not in ACTIVE:
                finals[job_id] = "STOPPED" if code == EXIT_STOPPED else (state or "UNKNOWN")
                break
            time.sleep(poll_s)
    return finals


def head_endpoint(ray_port: int | None, dashboard_port: int | None) -> str:
    """Run on the head node by the batch script: "ADDRESS RAY_PORT DASHBOARD_PORT CLIENT_PORT", the address the
    other nodes reach this one at (`node_ip`) and the ports asked for, free ones of this node where none was; the
    client server's port is 0 where Ray has no client server to start (grpc is missing: `ray start` refuses a port
    for it then)."""
    import importlib.util
    import socket

    with contextlib.ExitStack() as held:  # each port held until all are picked: three different ones
        def free() -> int:
            s = held.enter_context(socket.socket())
            s.bind(("", 0))
            return s.getsockname()[1]

        ports = (ray_port or free(), dashboard_port or free(), free() if importlib.util.find_spec("grpc") else 0)
    return " ".join(map(str, (node_ip(), *ports)))


def node_ip() -> str:
    """This node's IPv4 address as other nodes reach it: the first one its hostname resolves to that is not a
    loopback address (Debian-style hosts files map the hostname to 127.0.1.1), else the first such address of its
    network interfaces but the virtual bridges of containers and VMs; the loopback one only when the node has no
    other (it can then host a one-node job only)."""
    import ipaddress
    import socket

    import psutil

    candidates = []
    try:
        candidates += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    candidates += [a.address for name, addrs in psutil.net_if_addrs().items() if not name.startswith(VIRTUAL)
                   for a in addrs if a.family == socket.AF_INET]
    for candidate in candidates:
        ip = ipaddress.ip_address(candidate)
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            return candidate
    return "127.0.0.1"


def wait_for_nodes(address: str, count: int, timeout_s: float) -> None:
    """Block until `count` Ray nodes are alive in the cluster at `address` (run by the batch script)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            break
        except Exception:  # noqa: BLE001 - the head is still starting
            if time.monotonic() > deadline:
                raise SystemExit(f"no Ray head answered at {address} within {timeout_s:.0f}s")
            time.sleep(2)
    try:
        while (alive := sum(n["Alive"] for n in ray.nodes())) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"{alive} of {count} Ray nodes joined within {timeout_s:.0f}s")
            time.sleep(2)
        print(f"[amalia] {count} Ray node(s) up: {ray.cluster_resources()}", flush=True)
    finally:
        ray.shutdown()
