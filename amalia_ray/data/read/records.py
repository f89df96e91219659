"""What a reader makes of one record: a document (own id, location, text, metadata) or the reason it is quarantined,
shared by the readers of every format."""

from __future__ import annotations

import re

_RAW_LIMIT = 2000  # the raw content kept beside a quarantined record


class Quarantine(Exception):
    """A record that cannot become a document: `reason` is the category the stats count, `detail` the specifics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


Record = tuple[str | None, str, str, dict, Quarantine | None]  # own id, location, text, metadata, why quarantined


def truncated(error: Exception) -> Quarantine:
    """Why the rest of a file is not read: cut short, or (an error that names its own reason) a decompression limit."""
    return Quarantine(getattr(error, "quarantine_reason", "truncated file"), f"{type(error).__name__}: {error}")


def preview(raw: bytes) -> str:
    """The head of a quarantined record's raw bytes, readable."""
    return raw[:_RAW_LIMIT].decode("utf-8", "replace").replace("\x00", "\\x00")


def html_main_text(html: str) -> str:
    from resiliparse.extract.html2text import extract_plain_text

    return extract_plain_text(html, main_content=True, alt_texts=False, links=False, list_bullets=True)


_CHARSET = re.compile(r"charset\s*=\s*[\"']?([\w.:-]+)", re.IGNORECASE)


def decode_html(body: bytes, content_type: str) -> str:
    """A page's text: in the charset its HTTP header declares, else UTF-8 when the bytes are valid UTF-8, else the
    charset its meta tag declares or uchardet guesses (a short page's guess is often wrong: UTF-8 goes first)."""
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    declared = _CHARSET.search(content_type)
    if declared:
        try:
            return body.decode(declared.group(1), errors="replace")
        except LookupError:  # a charset Python does not know: as if none were declared
            pass
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return bytes_to_str(body, detect_encoding(body, from_html_meta=True))
