"""The data stages: curate the corpus, train the tokenizer, tokenize and pack. Each writes one output folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.expressions import col

from amalia_ray.core.config import DataConfig, NearDedupConfig, PackConfig, TokenizerConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.formats.shards import rows_per_group
from amalia_ray.core.storage import commit_dir, fresh_dir
from amalia_ray.core.ngrams import ItemIndex
from amalia_ray.data.dedup.keep import ExactKeys, best_of_cluster, exact_copies, keep_keys
from amalia_ray.data.dedup.minhash import MinHashParams
from amalia_ray.data.dedup.ray_executor import check_unique_ids, near_duplicate_clusters, with_clusters
from amalia_ray.data.exchange.decide import ROW, decide, set_columns
from amalia_ray.data.exchange.partitions import (LEDGER, configure_data_context, count_by, stage,
                                                 write_ordered_shards, write_shards)
from amalia_ray.data.exchange.staged import Staged
from amalia_ray.data.read.inputs import Listed, ReadLedger, fingerprint_lines, list_sources, read_sources
from amalia_ray.data.steps.decontaminate import contamination_report
from amalia_ray.data.steps.quality import MinLength
from amalia_ray.data.steps.recipe_steps import after_pages, before_pages, run_steps
from amalia_ray.data.tokenize.mix import MixBySource, is_validation
from amalia_ray.data.tokenize.pack import TokenizeAndPack, tokenizer_for_workers
from amalia_ray.data.tokenize.tokenizer import base_tokenizer, train_tokenizer
from amalia_ray.data.web.boilerplate import StripBoilerplate, boilerplate_lines
from amalia_ray.data.web.captures import capture_decisions, capture_keys

def list_corpus(cfg: DataConfig, resolve) -> list[list[Listed]]:
    """Each source's files with their sizes and modification times; a pattern matching nothing is an error."""
    return list_sources(cfg.sources, resolve)


def input_fingerprints(listing: list[list[Listed]]) -> list[str]:
    """A line per corpus file or object: path, size and modification time from its listing (nothing is read before
    the stage runs; the read tasks hash what they read into the stage's input ledger, `inputs.parquet`)."""
    return fingerprint_lines(listing)


