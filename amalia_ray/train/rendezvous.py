"""The key-value store torch.distributed's rendezvous needs, as a Ray actor reached over Ray's own authenticated
channel, rather than a TCPStore, which listens on every interface without authentication (the client side, a
torch Store: `weight_sync.RayStore`). This module imports nothing heavy: a process group's store actor starts in
the time a Python process with Ray takes, not torch's import as well."""

from __future__ import annotations

import asyncio
import time


class RendezvousStore:
    """The key-value store gloo's rendezvous needs, in a Ray actor (reached over Ray's own authenticated channel)
    rather than a TCPStore, which listens on every interface."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.changed = asyncio.Event()

    async def set(self, key: str, value: bytes) -> None:
        self.values[key] = value
        self.changed.set()
        self.changed = asyncio.Event()

    async def get(self, keys: list[str], timeout_s: float) -> list[bytes] | None:
        deadline = time.monotonic() + timeout_s
        while not all(k in self.values for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return None
        return [self.values[k] for k in keys]

    async def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        await self.set(key, str(value).encode())
        return value

    async def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    async def delete(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.values.get(key)
        if (current is None and not expected) or current == expected:
            await self.set(key, desired)
            return desired
        return current if current is not None else expected
