"""Connect to the Ray cluster a command runs on: an existing one (`--address` / RAY_ADDRESS), or an embedded local
Ray started here and shut down at the end."""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from amalia_ray.core.console import stage_line

# Serve's controller, proxy, ingress and each vLLM replica all take a CPU slot: with 2 logical CPUs a Serve LLM app
# never schedules, so the embedded cluster advertises more logical CPUs than cores (the OS shares the cores).
MIN_LOGICAL_CPUS = 8


def embedded_num_cpus(requested: int | None, needed: int = 0) -> int:
    """What the embedded cluster advertises: the recipe's `resources.num_cpus`, else enough logical CPUs for the
    largest thing the recipe schedules at once (`needed`), at least MIN_LOGICAL_CPUS and the core count."""
    return requested or max(MIN_LOGICAL_CPUS, os.cpu_count() or 1, needed)


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, needed_cpus: int = 0,
                logs_link: Path | None = None, dashboard: bool = True):
    """Yields a description of the cluster. Reuses a Ray already initialized in this process (tests, jobs). An
    embedded Ray's own log folder (raylet, GCS, every worker's and vLLM replica's output) is linked at `logs_link`.
    `dashboard=False`: an embedded Ray without the dashboard and its job API (a second less to start), for a
    command that submits no jobs."""
    import ray

    if ray.is_initialized():
        yield {"mode": "attached", "resources": ray.cluster_resources(), "billable_cpus": billable_cpus()}
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        mode = f"cluster at {address}"
    else:
        embedded_auth()
        # the dashboard (and its job API) answers on loopback only: it runs whatever is submitted to it
        with embedded_metrics_servers():
            ray.init(address="local", num_cpus=embedded_num_cpus(num_cpus, needed_cpus), include_dashboard=dashboard,
                     dashboard_host="127.0.0.1", log_to_driver=True, _system_config=embedded_system_config())
        mode = "embedded local Ray"
        if logs_link:
            _link(logs_link, Path(ray._private.worker._global_node.get_logs_dir_path()))
    resources = ray.cluster_resources()
    cores, logical = os.cpu_count() or 1, resources.get("CPU", 0)
    shared = (f" on {cores} cores: the stages' workers and Serve share them, so steps run slower than with a core "
              "each") if not address and logical > cores else ""
    stage_line("ray", f"{mode}: {logical:.0f} CPU, {resources.get('GPU', 0):.0f} GPU{shared}")
    try:
        yield {"mode": mode, "resources": resources, "billable_cpus": billable_cpus()}
    finally:
        ray.shutdown()


def embedded_system_config() -> dict:
    """Ray settings of an embedded cluster. Its Prometheus exporter is off: it would answer anyone on the network
    (it takes no token) with the names of the run's tasks, actors and deployments, and a laptop or a single node has
    no Prometheus scraping it. RAY_enable_metrics_collection=1 in the environment turns it back on."""
    if os.environ.get("RAY_enable_metrics_collection", "").lower() in ("1", "true"):
        return {}
    return {"enable_metrics_collection": False}


@contextmanager
def embedded_metrics_servers():
    """While an embedded Ray starts: its dashboard and autoscaler monitor processes open no Prometheus server of
    their own. Ray 2.60 binds those to every interface of a machine with a routable address, taking no token, and
    no setting turns them off; a port of -1 (their environment variables, which the processes inherit) makes the
    server fail to start, which Ray logs once and carries on from. Nothing else reads those two ports.
    RAY_enable_metrics_collection=1 leaves them as Ray starts them."""
    if os.environ.get("RAY_enable_metrics_collection", "").lower() in ("1", "true"):
        yield
        return
    saved = {k: os.environ.get(k) for k in METRICS_PORT_VARIABLES}
    os.environ.update({k: os.environ.get(k) or "-1" for k in METRICS_PORT_VARIABLES})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# the dashboard head's and the autoscaler monitor's own Prometheus ports (Ray's dashboard/consts.py and
# autoscaler/_private/constants.py read them when those processes start)
METRICS_PORT_VARIABLES = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")


