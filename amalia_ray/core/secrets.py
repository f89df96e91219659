"""Secrets (API keys, storage credentials) never reach a file or a log: copies of a recipe are written with
secret-looking values masked, and every log line of this process has the values it knows masked."""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

MASK = "***"
# a mapping key that holds a secret: access_key, secret_key, session_token, api_key, password, token, credentials …
# (`*_env` fields name an environment variable and stay readable; max_tokens, tokenizer do not match)
SECRET_KEY = re.compile(r"(^|_)(api_?key|access_?key(_id)?|secret(_access)?(_?key)?|session_?token|token|password|"
                        r"passwd|credentials?|account_key|sas_token|client_secret|private_?key(_id)?|"
                        r"connection_?string)$|^(key|secret)$", re.I)  # s3fs's `key` and `secret`; not url_key
# secrets recognised by their value wherever they are: a URI's user:password@, and the shapes of well-known tokens
# (Hugging Face, OpenAI-style, AWS access key ids, GitHub, Slack, a PEM private key)
URI_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)(?P<secret>[^/\s@]+)(?=@)", re.I)
TOKEN_SHAPES = re.compile(r"\b(hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}|"
                          r"xox[abpr]-[A-Za-z0-9-]{10,})\b|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?"
                          r"-----END [A-Z ]*PRIVATE KEY-----")
_known: set[str] = set()


def is_secret_key(key) -> bool:
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


def holds_secret(value: str) -> bool:
    """Whether a value carries a secret by its shape: a URI's password, a well-known token."""
    return _mask_shapes(value) != value


def redact(data):
    """`data` (parsed YAML/JSON) with secrets replaced by MASK: whatever is under a secret-looking key (a string, or
    a whole mapping such as a service account's), a URI's password, values shaped like known tokens and the secrets
    already remembered, wherever they turn up. What is masked is also remembered, so the log filter masks it
    wherever it turns up."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if is_secret_key(k) and v not in (None, "", {}, []) and not isinstance(v, bool):
                _remember_leaves(v)
                out[k] = MASK
            else:
                out[k] = redact(v)
        return out
    if isinstance(data, list):
        return [redact(v) for v in data]
    if isinstance(data, str):
        return mask(data)
    return data


def mask_values(data, keep: frozenset[str] = frozenset()):
    """`data` (JSON-like) with every string masked as a log line is (`mask`: the secrets remembered, URI passwords,
    token shapes), keys left as they are: for records whose keys are names the user chose (a task called
    `next_token` is no secret). Values under the keys in `keep` (hashes, fingerprints) are left whole."""
    if isinstance(data, dict):
        return {k: v if k in keep else mask_values(v, keep) for k, v in data.items()}
    if isinstance(data, list):
        return [mask_values(v, keep) for v in data]
    return mask(data) if isinstance(data, str) else data


def _remember_leaves(value) -> None:
    """A mapping under a secret key (a service account) has its secret-looking fields remembered (private_key …),
    not its project, e-mail or URLs, which name buckets and pages in ordinary messages; one with no such field has
    every leaf remembered."""
    if isinstance(value, dict):
        secret = [v for k, v in value.items() if is_secret_key(k)]
        for v in secret or value.values():
            _remember_leaves(v)
    elif isinstance(value, list):
        for v in value:
            _remember_leaves(v)
    elif value is not None and not isinstance(value, bool):
        remember(str(value))


def _mask_shapes(text: str) -> str:
    """Masks (and remembers) a URI's password and anything shaped like a known token."""
    def hide(match: re.Match) -> str:
        remember(match.group("secret") if "secret" in match.groupdict() else match.group(0))
        return (match.group("head") if "head" in match.groupdict() else "") + MASK

    return TOKEN_SHAPES.sub(hide, URI_PASSWORD.sub(hide, text))


def remember_in(data) -> None:
    """Remember the secret-looking values of `data` (e.g. storage options) for masking, without copying it."""
    redact(data)


# values a secret-looking option takes that are modes, not secrets (gcsfs's `token`: anon, cloud, cache, …)
_NOT_SECRET = {"anon", "cloud", "cache", "browser", "google_default", "true", "false", "none", "null"}


def remember(value: str | None) -> None:
    # masking a few characters (or a mode word) would garble ordinary text: "canonical" is no leak of "anon"
    if value and len(value) >= 6 and value.lower() not in _NOT_SECRET:
        _known.add(value)


def mask(text: str) -> str:
    for secret in sorted(_known, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _mask_shapes(text)


class MaskSecrets(logging.Filter):
    """Masks the remembered secrets in a record's final message (arguments included)."""

    def filter(self, record: logging.LogRecord) -> bool:
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


def secret_file(path: Path) -> Path:
    """A file holding a random secret (64 hex digits), made once and readable by its owner only: written whole,
    then linked into place, so a process racing this one reads the winner's, never an empty file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    os.chmod(path, 0o600)
    return path
