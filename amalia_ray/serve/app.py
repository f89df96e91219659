"""Serve checkpoints with `ray.serve.llm` + vLLM behind the OpenAI API, one Serve application for one or several
checkpoints side by side (each a model id in /v1/models)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from amalia_ray.core.config import ServeConfig
from amalia_ray.core.errors import AmaliaError

APP_NAME = "amalia"


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


def llm_config(model_id: str, checkpoint: Path, cfg: ServeConfig, use_gpu: bool) -> dict:
    if not (checkpoint / "config.json").is_file():
        raise AmaliaError(f"not a HF checkpoint (no config.json): {checkpoint}")
    engine = cfg.engine
    bundle = {"CPU": cfg.cpus_per_replica, **({"GPU": max(1, cfg.gpus_per_replica)} if use_gpu else {})}
    return {
        "model_loading_config": {"model_id": model_id, "model_source": str(checkpoint.resolve())},
        "deployment_config": {
            "autoscaling_config": {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas}
        },
        "placement_group_config": {"bundles": [bundle]},
        "engine_kwargs": {
            "dtype": engine.dtype,
            "max_model_len": engine.max_model_len,
            "enforce_eager": engine.enforce_eager,
            "gpu_memory_utilization": engine.gpu_memory_utilization,
        },
    }


def start(models: dict[str, Path], cfg: ServeConfig, use_gpu: bool) -> str:
    """Deploy and block until every model answers /v1/models; returns the base URL (…/v1)."""
    require_vllm()
    from ray import serve
    from ray.serve.llm import build_openai_app

    check_port_free(cfg.host, cfg.port)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    app = build_openai_app({"llm_configs": [llm_config(mid, path, cfg, use_gpu) for mid, path in models.items()]})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    base_url = f"http://{cfg.host}:{cfg.port}/v1"
    wait_until_serving(base_url, set(models), cfg.startup_timeout_s)
    return base_url


def wait_until_serving(base_url: str, model_ids: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/models", timeout=10)
            if r.status_code == 200 and model_ids <= {m["id"] for m in r.json().get("data", [])}:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(2)
    raise AmaliaError(f"serving did not come up within {timeout_s:.0f}s at {base_url} ({last})")


def stop() -> None:
    from ray import serve

    serve.shutdown()
