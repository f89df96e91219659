"""A small OpenAI-API client: bounded concurrency and retries on transient errors, and completions through it
(chat or plain). Evaluation, synthetic-data generation and LLM-judge rewards reach served models only through this,
over HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx

from amalia_ray.core.errors import AmaliaError

TRANSIENT = {408, 429, 500, 502, 503, 504}
MAX_REPLY_BYTES = 64 << 20  # a reply is read up to this: a server (a judge elsewhere, a proxy) cannot fill memory
REJECTED = {400, 413, 422}  # about this request's content (a prompt over the context), not the server or the key
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns everything else


class RequestRejected(AmaliaError):
    """The server refused this request's content (400/413/422): the caller may go on with other requests."""


class OpenAIClient:
    def __init__(self, base_url: str, model: str, *, concurrency: int = 8, timeout_s: float = 120, retries: int = 3,
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        # httpx's timeout bounds each read; a server sending a byte now and then would never hit it: each attempt,
        # connection to last byte, gets this much
        self.timeout_s, self.max_reply_bytes = timeout_s, max_reply_bytes
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

    async def post(self, path: str, payload: dict, *, root: bool = False, missing_ok: bool = False,
                   reply_limit: int | None = None) -> dict | None:
        """POST under the API's base URL (or, with `root`, at the server's root: vLLM's /tokenize); with
        `missing_ok`, an endpoint the server does not have (404/405) gives None. `reply_limit`: the most bytes of
        reply read (default: the client's max_reply_bytes)."""
        payload = {"model": self.model, **payload}
        url = (self.base_url.removesuffix("/v1") if root else self.base_url) + path
        async with self._sem:
            for attempt in range(self.retries + 1):
                try:
                    status, content = await asyncio.wait_for(
                        self._read(url, payload, reply_limit or self.max_reply_bytes), self.timeout_s)
                except httpx.TransportError as e:
                    error = f"{type(e).__name__}: {e}"
                except TimeoutError:
                    error = f"no whole reply within {self.timeout_s:g} s"
                else:
                    if status == 200:
                        try:
                            body = json.loads(content)
                        except ValueError:
                            body = None
                        if not isinstance(body, dict):
                            raise AmaliaError(f"{url} for model '{self.model}': the reply is not a JSON object: "
                                              f"{content[:200].decode('utf-8', 'replace')!r}")
                        for k, n in (body.get("usage") or {}).items():
                            if k in self.usage and isinstance(n, int):
                                self.usage[k] += n
                        return body
                    error = f"HTTP {status}: {content[:300].decode('utf-8', 'replace')}"
                    if missing_ok and status in (404, 405):
                        return None
                    if status in REJECTED:
                        raise RequestRejected(f"{url} rejected for model '{self.model}': {error}")
                    if status not in TRANSIENT:
                        break
                if attempt < self.retries:
                    await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (1 + random.random()))
        raise AmaliaError(f"{url} failed for model '{self.model}': {error}")

    async def _read(self, url: str, payload: dict, limit: int) -> tuple[int, bytes]:
        """The reply's status and body, read no further than `limit` bytes (a longer one is an error)."""
        async with self._http.stream("POST", url, json=payload) as r:
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise AmaliaError(f"{url} for model '{self.model}': the reply runs past {limit:,} bytes; it was "
                                      "not read further")
            return r.status_code, bytes(body)


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
    return [text for text, _ in await complete_n(client, prompt, n=n, max_tokens=max_tokens, chat=chat, seed=seed,
                                                 temperature=temperature, top_p=top_p, system_prompt=system_prompt)]


async def complete_n(client: OpenAIClient, prompt: str, *, n: int, max_tokens: int, chat: bool, seed: int = 0,
                     temperature: float = 0.0, top_p: float = 1.0,
                     system_prompt: str | None = None) -> list[tuple[str, str | None]]:
    """`generate_n`'s completions with why each ended (the API's finish_reason: "stop", "length" for one cut at
    max_tokens, None where the server does not say). A reply without them is an error naming the server."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
              **({"n": n} if n > 1 else {})}
    if chat:
        path, body = "/chat/completions", {"messages": chat_messages(prompt, system_prompt), **params}
    else:
        path, body = "/completions", {"prompt": prompt, **params}
    choices = (await client.post(path, body)).get("choices")
    out = []
    for c in sorted(choices, key=lambda c: c.get("index") or 0 if isinstance(c, dict) else 0) \
            if isinstance(choices, list) else []:
        message = c.get("message") if isinstance(c, dict) else None
        text = (message.get("content") if isinstance(message, dict) else None) if chat else \
            (c.get("text") if isinstance(c, dict) else None)
        if chat and isinstance(message, dict) and text is None:
            text = ""  # a chat reply may carry no content (a refusal, only tool calls)
        if not isinstance(text, str):
            break
        out.append((text, c.get("finish_reason")))
    if len(out) != n:
        raise AmaliaError(f"{client.base_url}{path} for model '{client.model}': the reply does not hold {n} "
                          f"completion(s) (`choices` with {'message.content' if chat else 'text'})")
    return out
