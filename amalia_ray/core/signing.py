"""Signed file lists: what this project writes and later unpickles (training checkpoints, a sweep's Tune state) is
listed with its sha256 digests, and the list is signed (HMAC-SHA256) with a key that lives outside the run's
storage: AMALIA_CHECKPOINT_KEY, else a key made once per user in ~/.amalia/checkpoint.key (0600). A digest alone
would not do: anyone who can write the storage could recompute it for a planted file. A machine that resumes
another's run needs the same key (set AMALIA_CHECKPOINT_KEY on both)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from amalia_ray.core.secrets import secret_file

KEY_ENV = "AMALIA_CHECKPOINT_KEY"


def signing_key() -> str:
    """The key file lists are signed with: AMALIA_CHECKPOINT_KEY, else this user's own, made once (0600)."""
    if key := os.environ.get(KEY_ENV):
        return key
    path = Path(os.environ.get("AMALIA_STATE_DIR") or Path.home() / ".amalia") / "checkpoint.key"
    return secret_file(path).read_text().strip()


def sign(key: str, files: dict) -> str:
    """The HMAC of a file list (any JSON mapping), independent of its key order."""
    message = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def signed_list(files: dict, key: str) -> str:
    """The text of a signed list file: the list and its HMAC."""
    return json.dumps({"files": files, "hmac": sign(key, files)}, indent=1)


def verified_list(text: str, key: str) -> dict | None:
    """A signed list file's list when it is signed with `key`, else None (also for text that is not one)."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not isinstance(data.get("hmac"),
                                                                                                   str):
            return None
        # as bytes: compare_digest refuses a str that is not ASCII
        signed = hmac.compare_digest(sign(key, data["files"]).encode(), data["hmac"].encode("utf-8", "replace"))
    except (ValueError, RecursionError, TypeError):  # not JSON, a 5,000-digit number, too deep, not serializable
        return None
    return data["files"] if signed else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