def curate(cfg: DataConfig, resolve, out_dir: Path,
           benchmark_items: dict[str, list[tuple[str, str]]] | None = None,
           listing: list[list[Listed]] | None = None) -> dict:
    """Read, clean, filter, keep one capture per page, score, decontaminate, exact- and (optionally) near-dedup the
    corpus into `out_dir/kept`; every dropped document goes to `out_dir/dropped` with its reason, unreadable
    records also to `out_dir/quarantine` with their location, near duplicates to `out_dir/near_duplicates` with
    the id of the document kept for them; `out_dir/inputs.parquet` lists each file or byte range read with its size
    and sha256. `benchmark_items`: task -> [(item id, item text)] for decontamination; `listing`: the corpus as
    `list_corpus` listed it (the files whose fingerprint decided that the stage runs), else listed here."""
    configure_data_context()
    moved = LEDGER.mark()
    tmp = fresh_dir(out_dir)
    scratch = tmp / PASSES  # each pass's documents, read back by the next ones; removed once superseded
    try:
        return _curate(cfg, resolve, tmp, scratch, out_dir, benchmark_items, listing, moved)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _curate(cfg: DataConfig, resolve, tmp: Path, scratch: Path, out_dir: Path,
            benchmark_items: dict[str, list[tuple[str, str]]] | None, listing: list[list[Listed]] | None,
            moved: int) -> dict:
    def done_with(*passes: str) -> None:  # a pass's files once every later step reads a newer one
        for name in passes:
            shutil.rmtree(scratch / name, ignore_errors=True)

    ledger = ReadLedger()
    docs = stage(run_steps(read_sources(cfg.sources, listing or list_corpus(cfg, resolve), ledger),
                           before_pages(cfg)), scratch / "read")
    boilerplate, pages = 0, None
    if any(s.format in URL_FORMATS for s in cfg.sources):  # plain text and HTML files carry no URL
        pages, boilerplate = _web_pages(docs, cfg, scratch)
    index = None
    if cfg.decontaminate:
        d = cfg.decontaminate
        index = ItemIndex.build(benchmark_items or {}, d.ngram, d.min_item_words)
    docs = stage(run_steps(pages if pages is not None else docs.dataset(), after_pages(cfg, resolve, index)),
                 scratch / "scored")
    done_with("read", "captures")
    read = ledger.write(tmp / "inputs.parquet")
    per_filter = count_by(docs, ["source", "drop_reason"])
    n_in = sum(r["count"] for r in per_filter)
    contamination = None
    if index is not None:
        flagged = docs.select(["contamination"]).dataset().filter(expr=col("contamination").is_not_null())
        contamination = contamination_report(  # streamed: the driver holds the counts, not every flagged document
            index, (c for b in flagged.iter_batches(batch_format="pyarrow") for c in b["contamination"].to_pylist()),
            {t: len(items) for t, items in (benchmark_items or {}).items()})
    dropped = docs.dataset().filter(expr=col("drop_reason").is_not_null())
    write_shards(dropped, tmp / "dropped")
    n_quarantined = sum(r["count"] for r in per_filter if str(r["drop_reason"]).startswith("quarantine:"))
    if n_quarantined:
        quarantined = dropped.map_batches(
            lambda b: b.filter(pc.starts_with(b["drop_reason"], "quarantine:")), batch_format="pyarrow")
        write_shards(quarantined.select_columns(["source", "path", "location", "drop_reason", "metadata", "text"]),
                     tmp / "quarantine")
    check_quarantine(per_filter, n_in, cfg.max_quarantine_fraction, tmp / "quarantine")
    n_filtered = sum(r["count"] for r in per_filter if r["drop_reason"] is None)
    if n_filtered == 0:
        reasons: dict[str, int] = {}
        for r in per_filter:
            reasons[r["drop_reason"]] = reasons.get(r["drop_reason"], 0) + r["count"]
        raise AmaliaError(
            f"corpus empty after filtering: 0 of {n_in} documents kept; dropped by "
            + ", ".join(f"{r} ({n})" for r, n in sorted(reasons.items(), key=lambda x: -x[1])[:3])
            + f"; relax those filters (data.min_chars={cfg.min_chars}) or check data.sources"
        )
    kept = stage(docs.dataset().filter(expr=col("drop_reason").is_null()).drop_columns(["drop_reason"]),
                 scratch / "kept")
    done_with("scored")
    if cfg.dedup == "exact":  # decided on content hashes; each block drops its copies
        kept = decide(kept, ExactKeys(cfg.dedup_keep), "content_hash", exact_copies(cfg.dedup_keep), _drop_copies,
                      out=scratch / "exact")
        done_with("kept")
    # ids are <source>/<file>#<location>: a repeat is a bug, and near-dedup would lose documents to it
    check_unique_ids(kept, "data stage documents")
    n_exact = kept.rows
    if cfg.near_dedup:
        kept = _near_dedup(kept, cfg.near_dedup, tmp / "near_duplicates", scratch)
    by_variety = count_by(kept, ["pt_variety"]) if cfg.variety else None
    n_kept = kept.rows
    write_ordered_shards(kept, tmp / "kept")
    shutil.rmtree(scratch, ignore_errors=True)
    commit_dir(tmp, out_dir)
    rows = [
        {"source": r["source"], "reason": r["drop_reason"] if isinstance(r["drop_reason"], str) else "kept",
         "documents": r["count"]}
        for r in per_filter
    ]
    return {
        **read,
        "documents_in": n_in,
        "quarantined": n_quarantined,
        "documents_after_filters": n_filtered,
        "exact_duplicates_removed": n_filtered - n_exact,
        "near_duplicates_removed": n_exact - n_kept,
        "documents_kept": n_kept,
        "per_filter": rows,
        **({"kept_by_variety": {r["pt_variety"]: r["count"] for r in by_variety}}
           if by_variety is not None else {}),
        **({"contamination": contamination} if contamination is not None else {}),
        **({"site_boilerplate_lines": boilerplate} if boilerplate else {}),
        "shuffled": LEDGER.since(moved),
    }


