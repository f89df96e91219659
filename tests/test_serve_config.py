"""The Serve application without starting Ray: the generated Serve config validates against Ray's own schema and
LLMConfig, the API key is kept only as a digest, and the request guard (API key, body size) answers as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from amalia_ray.core.config import ServeConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.serve import app as serve_app
from amalia_ray.serve.ingress import RequestGuard, key_digest


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return tmp_path / "ckpt"


def test_serve_config_is_a_valid_serve_deploy_file(checkpoint, monkeypatch):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.setenv("MY_KEY", "s3cret")
    cfg = ServeConfig(port=8111, min_replicas=1, max_replicas=3, target_ongoing_requests=4, api_key_env="MY_KEY")
    config = serve_app.serve_config({"base": checkpoint, "sft": checkpoint}, cfg, use_gpu=False, name="amalia-serve")
    text = yaml.safe_dump(config)
    assert "s3cret" not in text, "the key itself never goes in the config"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    (application,) = schema.applications
    assert application.import_path == "amalia_ray.serve.ingress:build_app" and application.route_prefix == "/"
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8111
    args = application.args
    assert args["api_key_sha256"] == key_digest("s3cret")
    llm = [LLMConfig.model_validate(c) for c in args["llm_configs"]]
    assert [c.model_id for c in llm] == ["base", "sft"]
    assert llm[0].deployment_config["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3,
                                                              "target_ongoing_requests": 4}
    # auto: fp32 on CPU (vLLM's own auto runs bf16 there, a scalar fallback without native bf16), bf16 on GPU
    assert llm[0].engine_kwargs["dtype"] == "float32"
    assert serve_app.llm_config("m", checkpoint, cfg, use_gpu=True)["engine_kwargs"]["dtype"] == "bfloat16"
    pinned = ServeConfig.model_validate({"engine": {"dtype": "bfloat16"}})
    assert serve_app.llm_config("m", checkpoint, pinned, use_gpu=False)["engine_kwargs"]["dtype"] == "bfloat16"
    # unset, a GPU engine takes vLLM's 0.9 of the GPU with CUDA graphs (a 9B model's weights alone are 0.2 of an
    # H100), a CPU engine 0.1 of RAM, eager; set, as set
    on_gpu = serve_app.llm_config("m", checkpoint, cfg, use_gpu=True)["engine_kwargs"]
    assert (on_gpu["gpu_memory_utilization"], on_gpu["enforce_eager"]) == (0.9, False)
    assert (llm[0].engine_kwargs["gpu_memory_utilization"], llm[0].engine_kwargs["enforce_eager"]) == (0.1, True)
    set_ = ServeConfig.model_validate({"engine": {"gpu_memory_utilization": 0.5, "enforce_eager": True}})
    assert serve_app.llm_config("m", checkpoint, set_, use_gpu=True)["engine_kwargs"]["gpu_memory_utilization"] == 0.5


def test_node_initialization_is_skipped_only_for_a_folder_on_one_node(checkpoint, tmp_path, monkeypatch):
    """The deployment's callback: a checkpoint folder whose replica sits on one node skips Ray Serve LLM's per-node
    download task (making torch's kernel-cache folder itself); a replica whose placement group spans nodes
    (pipeline stages across GPU nodes) or a model from a bucket keeps Ray's own node initialization."""
    import asyncio

    import ray
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from amalia_ray.serve.ingress import local_checkpoint_callback

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg = ServeConfig()
    placed = {"one": {0: "node-a"}, "two": {0: "node-a", 1: "node-b"}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: {"bundles_to_node_id": placed[pg]})

    def runs_ray_init(source, pg) -> bool:
        llm = LLMConfig.model_validate({**serve_app.llm_config("m", checkpoint, cfg, use_gpu=False),
                                        "model_loading_config": {"model_id": "m", "model_source": source}})
        callback = local_checkpoint_callback()(llm_config=llm, ctx_kwargs={"placement_group": pg})
        asyncio.run(callback.run_callback("on_before_node_init"))
        return callback.ctx.run_init_node

    assert not runs_ray_init(str(checkpoint), "one") and (tmp_path / "torch" / "kernels").is_dir()
    assert not runs_ray_init(str(checkpoint), None)
    assert runs_ray_init(str(checkpoint), "two"), "a replica over two nodes: Ray's init on each"
    assert runs_ray_init("s3://bucket/model", "one"), "a model in a bucket is fetched by Ray's init"


def test_no_key_set_means_an_open_endpoint_and_a_bad_checkpoint_is_named(checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("AMALIA_API_KEY", raising=False)
    assert serve_app.app_args({"m": checkpoint}, ServeConfig(), False)["api_key_sha256"] is None
    with pytest.raises(AmaliaError, match=f"not a HF checkpoint \\(no config.json\\): {tmp_path}"):
        serve_app.app_args({"m": tmp_path}, ServeConfig(), False)


def adapter_folder(where, r: int = 8, layers=("q_proj",), **config):
    """A PEFT adapter folder as PeftModel.save_pretrained writes it (zero weights)."""
    import numpy as np
    from safetensors.numpy import save_file

    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 16,
                                                           "target_modules": list(layers), **config}))
    save_file({f"base_model.model.model.layers.0.self_attn.{layer}.lora_{ab}.weight": np.zeros((r, r), np.float32)
               for layer in layers for ab in "AB"}, str(where / "adapter_model.safetensors"))
    return where


