"""Web-archive captures: an archive holds many captures of one page over the years; the corpus wants one document per
page. Every document gets `url_key` (its URL normalised by the rules of `normalize_url`) and `captured_at` (the
capture's time, UTC seconds), read from its metadata (`url`, `date`: WARC-Target-URI and WARC-Date for web archives,
the source's url/date fields for jsonl and Parquet). `select_captures` keeps one capture per `url_key`, the latest
(or earliest) by `captured_at`, in one keyed shuffle; the others are marked `capture:older` (`capture:newer`)."""

from __future__ import annotations

import json
import math
import posixpath
import re
from datetime import datetime, timezone
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.data.exchange.decide import ROW
from amalia_ray.data.steps.base import DocumentStep

# query parameters that say where a visitor came from, not which page it is
TRACKING_PARAMS = frozenset({
    "gclid", "gclsrc", "dclid", "fbclid", "msclkid", "yclid", "igshid", "mc_cid", "mc_eid", "_ga", "_gl", "_hsenc",
    "_hsmi", "mkt_tok", "vero_id", "oly_enc_id", "oly_anon_id", "wickedid", "twclid", "ttclid", "srsltid",
    "phpsessid", "jsessionid", "aspsessionid", "sessionid", "sid",
})
TRACKING_PREFIXES = ("utm_", "pk_", "mtm_", "hsa_")
DEFAULT_PORTS = {"http": 80, "https": 443}
# replay URLs of web archives (Arquivo.pt, the Internet Archive's Wayback Machine and other pywb/OpenWayback
# installations): /wayback/<14-digit time><flags>/<original URL> or /web/...
_REPLAY = re.compile(r"^https?://[^/]+/(?:wayback|web|noFrame/replay)/(\d{8,14})(?:[a-z]{2}_)?/(.+)$", re.I)
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # what stays as it is when non-ASCII characters are percent-escaped
_SESSION_IN_PATH = re.compile(r";(?:jsessionid|phpsessid|sid)=[^/?#]*", re.I)


def unwrap_replay(url: str) -> tuple[str, str | None]:
    """An archive's replay URL -> (the original URL, the capture's 14-digit time); any other URL -> (url, None)."""
    m = _REPLAY.match(url.strip())
    if not m:
        return url, None
    inner = m.group(2)
    if not re.match(r"^[a-z][a-z0-9+.-]*:", inner, re.I):
        inner = "http://" + inner
    return inner.replace(":/", "://", 1) if re.match(r"^https?:/[^/]", inner, re.I) else inner, m.group(1)


def _percent_case(part: str) -> str:
    """Percent-escapes in upper case, and unreserved characters (letters, digits, -._~) unescaped."""
    def fix(m: re.Match) -> str:
        ch = chr(int(m.group(0)[1:], 16))
        return ch if ch in _UNRESERVED else m.group(0).upper()
    return _PERCENT.sub(fix, part)


def _host(host: str) -> str:
    host = host.lower().rstrip(".")
    if host.startswith("www."):
        host = host[4:]
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        return host


def normalize_url(url: str | None) -> str | None:
    """The key shared by every capture of one page, or None when `url` is not an http(s) URL. The rules, in order:

    1. an archive's replay URL (`…/wayback/20190101000000/http://x.pt/`) stands for the URL it replays;
    2. the scheme is left out: `http://` and `https://` captures are one page;
    3. the host is lower-cased, its trailing dot and a leading `www.` are removed, and an international name is
       written in punycode; user names and passwords are removed;
    4. the port is removed when it is the scheme's default (80, 443);
    5. the path: `.`/`..` segments resolved, repeated slashes collapsed, percent-escapes in upper case and
       unreserved characters unescaped, session ids in the path (`;jsessionid=…`) removed, the trailing slash
       removed (the root stays `/`);
    6. the query: tracking and session parameters removed (`utm_*`, `pk_*`, `mtm_*`, `hsa_*` and `TRACKING_PARAMS`:
       gclid, fbclid, …), the others sorted by name (their order does not change the page), an empty query removed;
    7. the fragment (`#…`) is removed.
    """
    if not url or not isinstance(url, str):
        return None
    url, _ = unwrap_replay(url)
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    host = _host(parts.hostname)
    if port is not None and port != DEFAULT_PORTS[scheme]:
        host = f"{host}:{port}"
    path = _percent_case(quote(_SESSION_IN_PATH.sub("", parts.path), safe=_PATH_SAFE))
    path = posixpath.normpath(re.sub(r"/{2,}", "/", "/" + path))  # also drops the trailing slash
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k.lower() not in TRACKING_PARAMS and not k.lower().startswith(TRACKING_PREFIXES)]
    query_str = urlencode(sorted(query), doseq=True)
    return host + path + (f"?{query_str}" if query_str else "")


