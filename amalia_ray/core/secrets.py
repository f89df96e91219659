"""Secrets (API keys, storage credentials) never reach a file or a log: copies of a recipe are written with
secret-looking values masked, and every log line of this process has the values it knows masked."""

from __future__ import annotations

import logging
import re

MASK = "***"
# a mapping key that holds a secret: access_key, secret_key, session_token, api_key, password, token, credentials …
# (`*_env` fields name an environment variable and stay readable; max_tokens, tokenizer do not match)
SECRET_KEY = re.compile(r"(^|_)(api_?key|access_?key(_id)?|secret(_access)?(_?key)?|session_?token|token|password|"
                        r"passwd|credentials?|account_key|sas_token|client_secret)$", re.I)
_known: set[str] = set()


def is_secret_key(key) -> bool:
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


def redact(data):
    """`data` (parsed YAML/JSON) with the values under secret-looking keys replaced by MASK; those values are also
    remembered, so the log filter masks them wherever they turn up."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if is_secret_key(k) and isinstance(v, str | int) and str(v):
                remember(str(v))
                out[k] = MASK
            else:
                out[k] = redact(v)
        return out
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def remember_in(data) -> None:
    """Remember the secret-looking values of `data` (e.g. storage options) for masking, without copying it."""
    redact(data)


def remember(value: str | None) -> None:
    if value and len(value) >= 4:  # masking 1–3 characters would garble ordinary text
        _known.add(value)


def mask(text: str) -> str:
    for secret in sorted(_known, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class MaskSecrets(logging.Filter):
    """Masks the remembered secrets in a record's final message (arguments included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _known:
            message = record.getMessage()
            masked = mask(message)
            if masked != message:
                record.msg, record.args = masked, None
        return True


def install_log_masking() -> None:
    """On every handler of the root logger (and new ones added to it later are the caller's to cover)."""
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, MaskSecrets) for f in handler.filters):
            handler.addFilter(MaskSecrets())
    if not any(isinstance(f, MaskSecrets) for f in root.filters):
        root.addFilter(MaskSecrets())