# the scratch folder, inside the stage's temporary output, where each pass stages its documents for the next
PASSES = "passes.tmp"

# the source formats whose documents can carry a URL and capture date (WARC headers, jsonl/Parquet fields)
URL_FORMATS = ("warc", "jsonl", "parquet")


def _web_pages(docs: Staged, cfg: DataConfig, scratch: Path) -> tuple[ray.data.Dataset | None, int]:
    """The documents with one capture per page (after the cheap filters, so an empty or error page captured last
    does not hide the page's content), then each site's boilerplate lines removed from its pages; documents without
    a URL take no part. Returns the documents (None: nothing to do, read `docs` as they are) and the number of
    boilerplate lines found."""
    with_url = docs.select(["url_key"]).dataset().filter(expr=col("url_key").is_not_null())
    if (cfg.captures == "all" and not cfg.site_boilerplate) or not with_url.count():
        return None, 0
    if cfg.captures != "all":
        docs = decide(docs, capture_keys, "url_key", capture_decisions(cfg.captures), set_columns,
                      out=scratch / "captures")
    pages, found = docs.dataset(), 0
    if cfg.site_boilerplate:
        lines = boilerplate_lines(docs, cfg.site_boilerplate.min_pages, cfg.site_boilerplate.min_share)
        found = len(lines)
        pages = (pages.map_batches(StripBoilerplate(lines), batch_format="pyarrow")
                 .map_batches(MinLength(cfg.min_chars), batch_format="pyarrow"))
    return pages, found


def check_quarantine(per_filter: list[dict], n_in: int, limit: float, where: Path) -> None:
    """Fail when more than `limit` of the records read could not be read as documents, with the counts per reason
    and source: a run on mostly broken input would train on what little is left without anyone noticing."""
    bad = [r for r in per_filter if isinstance(r["drop_reason"], str) and r["drop_reason"].startswith("quarantine:")]
    n_bad = sum(r["count"] for r in bad)
    if n_in and n_bad / n_in > limit:
        reasons = sorted(bad, key=lambda r: -r["count"])
        raise AmaliaError(
            f"{n_bad} of {n_in} records ({n_bad / n_in:.0%}) could not be read, over data.max_quarantine_fraction="
            f"{limit}: " + ", ".join(f"{r['drop_reason'].removeprefix('quarantine:')} in {r['source']} "
                                     f"({r['count']})" for r in reasons[:5])
            + f"; the records are in {where}")


def _near_dedup(kept: Staged, cfg: NearDedupConfig, removed_dir: Path, scratch: Path) -> Staged:
    """MinHash-LSH near-dedup of the kept documents: the member of each cluster that `cfg.keep` picks stays, with
    `cluster_size` for rehydration; the others are written to `removed_dir` with the id of the document kept for
    them (`cluster_id`)."""
    params = MinHashParams(ngram=cfg.ngram, num_perm=cfg.num_perm, bands=cfg.bands, seed=cfg.seed)
    clusters, _ = near_duplicate_clusters(kept, params, cfg.threshold or None, similarity=cfg.similarity)
    joined = with_clusters(kept, clusters.materialize(), out=scratch / "clusters")
    if cfg.keep != "smallest_id":  # clusters are labelled by their smallest id; another member may be the best
        def cluster_keys(batch: pa.Table) -> pa.Table:
            return keep_keys(batch.filter(pc.greater(batch["cluster_size"], 1)), ["cluster_id", "id", ROW], cfg.keep)

        def best(group: pa.Table) -> pa.Table:
            return best_of_cluster(cfg.keep)(group).select([ROW, "cluster_id"])

        joined = decide(joined, cluster_keys, "cluster_id", best, set_columns, out=scratch / "keep")
    stays = stage(joined.dataset().filter(expr=col("id") == col("cluster_id")).drop_columns(["cluster_id"]),
                  scratch / "near")
    if stays.rows < joined.rows:
        removed = joined.dataset().filter(expr=col("id") != col("cluster_id"))
        write_shards(removed.select_columns(["id", "source", "cluster_id", "cluster_size", "text"]), removed_dir)
    for name in ("kept", "exact", "clusters", "keep"):  # what the documents that stay were made from
        shutil.rmtree(scratch / name, ignore_errors=True)
    return stays