_DIGITS = re.compile(r"^[0-9]{4,14}$")
_LATEST = 253402300800  # 10000-01-01 in UTC seconds: datetime's range, well inside int64


def parse_capture_time(value) -> int | None:
    """A capture's time as UTC seconds: ISO 8601 (`2019-05-01T12:00:00Z`, with an offset, or a date alone), an
    archive's 4- to 14-digit timestamp (`20190501120000`, `2019`), or epoch seconds (milliseconds above 10^11).
    None when it cannot be read: such a capture loses to any dated capture of the same page."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):  # NaN (a missing value in a float column), infinities, years past 9999: None
        if isinstance(value, int) and abs(value) >= _LATEST * 1000:  # also past what a float holds (10**400)
            return None
        seconds = value / 1000 if value > 1e11 else value
        return int(seconds) if math.isfinite(seconds) and abs(seconds) < _LATEST else None
    text = str(value).strip()
    if _DIGITS.match(text) and len(text) in (4, 6, 8, 10, 12, 14):
        padded = text + "0101000000"[len(text) - 4:] if len(text) < 14 else text
        try:
            return int(datetime.strptime(padded, "%Y%m%d%H%M%S").replace(tzinfo=timezone.utc).timestamp())
        except ValueError:
            return None
    if text.isascii() and text.isdigit():  # str.isdigit() also takes "²", which int() refuses
        return parse_capture_time(int(text)) if len(text) < 20 else None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    try:
        return int(parsed.timestamp())
    except (OverflowError, ValueError):  # an offset that moves year 1 or 9999 out of datetime's range
        return None


class CaptureKeys(DocumentStep):
    """Adds `url_key` and `captured_at` from every document's metadata (null where there is no URL or date).
    `fields`: source name -> (url field, date field) of its metadata."""

    def __init__(self, fields: dict[str, tuple[str, str]]):
        self.fields = fields

    def __call__(self, batch: pa.Table) -> pa.Table:
        keys, times = [], []
        for source, meta in zip(batch["source"].to_pylist(), batch["metadata"].to_pylist()):
            url_field, date_field = self.fields.get(source, ("url", "date"))
            fields = json.loads(meta) if meta else {}
            url = fields.get(url_field)
            url, replay_time = unwrap_replay(url) if isinstance(url, str) else (None, None)
            keys.append(normalize_url(url))
            times.append(parse_capture_time(fields.get(date_field) or replay_time))
        return batch.append_column("url_key", pa.array(keys, pa.string())).append_column(
            "captured_at", pa.array(times, pa.int64()))


def capture_keys(batch: pa.Table) -> pa.Table:
    """Documents (with `_row`) -> the key rows of capture selection: the live documents that have a URL."""
    live = pc.and_(pc.is_valid(batch["url_key"]), pc.is_null(batch["drop_reason"]))
    return batch.filter(live).select(["url_key", "captured_at", "id", "drop_reason", ROW])


def capture_decisions(order: str):
    """Key rows of one part (`capture_keys`) -> `_row` and `drop_reason` of every capture that is not kept."""
    select = latest_capture(order)

    def decide(group: pa.Table) -> pa.Table:
        marked = select(group)
        return marked.filter(pc.is_valid(marked["drop_reason"])).select([ROW, "drop_reason"])
    return decide


def latest_capture(order: str):
    """Rows of one part -> the same rows, every capture but the chosen one of each `url_key` marked dropped
    (`capture:older` when the latest is kept, `capture:newer` when the earliest is). Undated captures lose to
    dated ones; equal times go to the smallest id. Rows without a URL or already dropped take no part."""
    reason = "capture:older" if order == "latest" else "capture:newer"

    def select(group: pa.Table) -> pa.Table:
        live = pc.and_(pc.is_valid(group["url_key"]), pc.is_null(group["drop_reason"]))
        rows = pc.indices_nonzero(live)
        if len(rows) < 2:
            return group
        cand = group.take(rows).append_column("row", rows)
        ordered = cand.sort_by([("url_key", "ascending"),
                                ("captured_at", "descending" if order == "latest" else "ascending"),
                                ("id", "ascending")], null_placement="at_end")
        keys = ordered["url_key"].to_pylist()
        losers = [row for row, key, prev in zip(ordered["row"].to_pylist(), keys, [None, *keys[:-1]]) if key == prev]
        if not losers:
            return group
        reasons = group["drop_reason"].to_pylist()
        for row in losers:
            reasons[row] = reason
        return group.set_column(group.schema.get_field_index("drop_reason"), "drop_reason",
                                pa.array(reasons, pa.string()))

    return select
