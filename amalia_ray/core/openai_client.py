"""A small OpenAI-API client: bounded concurrency and retries on transient errors, and completions through it
(chat or plain). Evaluation, synthetic-data generation and LLM-judge rewards reach served models only through this,
over HTTP."""

from __future__ import annotations

import asyncio
import logging
import random

import httpx

from amalia_ray.core.errors import AmaliaError

TRANSIENT = {408, 429, 500, 502, 503, 504}
REJECTED = {400, 413, 422}  # about this request's content (a prompt over the context), not the server or the key
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns everything else


class RequestRejected(AmaliaError):
    """The server refused this request's content (400/413/422): the caller may go on with other requests."""


class OpenAIClient:
    def __init__(self, base_url: str, model: str, *, concurrency: int = 8, timeout_s: float = 120, retries: int = 3,
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self._sem = asyncio.Semaphore(concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}  # as the server counted them, for accounting
        self.can_tokenize: bool | None = None  # whether the server has vLLM's /tokenize (known after the first call)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._http.aclose()

    async def token_count(self, text: str, special_tokens: bool = True) -> int | None:
        """How many tokens the served model's tokenizer makes of `text` (with its special tokens, such as BOS, as a
        prompt is tokenized, unless told not to), from vLLM's /tokenize at the server's root; None where the server
        has no such endpoint."""
        if self.can_tokenize is False:
            return None
        try:
            body = await self.post("/tokenize", {"prompt": text, "add_special_tokens": special_tokens}, root=True,
                                   missing_ok=True)
        except RequestRejected:  # a server whose /tokenize is there but refuses to tokenize for this model
            body = None
        self.can_tokenize = isinstance((body or {}).get("count"), int)
        return body["count"] if self.can_tokenize else None

    async def render_chat(self, messages: list[dict]) -> str:
        """The text the served model's chat template makes of `messages`, ready for the assistant's turn (vLLM's
        /tokenize of the messages, then /detokenize)."""
        try:
            tokens = await self.post("/tokenize", {"messages": messages, "add_generation_prompt": True}, root=True,
                                     missing_ok=True)
        except RequestRejected:  # not about one item: no item of the task could be rendered
            tokens = None
        if not tokens or not isinstance(tokens.get("tokens"), list):
            raise AmaliaError(f"{self.base_url}: the server cannot render chat messages with the model's chat "
                              "template (vLLM's /tokenize with messages); score this task without `chat`")
        return (await self.post("/detokenize", {"tokens": tokens["tokens"]}, root=True))["prompt"]

    async def post(self, path: str, payload: dict, *, root: bool = False, missing_ok: bool = False) -> dict | None:
        """POST under the API's base URL (or, with `root`, at the server's root: vLLM's /tokenize); with
        `missing_ok`, an endpoint the server does not have (404/405) gives None."""
        payload = {"model": self.model, **payload}
        url = (self.base_url.removesuffix("/v1") if root else self.base_url) + path
        async with self._sem:
            for attempt in range(self.retries + 1):
                try:
                    r = await self._http.post(url, json=payload)
                except httpx.TransportError as e:
                    error = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code == 200:
                        body = r.json()
                        for k, n in (body.get("usage") or {}).items():
                            if k in self.usage and isinstance(n, int):
                                self.usage[k] += n
                        return body
                    error = f"HTTP {r.status_code}: {r.text[:300]}"
                    if missing_ok and r.status_code in (404, 405):
                        return None
                    if r.status_code in REJECTED:
                        raise RequestRejected(f"{url} rejected for model '{self.model}': {error}")
                    if r.status_code not in TRANSIENT:
                        break
                if attempt < self.retries:
                    await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (1 + random.random()))
        raise AmaliaError(f"{url} failed for model '{self.model}': {error}")


async def generate(client: OpenAIClient, prompt: str, *, max_tokens: int, chat: bool, seed: int = 0,
                   temperature: float = 0.0, top_p: float = 1.0, system_prompt: str | None = None) -> str:
    """One completion: /v1/chat/completions for instruction-tuned models (the prompt as the user's turn, after the
    system turn when there is one), or /v1/completions for base models."""
    (text,) = await generate_n(client, prompt, n=1, max_tokens=max_tokens, chat=chat, seed=seed,
                               temperature=temperature, top_p=top_p, system_prompt=system_prompt)
    return text


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict]:
    return [*([{"role": "system", "content": system_prompt}] if system_prompt else []),
            {"role": "user", "content": prompt}]


async def generate_n(client: OpenAIClient, prompt: str, *, n: int, max_tokens: int, chat: bool, seed: int = 0,
                     temperature: float = 0.0, top_p: float = 1.0, system_prompt: str | None = None) -> list[str]:
    """n completions of one prompt in one request (the API's `n`: the server samples them together), in order."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
              **({"n": n} if n > 1 else {})}
    if chat:
        r = await client.post("/chat/completions", {"messages": chat_messages(prompt, system_prompt), **params})
        return [c["message"].get("content") or "" for c in sorted(r["choices"], key=lambda c: c.get("index", 0))]
    r = await client.post("/completions", {"prompt": prompt, **params})
    return [c["text"] for c in sorted(r["choices"], key=lambda c: c.get("index", 0))]