def _drop_copies(block: pa.Table, decisions: pa.Table | None) -> pa.Table:
    """A block with `duplicates` (1 for a text found once), less every copy that another one stands for."""
    block = set_columns(block, decisions, {"duplicates": pa.scalar(1, pa.int64()), "is_copy": pa.scalar(False)})
    return block.filter(pc.invert(block["is_copy"])).drop_columns(["is_copy"])


def build_tokenizer(corpus_dir: Path, out_dir: Path, cfg: TokenizerConfig, base_model_dir: Path | None = None,
                    trust_remote_code: bool = False) -> dict:
    """Trains (or, with a base model, copies and optionally extends its tokenizer) on the curated corpus's kept
    documents, as a Ray task so the work lands on the cluster, not the submitting machine."""
    tmp = fresh_dir(out_dir)
    kept = corpus_dir / "kept"
    if base_model_dir is not None:
        task = ray.remote(num_cpus=1)(base_tokenizer).remote(base_model_dir, tmp, cfg, trust_remote_code, kept)
    else:
        task = ray.remote(num_cpus=1)(train_tokenizer).remote(kept, tmp, cfg)
    stats = ray.get(task)
    commit_dir(tmp, out_dir)
    return stats


def pack(corpus_dir: Path, tokenizer_dir: Path, out_dir: Path, cfg: PackConfig, weights: dict[str, float],
         seed: int, num_actors: int | None = None) -> dict:
    """Split documents into train/validation by id, mix the training documents by source weight, tokenize and pack
    each split into `seq_len` sequences. Streamed: each split reads the corpus as it goes (nothing of it is held in
    the object store) and its packed rows are staged to Parquet as they come, then written as ordered shards, so
    memory does not grow with the corpus. `num_actors`: tokenizing actors at most (default: one per cluster CPU)."""
    configure_data_context()
    tmp = fresh_dir(out_dir)
    scratch = tmp / PASSES
    actors = num_actors or max(1, int(ray.cluster_resources().get("CPU", 1)))
    stats = {"seq_len": cfg.seq_len, "source_weights": weights}
    tokenizer = tokenizer_for_workers(str(tokenizer_dir))
    try:
        for split in ("train", "validation"):
            part = ray.data.read_parquet(str(corpus_dir / "kept")).select_columns(["id", "source", "text"]).map_batches(
                _mark_split(cfg.validation_fraction), batch_format="pyarrow").filter(expr=col("split") == split)
            if split == "train" and any(w != 1.0 for w in weights.values()):
                part = part.map_batches(MixBySource(weights, seed), batch_format="pyarrow")
            packed = stage(part.map_batches(
                TokenizeAndPack,
                fn_constructor_args=(tokenizer, cfg.seq_len),
                batch_size=512,
                batch_format="pyarrow",
                compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
            ), scratch / split)
            stats[f"{split}_sequences"] = write_ordered_shards(packed, tmp / split,
                                                              rows_per_group=rows_per_group(cfg.seq_len)) \
                if packed.files else 0
            shutil.rmtree(scratch / split, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not stats.get("train_sequences"):
        raise AmaliaError(
            f"corpus too small to pack: no training sequence of pack.seq_len={cfg.seq_len} tokens; "
            "add text or lower pack.seq_len"
        )
    stats["train_tokens"] = stats["train_sequences"] * cfg.seq_len
    stats["tokens_packed"] = (stats["train_sequences"] + stats.get("validation_sequences", 0)) * cfg.seq_len
    commit_dir(tmp, out_dir)
    return stats


def _mark_split(fraction: float):
    def mark(batch: pa.Table) -> pa.Table:
        split = ["validation" if is_validation(i, fraction) else "train" for i in batch["id"].to_pylist()]
        return batch.append_column("split", pa.array(split, pa.string()))

    return mark
