"""Cleaning steps over Arrow batches: mojibake repair, in-document repeated-line removal, PII scrubbing."""

from __future__ import annotations

import ipaddress
import re

import pyarrow as pa

from amalia_ray.core.config import CleaningConfig
from amalia_ray.data.steps import map_text

EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b")
# international (+351 912 345 678, +55 (11) 91234-5678) and Portuguese national numbers (912 345 678, 213456789)
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){2,3}"
    r"|(?:2\d|9[1236])\d(?:[ .-]?\d{3}){2})(?![\w])"
)
IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
IPV6_CANDIDATE = re.compile(r"(?<![\w:])[0-9A-Fa-f:]*:[0-9A-Fa-f:]*:[0-9A-Fa-f:]*(?![\w:])")

PLACEHOLDERS = {"email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP_ADDRESS>"}


def _ipv6_or_keep(match: re.Match) -> str:
    try:
        ipaddress.IPv6Address(match.group(0))
    except ValueError:
        return match.group(0)  # e.g. a time "10:30:00" or a C++ scope "std::"
    return PLACEHOLDERS["ip"]


def scrub_pii(text: str) -> str:
    text = EMAIL.sub(PLACEHOLDERS["email"], text)
    text = IPV6_CANDIDATE.sub(_ipv6_or_keep, text)
    text = IPV4.sub(PLACEHOLDERS["ip"], text)
    return PHONE.sub(PLACEHOLDERS["phone"], text)


def remove_repeated_lines(text: str, min_length: int) -> str:
    """Drop every repeat of a line already seen in the document (menus, footers, share buttons), keeping the
    first; short lines (blank, list markers, code braces) are left alone."""
    seen: set[str] = set()
    out = []
    for line in text.split("\n"):
        key = line.strip()
        if len(key) >= min_length:
            if key in seen:
                continue
            seen.add(key)
        out.append(line)
    return "\n".join(out)


class Clean:
    def __init__(self, cfg: CleaningConfig):
        self.cfg = cfg
        if cfg.fix_mojibake:
            import ftfy

            self._fix = ftfy.fix_text

    def clean(self, text: str) -> str:
        if self.cfg.fix_mojibake:
            text = self._fix(text, normalization="NFC")
        if self.cfg.remove_repeated_lines:
            text = remove_repeated_lines(text, self.cfg.repeated_line_min_chars)
        if self.cfg.scrub_pii:
            text = scrub_pii(text)
        return text

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_text(batch, self.clean)