def test_adapters_run_on_their_base_models_engine_with_vllms_lora_settings(checkpoint, tmp_path):
    """LoRA adapters ride on the engine of the model they name: vLLM's LoRA engine on (one slot per adapter, the
    largest rank rounded up to one vLLM takes), Ray Serve LLM's adapter loading on, and the folders handed to the
    replica's loader; the model without adapters keeps a plain engine. The Serve config file carries the same."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    adapters = {"base": {"a": adapter_folder(tmp_path / "a", r=8),
                         "b": adapter_folder(tmp_path / "b", r=12, layers=("v_proj", "down_proj"))}}
    config = serve_app.serve_config({"base": checkpoint, "other": checkpoint}, ServeConfig(), False, "amalia-x",
                                    adapters)
    (application,) = ServeDeploySchema.model_validate(config).applications
    with_adapters, plain = application.args["llm_configs"]
    assert with_adapters["engine_kwargs"] | {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                                             "lora_target_modules": ["down_proj", "q_proj", "v_proj"]} == \
        with_adapters["engine_kwargs"], "LoRA layers only where an adapter has weights"
    assert with_adapters["adapters"] == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    assert "enable_lora" not in plain["engine_kwargs"] and "adapters" not in plain
    llm = LLMConfig.model_validate({k: v for k, v in with_adapters.items() if k != "adapters"})
    assert llm.lora_config.max_num_adapters_per_replica == 2 and llm.lora_config.dynamic_lora_loading_path is None
    assert serve_app.adapter_id("base", "a") == "base:a"


@pytest.mark.parametrize("config, problem", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"r": 1024}, "over vLLM's largest LoRA rank"),
    ({"layers": ("q_proj", "lm_head")}, r"adapts \['lm_head'\]"),
])
def test_an_adapter_vllm_cannot_serve_is_refused_before_serving(checkpoint, tmp_path, config, problem):
    folder = adapter_folder(tmp_path / "a", **config)
    with pytest.raises(AmaliaError, match=f"adapter 'a': .*{problem}"):
        serve_app.app_args({"m": checkpoint}, ServeConfig(), False, {"m": {"a": folder}})


def test_adapters_name_a_served_model_and_a_folder(checkpoint, tmp_path):
    folder = adapter_folder(tmp_path / "a")
    with pytest.raises(AmaliaError, match=r"adapters for \['x'\], which is not served here"):
        serve_app.app_args({"m": checkpoint}, ServeConfig(), False, {"x": {"a": folder}})
    with pytest.raises(AmaliaError, match="not a PEFT adapter folder"):
        serve_app.app_args({"m": checkpoint}, ServeConfig(), False, {"m": {"a": tmp_path}})
    with pytest.raises(AmaliaError, match="adapter name 'a:b'"):
        serve_app.app_args({"m": checkpoint}, ServeConfig(), False, {"m": {"a:b": folder}})
    with pytest.raises(AmaliaError, match="':' is kept for adapters"):
        serve_app.app_args({"m:1": checkpoint}, ServeConfig(), False)


def test_lora_options_attach_adapters_to_the_first_or_the_named_checkpoint():
    from amalia_ray.cli.serve_commands import _adapters

    got = _adapters(["a=/x/a", "sft:b=/x/b", "c=/x/c"], ["base", "sft"])
    assert got == {"base": {"a": Path("/x/a"), "c": Path("/x/c")}, "sft": {"b": Path("/x/b")}}
    for bad, problem in (("a", "expected NAME=FOLDER"), ("dpo:a=/x", "'dpo' is not a served model"),
                         ("=/x", "expected NAME=FOLDER")):
        with pytest.raises(AmaliaError, match=problem):
            _adapters([bad], ["base", "sft"])
    with pytest.raises(AmaliaError, match="already has an adapter named 'a'"):
        _adapters(["a=/x", "base:a=/y"], ["base", "sft"])


def guarded_client(key: str | None, max_bytes: int = 1024) -> TestClient:
    async def echo(request):
        return JSONResponse({"bytes": len(await request.body())})

    async def errors_to_500(request, call_next):  # what the ray.serve.llm ingress does with an exception
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"error": repr(e)}, status_code=500)

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"]), Route("/health", echo)])
    app.add_middleware(BaseHTTPMiddleware, dispatch=errors_to_500)
    app.add_middleware(RequestGuard, api_key_sha256=key_digest(key) if key else None, max_request_bytes=max_bytes)
    return TestClient(app)


@pytest.mark.reliability
def test_the_guard_applies_below_a_route_prefix():
    """On a shared Serve another application may hold "/", so ours sits below a prefix (Serve's root_path): /health
    stays open there and a request body is checked there as at the root."""
    import asyncio

    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    guard = RequestGuard(inner, api_key_sha256=key_digest("k"), max_request_bytes=1024)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    def call(method: str, path: str, body: bytes = b"", key: str | None = None):
        reached.clear(), sent.clear()
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "http", "method": method, "path": path, "root_path": "/amalia-team", "headers": headers}

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        asyncio.run(guard(scope, receive, send))
        return next((m["status"] for m in sent if m["type"] == "http.response.start"), None)

    assert call("GET", "/amalia-team/health") is None and reached == ["/amalia-team/health"], "open, no key"
    assert call("GET", "/amalia-team/v1/models") == 401 and not reached
    assert call("POST", "/amalia-team/v1/completions", b"{not json", key="k") == 400 and not reached
    assert call("POST", "/amalia-team/v1/completions", b'{"model": "m", "prompt": "x"}', key="k") is None and reached


@pytest.mark.reliability
def test_api_key_is_enforced_except_on_health():
    client = guarded_client("s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = client.post("/v1/completions", json={}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/completions", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert guarded_client(None).post("/v1/completions", json={}).status_code == 200


def json_of_size(n: int) -> bytes:
    return b'{"p": "' + b"x" * (n - 9) + b'"}'


@pytest.mark.reliability
def test_oversized_bodies_are_refused_declared_or_streamed():
    client = guarded_client(None, max_bytes=1024)
    assert client.post("/v1/completions", content=json_of_size(1024)).json() == {"bytes": 1024}
    r = client.post("/v1/completions", content=json_of_size(1025))
    assert r.status_code == 413 and "over 1024 bytes" in r.json()["error"]["message"]
    chunks = (b"x" * 600 for _ in range(3))  # no Content-Length: counted as it streams
    assert client.post("/v1/completions", content=chunks).status_code == 413


def test_stop_finds_no_server_and_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("AMALIA_STATE_DIR", str(tmp_path))
    with pytest.raises(AmaliaError, match=f"no `amalia serve` on 127.0.0.1:8000 on this machine .*{tmp_path}"):
        serve_app.stop_local("127.0.0.1", 8000)
    with serve_app.local_state("127.0.0.1", 8000, "http://127.0.0.1:8000/v1", ["m"]) as state:
        assert json.loads(state.read_text())["models"] == ["m"]
    assert not state.exists()


@pytest.mark.reliability
def test_stop_leaves_alone_a_process_that_took_a_dead_servers_pid(tmp_path, monkeypatch):
    """A server killed without cleaning up leaves its state file; when its PID now belongs to another process,
    `amalia serve --stop` must not signal that process. The server's own PID and start time are what it checks."""
    import subprocess
    import sys

    monkeypatch.setenv("AMALIA_STATE_DIR", str(tmp_path))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with serve_app.local_state("127.0.0.1", 8000, "http://127.0.0.1:8000/v1", ["m"]) as state:
            recorded = json.loads(state.read_text())
            stale = {**recorded, "pid": bystander.pid}  # as if the server had been this PID, started earlier
            state.write_text(json.dumps(stale))
            said = serve_app.stop_local("127.0.0.1", 8000)
            assert "left alone" in said and not state.exists()
        assert bystander.poll() is None, "the unrelated process was signalled"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("path,body,problem", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", b'{"model": "m", "prompt": NaN}', "NaN is not a JSON number"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    ("/v1/completions", b"[1, 2]", "must be a JSON object"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ("/v1/completions", b'{"model": 3.5}', "'model' must be a string"),
    ("/v1/chat/completions", b'{"messages": false}', "'messages' must be a list"),
    ("/v1/chat/completions", b'{"messages": [1]}', "'messages' must be a list"),
    ("/v1/completions", b"\xff\xfe", "not valid JSON"),
])
@pytest.mark.reliability
def test_bodies_that_would_reach_the_engine_as_500s_are_400s(path, body, problem):
    r = guarded_client(None, max_bytes=1 << 20).post(path, content=body)
    assert r.status_code == 400 and problem in r.json()["error"]["message"]


