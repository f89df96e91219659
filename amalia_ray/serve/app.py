"""Serve checkpoints with `ray.serve.llm` + vLLM behind the OpenAI API, one Serve application for one or several
checkpoints side by side (each a model id in /v1/models), and LoRA adapters on the engine of the checkpoint they
were trained on (each its own model id "MODEL:ADAPTER", N adapters for the cost of one engine).

Each run, sweep and `amalia serve` owns a Serve application of its own name: stopping deletes only that one, so on a
shared cluster no one tears down another's models. Where Serve already runs, its HTTP proxy is joined (its host and
port are the cluster's, not the recipe's), and an application takes the route prefix "/" unless another holds it."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from amalia_ray.core.config import ServeConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.secrets import mask
from amalia_ray.serve.ingress import build_app, key_digest
from amalia_ray.serve.readiness import error_line, probe_over_http

APP_PREFIX = "amalia-"
BUILDER = "amalia_ray.serve.ingress:build_app"
_started_serve: set[str] = set()  # applications whose start also started Serve (their stop may shut it down)


def app_name(label: str) -> str:
    """The Serve application of a run (its name), a sweep or an `amalia serve`."""
    return APP_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "-", label)


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise AmaliaError(
            f"vLLM is not installed ({e}): install the serving extra, `pip install 'amalia-ray[cpu]'` on CPU "
            "machines or `pip install 'amalia-ray[gpu]'` on GPU machines"
        ) from None


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            raise AmaliaError(
                f"port {port} on {host} is already in use: stop the process listening there "
                "or set serve.port in the recipe"
            ) from None


def llm_config(model_id: str, checkpoint: Path, cfg: ServeConfig, use_gpu: bool,
               adapters: dict[str, Path] | None = None) -> dict:
    """One model's ray.serve.llm LLMConfig (as a dict), plus `adapters`: the LoRA adapter folders its engine serves
    beside it (each as the model id "MODEL:NAME"), which build_app hands to the replica's adapter loader."""
    if not (checkpoint / "config.json").is_file():
        raise AmaliaError(f"not a HF checkpoint (no config.json): {checkpoint}")
    if ":" in model_id:
        raise AmaliaError(f"model id '{model_id}': ':' is kept for adapters (MODEL:ADAPTER); name it without one")
    if any(a.endswith("ForSequenceClassification") for a in _architectures(checkpoint)):
        raise AmaliaError(f"{checkpoint} is a reward model (a sequence classifier): it scores text and does not "
                          "generate, so it has no OpenAI chat endpoint; a sampled train stage serves it as a reward "
                          "(rewards: [{model: ...}])")
    config = {
        "model_loading_config": {"model_id": model_id, "model_source": str(checkpoint.resolve())},
        "deployment_config": {
            "autoscaling_config": {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                                   "target_ongoing_requests": cfg.target_ongoing_requests}
        },
        **replica_placement(cfg, use_gpu),
    }
    if adapters:
        shapes = [adapter_shape(name, path) for name, path in adapters.items()]
        rank = max(r for r, _ in shapes)
        # vLLM's LoRA engine: one slot per adapter, so a batch may mix all of them; LoRA layers only where an
        # adapter has weights (vLLM would wrap every supported layer, the LM head included, whose LoRA path fails
        # on prompt log-likelihoods of several requests at once)
        config["engine_kwargs"] |= {"enable_lora": True, "max_loras": len(adapters),
                                    "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank),
                                    "lora_target_modules": sorted(set().union(*(m for _, m in shapes)))}
        config["lora_config"] = {"max_num_adapters_per_replica": len(adapters)}
        config["adapters"] = {name: str(path.resolve()) for name, path in adapters.items()}
    return config


