"""Site boilerplate: lines that a site repeats on many of its pages (cookie notices, "all rights reserved", a
newsletter box) which main-content extraction leaves in. A line is boilerplate for a site when it appears on at least
`min_pages` of the site's pages and on at least `min_share` of them; it is removed from every page of that site.
Counted over the documents that have a URL (`url_key`, site = its host), after capture selection, in two passes that
scale with the number of distinct lines, not with the size of a site: one keyed shuffle counts each (site, line) once
per page, and the set of boilerplate lines (64-bit hashes) is then sent to every task that cleans the pages."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import ray
from ray.data.expressions import col

from amalia_ray.data.exchange.frames import to_arrow
from amalia_ray.data.exchange.partitions import exchange, map_blocks
from amalia_ray.data.exchange.staged import Staged
from amalia_ray.data.steps.base import DocumentStep, already_dropped, map_text

LINE_KEYS = pa.schema([("site", pa.string()), ("key", pa.uint64())])
SITE_PAGES = pa.schema([("site", pa.string()), ("len", pa.uint32())])


def _site_hashes(sites: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return pl.Series(sites).cast(pl.String).hash(seed=11).to_numpy()


def site_of(url_key: str) -> str:
    return url_key.split("/", 1)[0]


def _line_hashes(site: str, lines: list[str]) -> np.ndarray:
    """A stable 64-bit hash of each (site, stripped line)."""
    if not lines:
        return np.empty(0, np.uint64)
    return pl.Series([f"{site}\n{line.strip()}" for line in lines], dtype=pl.String).hash(seed=7).to_numpy()


def _page_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def boilerplate_lines(docs: Staged, min_pages: int, min_share: float) -> np.ndarray:
    """The sorted hashes of every (site, line) that is boilerplate, from the live documents with a URL (staged
    documents: each task reads the URL, text and drop reason of its file)."""
    pages = docs.select(["url_key", "text", "drop_reason"])
    def emit(batch: pa.Table) -> pa.Table:
        sites, keys = [], []
        for url_key, text, dropped in zip(batch["url_key"].to_pylist(), batch["text"].to_pylist(),
                                          already_dropped(batch)):
            if url_key is None or dropped:
                continue
            site = site_of(url_key)
            hashed = np.unique(_line_hashes(site, _page_lines(text)))
            sites += [site] * len(hashed)
            keys.append(hashed)
        keys_arr = pa.array(np.concatenate(keys) if keys else np.empty(0, np.uint64), pa.uint64())
        return pa.table({"site": pa.array(sites, pa.string()), "key": keys_arr})

    live = docs.select(["url_key", "drop_reason"]).dataset().filter(
        expr=col("drop_reason").is_null() & col("url_key").is_not_null())
    # pages per site, counted by a keyed exchange on the site: only the sites with min_pages pages or more (the
    # only ones a line can be boilerplate of: a page counts each of its lines once) reach the driver, as two
    # sorted arrays the line counts look their site up in (a web archive has millions of sites, most with a page
    # or two: a dict of all of them would sit on the driver and be unpickled by every task of the next exchange)
    def big_sites(group: pa.Table) -> pa.Table:
        pages = pl.from_arrow(group.select(["site"])).group_by("site").len()
        return to_arrow(pages.filter(pages["len"] >= min_pages), SITE_PAGES)

    sites = [t for t in ray.get(exchange(live.map_batches(
        lambda b: pa.table({"site": pa.array([site_of(u) for u in b["url_key"].to_pylist()], pa.string())}),
        batch_format="pyarrow"), "site", big_sites).to_arrow_refs()) if len(t)]
    if not sites:
        return np.empty(0, np.uint64)
    sites = pa.concat_tables(sites)
    hashes = _site_hashes(sites["site"])
    order = np.argsort(hashes)
    site_hash, site_pages = hashes[order], sites["len"].to_numpy()[order].astype(np.float64)

    def repeated(group: pa.Table) -> pa.Table:
        counts = pl.from_arrow(group.select(["site", "key"])).group_by("site", "key").len()
        wanted = _site_hashes(counts["site"].to_arrow())
        at = np.minimum(np.searchsorted(site_hash, wanted), len(site_hash) - 1)
        pages = np.where(site_hash[at] == wanted, site_pages[at], 0.0)
        need = pl.Series(np.maximum(float(min_pages), min_share * pages), dtype=pl.Float64)
        return to_arrow(counts.filter(counts["len"] >= need).select("site", "key"), LINE_KEYS)

    found = exchange(map_blocks(pages, emit), "key", repeated)
    keys = [t["key"].to_numpy() for t in ray.get(found.to_arrow_refs()) if len(t)]
    return np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)


class StripBoilerplate(DocumentStep):
    """Removes a site's boilerplate lines from each of its live pages."""

    def __init__(self, lines: np.ndarray):
        self.lines = np.sort(np.asarray(lines, dtype=np.uint64))  # sorted: searched, not scanned

    def strip(self, text: str, url_key: str | None) -> str:
        if url_key is None or not len(self.lines):
            return text
        lines = text.split("\n")
        hashed = _line_hashes(site_of(url_key), lines)
        # a binary search of the sorted keys per line: O(lines × log keys) a page, where np.isin sorts the keys
        # again for every page (the keys grow with the number of sites, so the stage would grow as pages × sites)
        at = np.minimum(np.searchsorted(self.lines, hashed), len(self.lines) - 1)
        drop = (self.lines[at] == hashed) & np.array([bool(line.strip()) for line in lines])
        return "\n".join(line for line, d in zip(lines, drop) if not d).strip() if drop.any() else text

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_text(batch, self.strip, batch["url_key"].to_pylist())
