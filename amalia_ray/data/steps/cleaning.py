"""Cleaning steps over Arrow batches: mojibake repair, in-document repeated-line removal, PII scrubbing, Unicode and
whitespace normalization."""

from __future__ import annotations

import ipaddress
import re
import unicodedata

import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.core.config import CleaningConfig
from amalia_ray.data.steps.base import DocumentStep, map_text

# Every repeat is bounded (an address's own limits: 64 characters before the @, labels of 63, a top-level domain of
# at most 24 letters), and an IPv6 candidate needs two colons within its first two groups and is at most 39
# characters, so a run of "a.a.a.…" or "a:a:a:…" costs linear time: unbounded repeats backtrack in quadratic and cubic
# time, and one such run of a few MB would hold a task for hours.
EMAIL = re.compile(r"\b[\w.+-]{1,64}@[\w-]{1,63}(?:\.[\w-]{1,63}){0,8}\.[A-Za-z]{2,24}\b")
# international (+351 912 345 678, +55 (11) 91234-5678) and Portuguese national numbers (912 345 678, 213456789)
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){2,3}"
    r"|(?:2\d|9[1236])\d(?:[ .-]?\d{3}){2})(?![\w])"
)
IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
IPV6_CANDIDATE = re.compile(r"(?<![\w:])(?=[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:)[0-9A-Fa-f:]{2,39}(?![\w:])")

# ftfy only changes a text that has one of these: UTF-8 read as Latin-1/cp1252 (a lead byte's character followed by
# a continuation byte's), HTML entities, control characters, curly quotes, ligatures, full-width forms, odd line
# breaks. Looking for them with one vectorized RE2 scan of the batch skips ftfy (the slowest cleaning step) on the
# rest; a false alarm only costs the ftfy call.
FTFY_MIGHT_CHANGE = (
    "[\u00c2-\u00f4][\u0080-\u00bf\u20ac\u201a\u0192\u201e\u2026\u2020\u2021\u02c6\u2030\u0160\u2039\u0152"
    "\u017d\u2018\u2019\u201c\u201d\u2022\u2013\u2014\u02dc\u2122\u0161\u203a\u0153\u017e\u0178]"
    "|[&\r\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2018\u2019\u201c\u201d\ufb00-\ufb06\uff01-\uff5e\u2028\u2029]"
)

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


class Clean(DocumentStep):
    def __init__(self, cfg: CleaningConfig):
        self.cfg = cfg
        if cfg.fix_mojibake:
            import ftfy

            self._fix = ftfy.fix_text

    def clean(self, text: str, fix: bool = True) -> str:
        if self.cfg.fix_mojibake and fix:
            text = self._fix(text, normalization="NFC")
        if self.cfg.remove_repeated_lines:
            text = remove_repeated_lines(text, self.cfg.repeated_line_min_chars)
        if self.cfg.scrub_pii:
            text = scrub_pii(text)
        return text

    def __call__(self, batch: pa.Table) -> pa.Table:
        if not self.cfg.fix_mojibake or not len(batch):
            return map_text(batch, self.clean)
        suspect = pc.match_substring_regex(pc.fill_null(batch["text"], ""), FTFY_MIGHT_CHANGE).to_pylist()
        return map_text(batch, self.clean, suspect)


_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")


class Normalize(DocumentStep):
    """Unicode normalization, per-line whitespace cleanup and blank-line collapsing."""

    def __init__(self, form: str = "NFC"):
        self.form = form

    def clean(self, text: str) -> str:
        text = unicodedata.normalize(self.form, text).replace("\r\n", "\n").replace("\r", "\n")
        lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
        return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_text(batch, self.clean)