def _architectures(checkpoint: Path) -> list[str]:
    try:
        return list(json.loads((checkpoint / "config.json").read_text()).get("architectures") or [])
    except (ValueError, OSError, AttributeError):  # an unreadable config is vLLM's to report, with its reason
        return []


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM's LoRA engine takes
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def adapter_shape(name: str, folder: Path) -> tuple[int, set[str]]:
    """An adapter folder's LoRA rank and the names of the layers it adapts (`q_proj`, …), after checking vLLM's LoRA
    engine can serve it: PEFT's adapter_config.json and safetensors weights, plain LoRA on the decoder's layers (no
    DoRA, no LM head or embeddings, no fully trained modules beside the adapters)."""
    if not ADAPTER_NAME.match(name):
        raise AmaliaError(f"adapter name '{name}': letters, digits, '.', '_' and '-' only")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AmaliaError(f"adapter '{name}': not a PEFT adapter folder (no adapter_config.json): {folder}")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise AmaliaError(f"adapter '{name}': no adapter_model.safetensors in {folder}")
    try:
        adapter = json.loads(config_file.read_text(encoding="utf-8"))
        rank = int(adapter["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise AmaliaError(f"adapter '{name}': {config_file} is not a LoRA adapter config ({e})") from None
    if adapter.get("peft_type", "LORA") != "LORA" or adapter.get("use_dora"):
        raise AmaliaError(f"adapter '{name}': only plain LoRA adapters are served (this one is "
                          f"{'DoRA' if adapter.get('use_dora') else adapter.get('peft_type')}); serve its merged "
                          "checkpoint instead")
    if adapter.get("modules_to_save"):
        raise AmaliaError(f"adapter '{name}': it trains {adapter['modules_to_save']} in full (modules_to_save), "
                          "which vLLM's LoRA engine cannot serve; serve its merged checkpoint instead")
    if rank > VLLM_LORA_RANKS[-1]:
        raise AmaliaError(f"adapter '{name}': rank {rank} is over vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
    layers = adapted_layers(weights)
    if not layers:
        raise AmaliaError(f"adapter '{name}': {weights} holds no LoRA weights (lora_A / lora_B)")
    if outside := sorted(layers & {"lm_head", "embed_tokens"}):
        raise AmaliaError(f"adapter '{name}': it adapts {outside}, which vLLM's LoRA engine does not serve for "
                          "log-likelihoods; serve its merged checkpoint instead")
    return rank, layers


def adapted_layers(weights: Path) -> set[str]:
    """The names of the layers a PEFT safetensors file holds LoRA weights for (`…q_proj.lora_A.weight` -> q_proj),
    read from its header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="numpy") as f:
            keys = list(f.keys())
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same problem for the user
        raise AmaliaError(f"{weights}: not a readable safetensors file ({e})") from None
    return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys if ".lora_A" in k or ".lora_B" in k}


def adapter_id(model_id: str, adapter: str) -> str:
    """The model id an adapter is served under: its base model's id, a colon, its name (Ray Serve LLM's routing)."""
    return f"{model_id}:{adapter}"


def replica_placement(cfg: ServeConfig, use_gpu: bool) -> dict:
    """The replica's placement group and engine settings. On GPUs, one bundle per GPU (vLLM starts a worker in
    each; the replica itself sits in the first) and the model split over them: tensor parallel inside a node
    (STRICT_PACK), pipeline stages allowed across nodes (PACK)."""
    engine = cfg.engine
    kwargs = {"dtype": engine.resolved_dtype(use_gpu), "max_model_len": engine.max_model_len,
              "enforce_eager": engine.eager(use_gpu), "gpu_memory_utilization": engine.memory_share(use_gpu)}
    if not use_gpu:
        return {"placement_group_config": {"bundles": [{"CPU": cfg.cpus_per_replica}]}, "engine_kwargs": kwargs}
    gpus, stages = cfg.replica_gpus, cfg.pipeline_parallel_size
    bundles = [{"CPU": cfg.cpus_per_replica, "GPU": 1}] + [{"CPU": 1, "GPU": 1}] * (gpus - 1)
    return {"placement_group_config": {"bundles": bundles, "strategy": "STRICT_PACK" if stages == 1 else "PACK"},
            "engine_kwargs": {**kwargs, "tensor_parallel_size": gpus // stages, "pipeline_parallel_size": stages}}


def api_key(cfg: ServeConfig) -> str | None:
    return os.environ.get(cfg.api_key_env) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, other machines may reach it
        return False


def check_auth(cfg: ServeConfig, host: str | None = None) -> None:
    """An endpoint other machines can reach needs an API key, unless allow_no_auth says an open one is meant."""
    host = host or cfg.host
    if not is_loopback(host) and not api_key(cfg) and not cfg.allow_no_auth:
        raise AmaliaError(f"serving on {host}, which other machines can reach, with no API key ({cfg.api_key_env} is "
                          "not set): set it, bind to 127.0.0.1, or allow an open endpoint explicitly with "
                          "--allow-no-auth (in a recipe: serve.allow_no_auth: true)")


def app_args(models: dict[str, Path], cfg: ServeConfig, use_gpu: bool,
             adapters: dict[str, dict[str, Path]] | None = None) -> dict:
    """The application builder's args (see ingress.build_app): what `start` runs and the Serve config carries.
    `adapters`: per served model, the LoRA adapters its engine serves too."""
    adapters = adapters or {}
    if unknown := sorted(set(adapters) - set(models)):
        raise AmaliaError(f"adapters for {unknown}, which is not served here (served: {sorted(models)})")
    key = api_key(cfg)
    return {"llm_configs": [llm_config(mid, path, cfg, use_gpu, adapters.get(mid)) for mid, path in models.items()],
            "api_key_sha256": key_digest(key) if key else None, "max_request_bytes": cfg.max_request_bytes}


def logging_config(cfg: ServeConfig) -> dict:
    return {"enable_access_log": cfg.access_log}


def serve_config(models: dict[str, Path], cfg: ServeConfig, use_gpu: bool, name: str,
                 adapters: dict[str, dict[str, Path]] | None = None) -> dict:
    """A Serve config file for `serve deploy` / `serve run` (Ray's ServeDeploySchema): the same application."""
    return {
        "proxy_location": cfg.proxy_location,
        "http_options": {"host": cfg.host, "port": cfg.port},
        "applications": [{"name": name, "route_prefix": "/", "import_path": BUILDER,
                          "args": app_args(models, cfg, use_gpu, adapters), "logging_config": logging_config(cfg)}],
    }


def running_serve() -> dict | None:
    """What the Serve instance on the connected cluster says of itself (`http_options`, `applications`), or None
    when Serve does not run there (or this process is not connected to Ray)."""
    import ray

    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.get_serve_details() if client else None


def check_can_serve(cfg: ServeConfig) -> None:
    """Before any work: the recipe's port must be free here when Serve is to be started by us (a Serve already
    running on the cluster is joined instead, on its own port), and an address off loopback needs an API key."""
    running = running_serve()
    check_auth(cfg, ((running or {}).get("http_options") or {}).get("host"))
    if running is None:
        check_port_free(cfg.host, cfg.port)


@dataclass(frozen=True)
class Served:
    """A started application: the base URL that answers (…/v1), and the model ids that do not, each with its reason
    (empty when every model answered)."""
    base_url: str
    failed: dict[str, str] = field(default_factory=dict)


class ServeFailed(AmaliaError):
    def __init__(self, failed: dict[str, str]):
        self.failed = failed
        super().__init__("; ".join(f"model '{m}' cannot be served: {why}" for m, why in failed.items()))


def start(models: dict[str, Path], cfg: ServeConfig, use_gpu: bool, name: str,
          adapters: dict[str, dict[str, Path]] | None = None, keep_going: bool = False) -> Served:
    """Deploy the application `name` and block until every model has answered a request (see readiness.py). A
    model that cannot answer fails the start (ServeFailed, naming each with its reason) unless `keep_going`, when
    the others are served and the failures are returned. A start that does not come up deletes what it deployed.
    `adapters`: per model, the LoRA adapters served on its engine (model ids "MODEL:NAME")."""
    require_vllm()
    args = app_args(models, cfg, use_gpu, adapters)  # bad adapters fail here, before Serve starts
    from ray import serve

    running = running_serve()
    if running is not None and running.get("proxy_location") == "Disabled":
        if running.get("applications"):
            raise AmaliaError("Serve runs on this cluster without an HTTP proxy (as it starts for the reward models "
                              f"of a training stage), with applications {sorted(running['applications'])}: stop "
                              "them (amalia serve --stop --app NAME) or wait for that stage to finish")
        serve.shutdown()  # left without applications: started again below with the proxy
        running = None
    if running is None:
        check_auth(cfg)
        check_port_free(cfg.host, cfg.port)
        serve.start(proxy_location=cfg.proxy_location, http_options={"host": cfg.host, "port": cfg.port})
        _started_serve.add(name)
        host, port, taken = cfg.host, cfg.port, set()
    else:
        http = running.get("http_options") or {}
        host, port = http.get("host") or cfg.host, http.get("port") or cfg.port
        taken = {a.get("route_prefix") for n, a in (running.get("applications") or {}).items() if n != name}
        check_auth(cfg, host)
    prefix = f"/{name}" if "/" in taken else "/"
    base_url = f"http://{_reachable(host)}:{port}{prefix.rstrip('/')}/v1"
    try:
        # deployed without waiting here (serve.run would wait, with no time limit, until the engines are up):
        # the wait below is bounded by serve.startup_timeout_s
        serve.run_many([serve.RunTarget(target=build_app(args), name=name,
                                        route_prefix=prefix, logging_config=logging_config(cfg))],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        served = [*models, *(adapter_id(m, a) for m, named in (adapters or {}).items() for a in named)]
        deadline = time.monotonic() + cfg.startup_timeout_s
        failed = wait_until_serving(base_url, set(served), cfg.startup_timeout_s, name, api_key(cfg))
        failed |= {m: mask(why) for m, why in probe_over_http(
            base_url, [m for m in served if m not in failed], api_key(cfg), deadline - time.monotonic()).items()}
        if failed and not keep_going:
            raise ServeFailed(failed)
    except BaseException:
        with suppress(Exception):  # the cause, not a failed clean-up, is what the caller hears of
            stop(name)
        raise
    return Served(base_url, failed)


def note_started_serve(name: str) -> None:
    """The application `name` started Serve: its `stop` shuts Serve down when no other application runs."""
    _started_serve.add(name)


def _reachable(host: str) -> str:
    """The proxy's address as a client on this node dials it (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def wait_until_serving(base_url: str, model_ids: set[str], timeout_s: float, name: str | None = None,
                       key: str | None = None) -> dict[str, str]:
    """Until every model's engine has answered its first request or failed (the app's /health asks each one;
    /v1/models alone lists the models as soon as the ingress is up, before any engine has loaded), within
    `timeout_s` in all. Returns {model id: reason} for the engines that failed: their first request (the reason
    from /readiness, behind the API key `key`), or their start, where Serve gave up on the application `name`'s
    deployment of that model."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    root = base_url.removesuffix("/v1")
    while (left := deadline - time.monotonic()) > 0:
        try:
            r = httpx.get(f"{root}/health", timeout=min(10.0, left))
            models = r.json().get("models", {}) if r.headers.get("content-type", "").startswith("application/json") \
                else {}
            given_up = _failed_deployments(name, model_ids) if name else {}
            failed = {m for m, state in models.items() if m in model_ids and state.startswith("failed")} - set(given_up)
            done = {m for m, s in models.items() if s == "ok"} | failed | set(given_up)
            if r.status_code in (200, 503) and model_ids <= done:  # every model answered or failed: the others wait
                return (_reasons(root, failed, key) if failed else {}) | given_up
            last = f"HTTP {r.status_code}" + (f": {models}" if models else "")
        except (httpx.HTTPError, ValueError) as e:
            last = type(e).__name__
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    raise AmaliaError(f"serving did not come up within {timeout_s:.0f}s at {base_url} ({last})")


def _reasons(root: str, failed: set[str], key: str | None) -> dict[str, str]:
    r = httpx.get(f"{root}/readiness", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    states = r.json().get("models", {}) if r.status_code in (200, 503) else {}
    return {m: mask(states.get(m, "failed").removeprefix("failed").removeprefix(": ") or "failed") for m in failed}


def _failed_deployments(name: str, model_ids: set[str]) -> dict[str, str]:
    """{model id: reason} for the models whose deployment Serve gave up starting (DEPLOY_FAILED: its replicas kept
    failing to start; adapters share their base's)."""
    from ray import serve

    app = serve.status().applications.get(name)
    failed = {}
    for deployment, status in (app.deployments if app else {}).items():
        model = deployment.split(":", 1)[-1]
        if status.status == "DEPLOY_FAILED":
            failed |= {m: mask(error_line(status.message or "") or "its replicas failed to start")
                       for m in model_ids if m == model or m.startswith(f"{model}:")}
    return failed


def stop(name: str) -> None:
    """Delete the application `name` and only it; Serve itself is shut down only when this process started it for
    this application and no other application runs on it now."""
    from ray import serve

    serve.delete(name)
    if name in _started_serve:
        _started_serve.discard(name)
        if not (running_serve() or {}).get("applications"):
            serve.shutdown()


# A foreground `amalia serve` on the embedded Ray records itself here, so `amalia serve --stop` can find it.
def _state_file(host: str, port: int) -> Path:
    root = Path(os.environ.get("AMALIA_STATE_DIR", Path.home() / ".amalia")) / "serve"
    return root / f"{host}-{port}.json"


@contextmanager
def local_state(host: str, port: int, base_url: str, models: list[str]) -> Iterator[Path]:
    path = _state_file(host, port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "started": _start_time(os.getpid()), "base_url": base_url,
                                "models": models}))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def stop_local(host: str, port: int, timeout_s: float = 120) -> str:
    """SIGTERM the `amalia serve` serving host:port on this machine and wait until it has shut down."""
    path = _state_file(host, port)
    if not path.exists():
        raise AmaliaError(f"no `amalia serve` on {host}:{port} on this machine (nothing at {path}); "
                          "for a cluster deployment pass --address")
    state = json.loads(path.read_text())
    started = _start_time(state["pid"])
    if started is None:
        path.unlink(missing_ok=True)
        return f"nothing: process {state['pid']} had already exited"
    if started != state.get("started"):  # the server died without cleaning up and its PID went to another process
        path.unlink(missing_ok=True)
        return (f"nothing: process {state['pid']} is not the server that recorded itself in {path} (it started "
                "later; the server had exited), so it was left alone")
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # the server removes its state file once serving has stopped (Ray itself shuts down after that)
        if not path.exists() or not _alive(state["pid"]):
            path.unlink(missing_ok=True)
            return f"{', '.join(state['models'])} at {state['base_url']} (process {state['pid']})"
        time.sleep(0.5)
    raise AmaliaError(f"process {state['pid']} serving {state['base_url']} did not stop within {timeout_s:.0f}s")


def _start_time(pid: int) -> float | None:
    """When the process started (with its PID, what tells it from a later process given the same PID)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
