"""A model is served when it answers, not when its engine has loaded: vLLM loads some models it cannot run (an
attention kernel that lacks the model's head size, say) and its engine dies on the first request, after which every
request is an HTTP 500. So each model is tried end to end before it is reported ready — in its replica, one token
generated with the prompt's log-probabilities straight through the engine (a dead engine's own reason is in its log
lines, which this process's log files hold); then over HTTP, one completion with `echo` + `logprobs` (the request
log-likelihood scoring sends) per model id and LoRA adapter. A model that fails is reported with one line of reason.

The reason line is the first `SomethingError: message` line of what the failure wrote, skipping the generic wrappers
that only say that something died ("EngineDeadError: EngineCore encountered an issue. See stack trace (above)")."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import time
import uuid

PROBE_PROMPT = "Olá! Isto é um teste."
MAX_REASON_CHARS = 300
MIN_REQUEST_S = 120.0
LOG_WINDOW_BYTES = 1 << 20  # what is read of the log lines written during a failed probe
ERROR_LINE = re.compile(r"\b((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception))): (\S.*?)\s*$")
WRAPPERS = ("EngineDeadError", "RayTaskError", "EngineGenerateError")  # say that something died, not why


def error_line(text: str) -> str | None:
    """The first line of `text` that states an exception and its message, as "Name: message" (one line, at most
    MAX_REASON_CHARS); None when there is none."""
    for line in text.splitlines():
        m = ERROR_LINE.search(line)
        if m and not m.group(2).startswith(WRAPPERS):
            return _short(f"{m.group(2)}: {m.group(3)}")
    return None


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "…"


class OwnLogs:
    """This process's standard output and error where they are files (Ray writes a worker's to its log folder, and
    the engine's child processes inherit them): marked now, read from the mark later."""

    def __init__(self):
        self._marks: dict[str, int] = {}
        for fd in (1, 2):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
                if stat.S_ISREG(os.stat(path).st_mode):
                    self._marks[path] = os.path.getsize(path)
            except OSError:  # not Linux, or not a file (a terminal, a pipe): nothing to read back
                continue

    def since_mark(self) -> str:
        parts = []
        for path, mark in self._marks.items():
            try:
                with open(path, "rb") as f:
                    f.seek(mark)
                    parts.append(f.read(LOG_WINDOW_BYTES).decode("utf-8", "replace"))
            except OSError:
                continue
        return "\n".join(parts)


async def probe_engine(engine_client, timeout_s: float) -> str | None:
    """Generate one token for PROBE_PROMPT with the prompt's log-probabilities on a vLLM engine client (AsyncLLM).
    None when it answers; else the reason, from the engine's own log lines where it died. An engine that does not
    answer in time raises TimeoutError (it may be slow rather than broken: its replica is started again)."""
    from vllm import SamplingParams

    logs = OwnLogs()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    async def one() -> None:
        async for _ in engine_client.generate(PROBE_PROMPT, params, request_id=f"amalia-probe-{uuid.uuid4().hex}"):
            pass

    try:
        await asyncio.wait_for(one(), timeout_s)
        return None
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer to a one-token request within {timeout_s:.0f}s") from None
    except Exception as e:  # noqa: BLE001 - whatever stops the engine is the reason reported
        await asyncio.sleep(1.0)  # the engine's processes write their tracebacks as they go down
        return error_line(logs.since_mark()) or error_line(f"{type(e).__name__}: {e}") or type(e).__name__


def probe_over_http(base_url: str, model_ids: list[str], api_key: str | None, timeout_s: float) -> dict[str, str]:
    """One completion with `echo` + `logprobs` per served model id (a LoRA adapter loads on its first request);
    returns {model id: reason} for those that do not answer it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    failed = {}
    for model_id in model_ids:
        body = {"model": model_id, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
                "logprobs": 1}
        try:  # at least MIN_REQUEST_S each: a LoRA adapter loads on its first request
            r = httpx.post(f"{base_url}/completions", json=body, headers=headers,
                           timeout=max(MIN_REQUEST_S, deadline - time.monotonic()))
        except httpx.HTTPError as e:
            failed[model_id] = _short(f"{type(e).__name__}: {e}")
            continue
        if r.status_code != 200:
            failed[model_id] = f"HTTP {r.status_code}: " + (error_line(_message(r)) or _short(_message(r)))
            continue
        try:
            answered = bool((r.json().get("choices") or [{}])[0].get("logprobs"))
        except (ValueError, AttributeError, IndexError, TypeError):
            answered = False
        if not answered:
            failed[model_id] = "answered without the prompt's log-probabilities (echo + logprobs)"
    return failed


def _message(r) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text