def embedded_auth() -> None:
    """Token auth on for an embedded Ray. Ray 2.60's servers (GCS, raylet, workers, object manager) listen on every
    interface whatever node address they are given (it turns a loopback one into the machine's routable address),
    so without a token anyone on the same network who finds a port can join the cluster and run code as this user.
    Unless RAY_AUTH_MODE says otherwise, the cluster gets a random token of its own, held in this process's
    environment (its Ray processes, workers and replicas inherit it) and in no file; Ray's own ~/.ray/auth_token is
    used where it exists. RAY_AUTH_MODE=disabled is obeyed, with a warning."""
    from amalia_ray.core.secrets import remember

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode == "disabled":
        stage_line("ray", "[yellow]token auth off[/] (RAY_AUTH_MODE=disabled): anyone on this machine's network "
                   "who finds its Ray ports can run code here")
        return
    if mode is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        if not os.environ.get("RAY_AUTH_TOKEN") and not (Path.home() / ".ray" / "auth_token").exists():
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        import ray._raylet

        ray._raylet.Config.initialize("")  # a Ray already imported here reads the mode again
    remember(os.environ.get("RAY_AUTH_TOKEN"))  # masked wherever it might be printed


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)


def billable_cpus() -> float:
    """CPUs the cluster really has: its logical CPUs, capped at this machine's cores when every node runs here (the
    embedded cluster, or several raylets on one machine, advertise more logical CPUs than there are cores)."""
    import ray

    logical = ray.cluster_resources().get("CPU", 0.0)
    here = ray.util.get_node_ip_address()
    if all(n["NodeManagerAddress"] == here for n in ray.nodes() if n["Alive"]):
        return min(logical, float(os.cpu_count() or 1))
    return logical


# where Ray's cluster launcher leaves its config on the head node (where a job's driver runs); Ray Tune reads it too
LAUNCHER_CONFIG = Path("~/ray_bootstrap_config.yaml")


def cluster_has_gpu() -> bool:
    """Whether the cluster has GPUs or can add nodes that have them (`cluster_gpus`)."""
    return cluster_gpus() > 0


def cluster_gpus() -> int:
    """The GPUs the cluster has, or may have: an autoscaled cluster whose GPU workers start on demand shows none until
    a task asks for one, so the node types its autoscaler may start count as much as the nodes up now — as
    reported to Ray by autoscalers that report their node types, or as the cluster launcher's config on the head
    node declares them (`resources: {GPU: n}` of a type with `max_workers` > 0)."""
    import ray

    return max(int(ray.cluster_resources().get("GPU", 0)), autoscaled_gpus())


def autoscaled_gpus() -> int:
    """The GPUs the cluster's autoscaler may add, as far as this process can tell (0 where it cannot)."""
    reported = 0
    try:  # Ray Data reads the autoscaler's node types this way (private API: absent or changed, it counts as none)
        from ray._private.state import state

        reported = int((state.get_max_resources_from_cluster_config() or {}).get("GPU", 0))
    except Exception:  # noqa: BLE001 - an optional hint; the config file below is the other one
        pass
    return max(reported, launcher_gpus(LAUNCHER_CONFIG.expanduser()))


def launcher_gpus(config: Path) -> int:
    """GPUs the node types of a Ray cluster-launcher config may bring up as workers: GPUs per node × max_workers,
    summed (a type's max_workers defaults, as the launcher's do, to the cluster's, and to 0 for the head's type)."""
    import yaml

    try:
        launcher = yaml.safe_load(config.read_text()) if config.is_file() else None
    except (OSError, yaml.YAMLError):
        return 0
    types = launcher.get("available_node_types") if isinstance(launcher, dict) else None
    total = 0
    for name, node_type in (types or {}).items():
        if not isinstance(node_type, dict):
            continue
        gpus = (node_type.get("resources") or {}).get("GPU", 0)
        default = 0 if name == launcher.get("head_node_type") else launcher.get("max_workers", 0)
        workers = node_type.get("max_workers", default)
        if isinstance(gpus, (int, float)) and isinstance(workers, int):
            total += int(gpus) * max(workers, 0)
    return total


def resolve_use_gpu(device: str) -> bool:
    """`resources.device` / `--device` as a decision: cuda and cpu as said; auto, GPUs when the cluster has or can
    start them (`cluster_has_gpu`)."""
    return device == "cuda" or (device == "auto" and cluster_has_gpu())
