"""A bounded, seeded fuzz of the OpenAI API on loopback: malformed, oversized and adversarial requests built from a
valid one. Every case is (method, path, headers, body bytes); nothing here needs a server."""

from __future__ import annotations

import json
import random

VALID_COMPLETION = {"model": "pre", "prompt": "O sistema Debian", "max_tokens": 4, "temperature": 0}
VALID_CHAT = {"model": "pre", "messages": [{"role": "user", "content": "Olá"}], "max_tokens": 4}

# values that a field should never accept, or accept only within bounds
WEIRD = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 3.5, -0.0, 1e308, -1e308, "", "x", "1",
         "NaN", " " * 5000, "\u0000", "\ud800", "😀" * 2000, [], [1], [[1, 2]], ["a", None], {}, {"a": 1},
         [[[[[]]]]], list(range(3000)), "palavra " * 4000]
FIELDS_COMPLETION = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "logprobs",
                     "echo", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stream",
                     "suffix", "user", "min_tokens", "repetition_penalty", "prompt_logprobs", "truncate_prompt_tokens"]
FIELDS_CHAT = ["messages", "max_tokens", "temperature", "n", "logprobs", "top_logprobs", "tools", "tool_choice",
               "response_format", "stream", "stop", "max_completion_tokens"]
RAW_BODIES = [b"", b"{", b"}", b"[]", b"null", b"42", b'"text"', b"{not json", b"\xff\xfe\xfd", b"\x00" * 100,
              b'{"model": "pre", "prompt": "a"' + b" " * 1000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
              b"[" * 100_000 + b"]" * 100_000, b'{"model": NaN, "prompt": Infinity}',
              b'{"model": "pre", "prompt": "x", "max_tokens": 1e999}', b'{"model": "pre", "prompt": "\\ud800"}',
              json.dumps({"model": "pre", "prompt": "x", "max_tokens": 4}).encode() * 3,
              b'{"model": "pre", "model": "other", "prompt": "x", "max_tokens": 2}']
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/v1/embeddings", "/v1/unknown",
         "/v1/models/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/v1/completions?" + "x=1&" * 2000,
         "/" + "a" * 10_000, "/v1/models/pre", "/v1//completions", "/v1/completions/", "/docs", "/openapi.json"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def cases(seed: int, n: int, auth: dict[str, str]) -> list[tuple[str, str, dict, bytes]]:
    rng = random.Random(seed)
    json_headers = {**auth, "content-type": "application/json"}
    out: list[tuple[str, str, dict, bytes]] = []
    for body in RAW_BODIES:  # every raw body on both generation endpoints
        for path in ("/v1/completions", "/v1/chat/completions"):
            out.append(("POST", path, json_headers, body))
    for path in PATHS:
        for method in ("GET", "POST"):
            out.append((method, path, json_headers, json.dumps(VALID_COMPLETION).encode()))
    while len(out) < n:
        kind = rng.random()
        base, fields, path = ((VALID_COMPLETION, FIELDS_COMPLETION, "/v1/completions") if rng.random() < 0.6
                              else (VALID_CHAT, FIELDS_CHAT, "/v1/chat/completions"))
        body = dict(base)
        for _ in range(rng.randint(1, 3)):  # one to three fields set to something odd
            body[rng.choice(fields)] = rng.choice(WEIRD)
        if kind < 0.1:
            body.pop(rng.choice(list(body)))
        elif kind < 0.2:
            body["messages"] = [{"role": rng.choice(["user", "system", "tool", "x", None, 1]),
                                 "content": rng.choice(WEIRD)} for _ in range(rng.randint(0, 4))]
        elif kind < 0.25:
            body["unknown_" + str(rng.randint(0, 99))] = rng.choice(WEIRD)
        headers = dict(json_headers)
        if rng.random() < 0.05:
            headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "", "a/b"])
        if rng.random() < 0.03:
            headers["authorization"] = rng.choice(["Bearer", "Basic Zm9vOmJhcg==", "Bearer " + "k" * 5000, ""])
        if rng.random() < 0.02:
            headers["x-pad"] = "p" * 30_000
        method = "POST" if rng.random() < 0.95 else rng.choice(METHODS)
        try:
            payload = json.dumps(body).encode()
        except ValueError:
            continue
        out.append((method, path, headers, payload))
    return out[:n]