def test_a_well_formed_body_passes_the_guard():
    ok = guarded_client(None).post("/v1/completions", json={"model": "m", "prompt": [{"role": "user",
                                                                                           "content": "olá"}]})
    assert ok.status_code == 200


@pytest.mark.parametrize("gpus, stages", [(1, 1), (2, 1), (8, 1), (8, 2)])
def test_gpu_replicas_split_the_model_over_their_gpus(checkpoint, gpus, stages):
    """One bundle per GPU, the replica in the first; vLLM's tensor × pipeline parallel degree equals the GPUs the
    placement group holds (Ray's LLMConfig expands the same bundles), tensor parallel kept inside one node."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    cfg = ServeConfig(gpus_per_replica=gpus, pipeline_parallel_size=stages, cpus_per_replica=4)
    config = serve_app.serve_config({"m": checkpoint}, cfg, use_gpu=True, name="amalia-serve")
    llm = LLMConfig.model_validate(config["applications"][0]["args"]["llm_configs"][0])
    engine = llm.get_engine_config()
    assert (engine.tensor_parallel_degree, engine.pipeline_parallel_degree) == (gpus // stages, stages)
    assert engine.num_devices == gpus == sum(b.get("GPU", 0) for b in engine.placement_bundles)
    assert all(b["GPU"] == 1 for b in engine.placement_bundles) and engine.placement_bundles[0]["CPU"] == 4
    assert engine.placement_strategy == ("STRICT_PACK" if stages == 1 else "PACK")


def test_the_config_writer_writes_gpu_replicas_when_asked(checkpoint, tmp_path):
    from typer.testing import CliRunner

    from amalia_ray.cli import app

    runner = CliRunner()
    for args, gpus, tp in [([], 0, None), (["--gpus-per-replica", "2"], 2, 2), (["--device", "cuda"], 1, 1)]:
        out = tmp_path / "serve.yaml"
        result = runner.invoke(app, ["serve", str(checkpoint), "--config-out", str(out), *args])
        assert result.exit_code == 0, result.output
        llm = yaml.safe_load(out.read_text())["applications"][0]["args"]["llm_configs"][0]
        assert sum(b.get("GPU", 0) for b in llm["placement_group_config"]["bundles"]) == gpus
        assert llm["engine_kwargs"].get("tensor_parallel_size") == tp
    result = runner.invoke(app, ["serve", str(checkpoint), "--config-out", str(out), "--gpus-per-replica", "3",
                                 "--pipeline-parallel-size", "2"])
    assert result.exit_code == 1 and "not a multiple of pipeline_parallel_size" in result.output


def test_an_adapters_first_requests_at_once_load_it_once(monkeypatch):
    """Ray checks whether an adapter is loaded, then awaits vLLM's load: two first requests for one adapter at once
    would both load it, and the second fail ("has already been loaded"). The server resolves adapters one at a
    time, so the second finds it loaded; a request for the base model does not wait behind an adapter's load."""
    import asyncio
    import contextvars

    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    from amalia_ray.serve.ingress import llm_server_class

    loaded, loads = set(), []

    async def resolve(self):  # Ray's check-then-load, with the load taking a while
        if not requested.get() or "pre:sft" in loaded:
            return
        loads.append("pre:sft")
        await asyncio.sleep(0.05)
        if "pre:sft" in loaded:
            raise ValueError("Failed to load lora model: The lora adapter 'pre:sft' has already been loaded.")
        loaded.add("pre:sft")

    monkeypatch.setattr(LLMServer, "_maybe_resolve_lora_from_multiplex", resolve)
    requested = contextvars.ContextVar("model_id")  # each request's own, as Serve's multiplexed model id
    monkeypatch.setattr("ray.serve.get_multiplexed_model_id", lambda: requested.get())
    server = object.__new__(llm_server_class({"sft": "/nowhere"}))
    finished = []

    async def request(model_id: str):
        requested.set(model_id)
        await server._maybe_resolve_lora_from_multiplex()
        finished.append(model_id or "base")

    async def at_once():
        await asyncio.gather(request("pre:sft"), request("pre:sft"), request(""), request("pre:sft"))

    asyncio.run(at_once())
    assert loads == ["pre:sft"] and loaded == {"pre:sft"}
    assert finished[0] == "base", "the base model's request waited for the adapter's load"
