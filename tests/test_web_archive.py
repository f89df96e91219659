"""Web-archive curation: URL normalisation, one capture per page, the best copy of duplicates, decontamination
against benchmark items, the trained quality classifier; and a web archive made of real HTML through the data stage
of a curation-only recipe."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from amalia_ray.core.config import DataConfig, Recipe, SourceConfig
from amalia_ray.core.ngrams import ItemIndex, words
from amalia_ray.data.web.captures import CaptureKeys, latest_capture, normalize_url, parse_capture_time
from amalia_ray.data.steps.decontaminate import Decontaminate
from amalia_ray.data.steps.quality import heuristic_score
from amalia_ray.data.steps.quality_model import QualityModel, QualityModelScore, train_quality_model
from amalia_ray.data.read.readers import read_file
from amalia_ray.data.dedup.keep import best_of_cluster, exact_copies
from tests import web_archive

REFERENCE_TXT = Path("/usr/share/debian-reference/debian-reference.pt.txt.gz")
FAQ_TXT = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")


@pytest.mark.parametrize("url, key", [
    ("HTTP://WWW.Example.PT:80/a/./b/../c/?utm_source=x&b=2&a=1#frag", "example.pt/a/c?a=1&b=2"),
    ("https://example.pt/a/c/?a=1&b=2&fbclid=zz", "example.pt/a/c?a=1&b=2"),
    ("http://example.pt", "example.pt/"),
    ("https://arquivo.pt/wayback/20190101120000/http://www.publico.pt/x/", "publico.pt/x"),
    ("http://x.pt/a%7eb/%c3%a7", "x.pt/a~b/%C3%A7"),
    ("http://x.pt/a~b/ç", "x.pt/a~b/%C3%A7"),
    ("http://x.pt:8080//a;jsessionid=12?sid=4", "x.pt:8080/a"),
    ("http://user:pw@ação.pt/", "xn--ao-siap.pt/"),
    ("ftp://x.pt/", None),
    ("not a url", None),
    (None, None),
])
def test_url_normalisation_rules(url, key):
    assert normalize_url(url) == key


@pytest.mark.parametrize("value, expected", [
    ("2019-05-01T12:00:00Z", 1556712000), ("2019-05-01T13:00:00+01:00", 1556712000), ("20190501120000", 1556712000),
    ("2019-05-01", 1556668800), (1556712000, 1556712000), (1556712000000, 1556712000), ("garbage", None), (None, None),
    # a missing value of a float column, infinities, "²" (a digit to str.isdigit), values past int64 or year 9999
    (float("nan"), None), (float("inf"), None), ("²", None), (10 ** 30, None), ("1" * 25, None), (10 ** 400, None),
    (-10 ** 400, None),
])
def test_capture_dates(value, expected):
    assert parse_capture_time(value) == expected


def _docs(rows: list[dict]) -> pa.Table:
    cols = ["id", "source", "text", "metadata", "drop_reason"]
    return pa.table({c: [r.get(c) for r in rows] for c in cols},
                    schema=pa.schema([(c, pa.string()) for c in cols]))


def test_latest_capture_per_page_from_jsonl_fields(tmp_path):
    """jsonl with the source's own URL and date fields: one document per normalised URL, the latest kept; undated
    captures lose, documents without a URL and documents already dropped are left alone."""
    rows = [
        {"texto": "página A de 2019", "endereco": "http://www.a.pt/p/?utm_source=x", "quando": "20190101000000"},
        {"texto": "página A de 2023", "endereco": "https://a.pt/p", "quando": "2023-01-01T00:00:00Z"},
        {"texto": "página A sem data", "endereco": "https://a.pt/p#x"},
        {"texto": "página B", "endereco": "https://a.pt/b", "quando": "2020"},
        {"texto": "sem endereço"},
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    src = SourceConfig(name="web", paths=["a.jsonl"], format="jsonl", text_field="texto", url_field="endereco",
                       date_field="quando")
    docs = CaptureKeys({"web": ("endereco", "quando")})(read_file(str(tmp_path / "a.jsonl"), src))
    assert docs["url_key"].to_pylist() == ["a.pt/p", "a.pt/p", "a.pt/p", "a.pt/b", None]
    for order, kept_text, reason in (("latest", "página A de 2023", "capture:older"),
                                     ("earliest", "página A de 2019", "capture:newer")):
        out = latest_capture(order)(docs)
        by_text = dict(zip(out["text"].to_pylist(), out["drop_reason"].to_pylist()))
        assert by_text[kept_text] is None and by_text["página B"] is None and by_text["sem endereço"] is None
        assert sorted(r for r in by_text.values() if r) == [reason, reason]


def test_keep_rules_pick_the_known_best_member():
    """Planted clusters whose best member is known under each rule; ties go to the smallest id."""
    rows = _docs([
        {"id": "a", "text": "curto"}, {"id": "b", "text": "o mais longo de todos"}, {"id": "c", "text": "médio texto"},
        {"id": "d", "text": "outro"}, {"id": "e", "text": "outro!"},
    ])
    rows = (rows.append_column("cluster_id", pa.array(["a", "a", "a", "d", "d"]))
            .append_column("quality_score", pa.array([0.2, 0.1, 0.9, None, 0.5]))
            .append_column("captured_at", pa.array([3, 1, 2, 5, 5], pa.int64())))
    expected = {"smallest_id": {"a": "a", "d": "d"}, "longest": {"a": "b", "d": "e"},
                "quality": {"a": "c", "d": "e"}, "latest": {"a": "a", "d": "d"}}
    for keep, best in expected.items():
        out = best_of_cluster(keep)(rows)
        assert dict(zip(out["id"].to_pylist(), out["cluster_id"].to_pylist())) == {
            m: best[c] for m, c in zip("abcde", "aaadd")}, keep
    exact = (rows.drop_columns(["cluster_id"]).append_column("content_hash", pa.array(["h"] * 5))
             .append_column("_row", pa.array(range(5), pa.int64())))

    def kept(keep):
        decided = exact_copies(keep)(exact)
        assert decided["duplicates"].to_pylist() == [5] * 5
        return ["abcde"[r] for r, copy in zip(decided["_row"].to_pylist(), decided["is_copy"].to_pylist()) if not copy]

    assert kept("quality") == ["c"] and kept("latest") == ["d"]  # captured 5, d < e
    assert kept("longest") == ["b"] and kept("smallest_id") == ["a"]


def test_site_boilerplate_lines_are_removed_from_that_site_only():
    from amalia_ray.data.web.boilerplate import StripBoilerplate, _line_hashes

    notice = "Este sítio utiliza cookies."
    lines = np.sort(_line_hashes("a.pt", [notice]))
    batch = _docs([{"id": "1", "text": f"Texto da página.\n{notice}\nMais texto."},
                   {"id": "2", "text": f"Outro sítio.\n{notice}"}, {"id": "3", "text": notice}])
    batch = batch.append_column("url_key", pa.array(["a.pt/x", "b.pt/y", None]))
    out = StripBoilerplate(lines)(batch)["text"].to_pylist()
    assert out == ["Texto da página.\nMais texto.", f"Outro sítio.\n{notice}", notice]


def test_boilerplate_lines_are_searched_not_rescanned_for_every_page(monkeypatch):
    """The boilerplate keys grow with the number of sites; each page looks its lines up in them by binary search.
    np.isin would sort every key again for every page: the stage would grow as pages × sites."""
    from amalia_ray.data.web.boilerplate import StripBoilerplate, _line_hashes

    notice = "Todos os direitos reservados."
    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.integers(0, 2**63, 50_000, dtype=np.uint64), _line_hashes("a.pt", [notice])])
    strip = StripBoilerplate(keys)  # given unsorted: sorted once here

    def refused(*args, **kwargs):
        raise AssertionError("np.isin sorts every boilerplate key again for each page")

    monkeypatch.setattr(np, "isin", refused)
    batch = _docs([{"id": "1", "text": f"Primeira linha.\n{notice}"}, {"id": "2", "text": f"{notice}\nFim."}])
    batch = batch.append_column("url_key", pa.array(["a.pt/x", "b.pt/y"]))
    assert strip(batch)["text"].to_pylist() == ["Primeira linha.", f"{notice}\nFim."]


def _near_duplicates(a: str, b: str) -> bool:
    """The two texts share an LSH band and their Jaccard, as the stage measures it by default (estimated from the
    signatures), is over 0.8: a planted cluster the stage will find (LSH finds a pair at Jaccard 0.86 with
    probability 0.994, not 1)."""
    from amalia_ray.core.config import NearDedupConfig
    from amalia_ray.data.dedup.minhash import BandKeys, MinHashParams, SignatureSets, pair_jaccard

    cfg = NearDedupConfig()
    params = MinHashParams(ngram=cfg.ngram, num_perm=cfg.num_perm, bands=cfg.bands, seed=cfg.seed)
    pair = pa.table({"id": ["a", "b"], "text": [a.replace(web_archive.COOKIES, ""), b.replace(web_archive.COOKIES, "")]})
    keys = BandKeys(params)(pair)
    values = SignatureSets(params)(pair)["values"].combine_chunks()
    return (any(keys[f"key_{i}"][0] == keys[f"key_{i}"][1] for i in range(cfg.bands))
            and pair_jaccard(values[0:1], values[1:2], cfg.similarity)[0] >= cfg.threshold)


def _clearly_portuguese(texts: list[str]) -> list[bool]:
    from amalia_ray.core.config import LanguageConfig
    from amalia_ray.data.steps.language import LanguageID

    out = LanguageID(LanguageConfig(keep=["pt"], min_score=0.5))(_docs([{"id": str(i), "text": t}
                                                                        for i, t in enumerate(texts)]))
    return [lang == "pt" and score >= 0.8 for lang, score in zip(out["language"].to_pylist(),
                                                                 out["language_score"].to_pylist())]


def _paragraphs(path: Path, n: int, min_words: int = 40) -> list[str]:
    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    return [p.strip() for p in text.split("\n\n") if len(p.split()) >= min_words][:n]


def test_decontamination_finds_planted_items_inside_real_text():
    docs = _paragraphs(REFERENCE_TXT, 60)
    long_sentence = next(s for s in docs[10].split(". ") if len(s.split()) >= 15)
    items = {"exam": [("q1", f"Considere: «{long_sentence}» Porquê?"),
                      ("q2", "Uma pergunta que não está em parte nenhuma do manual de referência, com muitas palavras "
                             "inventadas para este teste apenas"),
                      ("q3", "curta demais")],
             "cloze": [("c1", " ".join(words(docs[20])[:10]))]}  # shorter than 13 words: matched whole
    index = ItemIndex.build(items, 13, 8)
    assert index.too_short == {"exam": 1, "cloze": 0}
    batch = _docs([{"id": str(i), "text": t} for i, t in enumerate(docs)])
    out = Decontaminate(index, 1, "drop")(batch)
    found = {i: c for i, c in zip(out["id"].to_pylist(), out["contamination"].to_pylist()) if c}
    assert found["10"] == ["exam/q1"] and found["20"] == ["cloze/c1"]
    assert all(c in (["exam/q1"], ["cloze/c1"]) for c in found.values())
    reasons = dict(zip(out["id"].to_pylist(), out["drop_reason"].to_pylist()))
    assert reasons["10"] == "contamination:exam" and reasons["20"] == "contamination:cloze" and reasons["0"] is None
    flagged = Decontaminate(index, 1, "flag")(batch)
    assert flagged["drop_reason"].null_count == len(docs) and flagged["contamination"].to_pylist()[10] == ["exam/q1"]
    assert Decontaminate(index, 50, "drop")(batch)["contamination"].null_count == len(docs)  # min_overlap


def _package_boilerplate(n: int) -> list[str]:
    """Blocks of the packages' changelogs and licence files: the terse, list-like, machine-made text that raw web
    crawls are full of (and in English: the manuals are the Portuguese side)."""
    blocks = []
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz"))[:300]:
        blocks += gzip.decompress(path.read_bytes()).decode("utf-8", "replace").split("\n\n")
    for path in sorted(Path("/usr/share/doc").glob("*/copyright"))[:300]:
        blocks += path.read_text(errors="replace").split("\n\n")
    blocks = [b.strip() for b in blocks if len(b.split()) >= 40]
    return blocks[::max(1, len(blocks) // n)][:n]


def test_the_quality_models_documents_are_sampled_by_id_hash_as_they_are_read(tmp_path):
    """At most max_docs documents, those of the smallest id hashes (the same every run), kept while the files are
    read (a raw crawl as negatives is not held whole); blank ones do not count."""
    import pyarrow.compute as pc

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read.readers import read_file_tables
    from amalia_ray.data.steps.base import unit_hash
    from amalia_ray.data.steps.quality_model import read_texts

    texts = [f"Documento número {i} sobre a história de Portugal." for i in range(60)] + ["   "] * 5
    path = str(tmp_path / "d.jsonl")
    Path(path).write_text("\n".join(json.dumps({"id": f"d{i}", "text": t}, ensure_ascii=False)
                                    for i, t in enumerate(texts)))
    src = SourceConfig(name="negative", paths=[path], format="jsonl", text_field="text", split="paragraph")
    read = [(i, t) for table in read_file_tables(path, src) if (ok := table.filter(pc.is_null(table["drop_reason"])))
            for i, t in zip(ok["id"].to_pylist(), ok["text"].to_pylist()) if t.strip()]
    smallest = sorted(sorted(read, key=lambda d: unit_hash(d[0]))[:10])
    assert read_texts([path], "negative", "text", max_docs=10) == [t for _, t in smallest]
    assert len(read_texts([path], "negative", "text", max_docs=100)) == 60


def test_quality_classifier_trains_scores_and_loads_safely(tmp_path):
    """DCLM's recipe on real text: positives are the manuals' paragraphs, negatives the packages' changelog and
    licence blocks; held-out precision and recall, then scoring documents it never saw."""
    reference = _paragraphs(REFERENCE_TXT, 400)
    pos = reference[0::2] + _paragraphs(FAQ_TXT, 200)
    neg = _package_boilerplate(700)
    assert len(neg) > 300
    (tmp_path / "pos.jsonl").write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in pos))
    (tmp_path / "neg.jsonl").write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in neg[0::2]))
    meta = train_quality_model(tmp_path / "model", [str(tmp_path / "pos.jsonl")], [str(tmp_path / "neg.jsonl")],
                               holdout=0.2)
    m = meta["metrics"]
    assert m["heldout_positive"] > 50 and m["precision"] > 0.9 and m["recall"] > 0.9, m
    model = QualityModel(tmp_path / "model")
    fresh_good, fresh_bad = reference[1::2], neg[1::2]  # (the manual leaves a few paragraphs in English)
    assert (model.score(fresh_good) > 0.5).mean() > 0.85 and (model.score(fresh_bad) < 0.5).mean() > 0.9
    batch = _docs([{"id": "a", "text": fresh_good[0]}, {"id": "b", "text": fresh_bad[0]},
                   {"id": "c", "text": "x", "drop_reason": "min_chars"}])
    out = QualityModelScore(str(tmp_path / "model"), 0.5)(batch)
    assert out["drop_reason"].to_pylist() == [None, "quality_model:below_threshold", "min_chars"]
    assert out["quality_score"].to_pylist()[2] is None
    (tmp_path / "model" / "quality_model.json").write_text(json.dumps({"kind": "pickle"}))
    with pytest.raises(Exception, match="not a quality model of this kind"):
        QualityModel(tmp_path / "model")


def _main_text(html: str) -> str:
    """A page's text as the data stage makes it: main text, cleaned (PII scrubbed, …) and normalised."""
    from amalia_ray.core.config import CleaningConfig
    from amalia_ray.data.steps.cleaning import Clean
    from amalia_ray.data.read.readers import html_main_text
    from amalia_ray.data.steps.cleaning import Normalize

    cleaned = Clean(CleaningConfig())(_docs([{"id": "0", "text": html_main_text(web_archive.page_html(html))}]))
    return Normalize().clean(cleaned["text"][0].as_py())


def _unpunctuated(html: str) -> str:
    return html.replace(".", " ").replace(",", " ")


def test_heuristic_score_ranks_prose_above_its_mangled_copy():
    """Pages of running prose (sentences ending in full stops) score higher than their copies without
    punctuation."""
    pages = [s for _, s in web_archive.section_pages(3) if _main_text(s).count(". ") >= 5][:8]
    assert len(pages) >= 4
    pairs = [(heuristic_score(_main_text(s), "pt"), heuristic_score(_main_text(_unpunctuated(s)), "pt"))
             for s in pages]
    assert all(1 >= a > b >= 0 for a, b in pairs), pairs
    assert heuristic_score("", "pt") == 0


def test_curation_recipe_is_valid_and_quality_keep_needs_a_score():
    r = Recipe.model_validate({"data": {"sources": [{"name": "a", "paths": ["x"]}]}})
    assert r.train == [] and r.data_stages == ["data"] and r.tokenizer is None
    r = Recipe.model_validate({"data": {"sources": [{"name": "a", "paths": ["x"]}]}, "pack": {"seq_len": 64}})
    assert r.data_stages == ["data", "tokenizer", "pack"]
    with pytest.raises(ValueError, match="quality needs a quality score"):
        DataConfig.model_validate({"sources": [{"name": "a", "paths": ["x"]}], "near_dedup": {"keep": "quality"}})
    with pytest.raises(ValueError, match="nothing to evaluate"):
        Recipe.model_validate({"data": {"sources": [{"name": "a", "paths": ["x"]}]},
                               "eval": {"tasks": [{"name": "t", "path": "t.jsonl"}]}})


@pytest.mark.e2e
def test_web_archive_through_a_curation_recipe(ray_cluster, tmp_path, keys_only_shuffles,
                                               documents_stay_staged):
    """Three WARC files of dated captures of real pages (debian-reference-pt's HTML in a site's boilerplate), a
    mirror that copies some pages with their punctuation stripped, and exam items quoting some pages: a recipe
    with only a data section curates them (the pipeline `amalia run` drives). The latest capture of each page is
    kept, the menu and footer are gone (main-text extraction) and so is the cookie notice every page repeats (site
    boilerplate), language and variety are tagged, the mirror's worse copies lose to the originals
    (near_dedup.keep: quality) although their ids sort first, and the quoted pages are dropped as contaminated."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.data.read.readers import html_main_text
    from amalia_ray.pipeline.runner import Pipeline

    pages = web_archive.section_pages(3)
    archive = web_archive.build_archive(tmp_path / "arquivo", pages)
    # mirrored and quoted pages are clearly Portuguese ones (the manual leaves some sections in English, which
    # language ID drops before deduplication and decontamination see them)
    clearly_pt = _clearly_portuguese([_main_text(s).replace(web_archive.COOKIES, "") for _, s in pages])
    mirror = [(p, _unpunctuated(s)) for (p, s), pt in zip(pages, clearly_pt)
              if pt and _main_text(s).count(". ") >= 5 and _near_duplicates(_main_text(s), _main_text(_unpunctuated(s)))
              ][:5]  # 5 pages: its cookie notice is its boilerplate too (site_boilerplate.min_pages)
    assert len(mirror) == 5
    (tmp_path / "espelho").mkdir()
    (tmp_path / "espelho" / "a.warc.gz").write_bytes(gzip.compress(b"".join(
        web_archive.warc_record(f"http://espelho.example.pt{p}", "2024-01-01T00:00:00Z", web_archive.page_html(s))
        for p, s in mirror)))
    quoted = [i for i, (p, _) in enumerate(pages) if p not in dict(mirror) and clearly_pt[i]][3:5]
    sentences_in = [next(s for s in html_main_text(web_archive.page_html(pages[i][1])).split(". ")
                         if len(s.split()) >= 15) for i in quoted]
    sentences_out = [p for p in _paragraphs(FAQ_TXT, 3)]
    # named by its path alone (relative to the recipe): named "exames" after the file, its format told by its fields
    web_archive.write_json(tmp_path / "exames.json", web_archive.exam_items(sentences_in, sentences_out))
    recipe = {
        "run": {"name": "arquivo", "output_dir": str(tmp_path / "runs")},
        "data": {
            "sources": [{"name": "a-espelho", "paths": [str(tmp_path / "espelho" / "*.warc.gz")], "format": "warc"},
                        {"name": "arquivo", "paths": [str(tmp_path / "arquivo" / "*.warc.gz")], "format": "warc"}],
            "min_chars": 200, "language": {"keep": ["pt"], "min_score": 0.5}, "variety": {},
            "quality": {"gopher_quality": {"enabled": False}, "gopher_repetition": {"enabled": False},
                        "fineweb": {"enabled": False}},
            "captures": "latest",
            "near_dedup": {"keep": "quality"},
            "decontaminate": {"tasks": ["exames.json"]},
        },
    }
    path = tmp_path / "arquivo.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    pipeline = Pipeline(load_recipe(path))
    pipeline.run()
    assert set(pipeline.manifest.stages) == {"data"}
    keys = {key for moved in keys_only_shuffles for key in moved}
    assert {"url_key", "content_hash", "cluster_id"} <= keys, "captures, exact copies and keep rules: keys moved"
    rec = pipeline.manifest.stages["data"]
    metrics = rec.metrics
    import pyarrow.parquet as pq

    kept = pq.read_table(pipeline.run_dir / "data" / "kept").to_pylist()
    dropped = pq.read_table(pipeline.run_dir / "data" / "dropped").to_pylist()
    reasons = [d["drop_reason"] for d in dropped]
    # every page's older captures are dropped as such (unless a cheaper filter dropped them first: the 2019
    # capture of a short section can be too short); what is kept of the archive is its 2023 captures
    older = [d for d in dropped if d["source"] == "arquivo" and not json.loads(d["metadata"])["date"].startswith("2023")]
    assert len(older) == 2 * len(pages) and {d["drop_reason"] for d in older} <= {"capture:older", "min_chars"}
    assert reasons.count("capture:older") >= 2 * len(pages) - 4
    originals = [d for d in kept if d["source"] == "arquivo"]
    assert originals and all(json.loads(d["metadata"])["date"].startswith("2023") for d in originals)
    assert {d["url_key"] for d in originals} <= {f"debian.org{p}" for p in archive["paths"]}
    assert not any(b in d["text"] for d in kept for b in web_archive.BOILERPLATE)  # menus, footer, cookie notice
    assert metrics["site_boilerplate_lines"] >= 1
    assert all(d["language"] == "pt" and d["pt_variety"] in ("pt-PT", "pt-BR", "unknown") for d in kept)
    # the mirror's copies: near duplicates of the originals, lower heuristic quality, removed in their favour
    assert not [d for d in kept if d["source"] == "a-espelho"]
    removed = pq.read_table(pipeline.run_dir / "data" / "near_duplicates").to_pylist()
    assert len(removed) == len(mirror) and {r["id"].split("#")[0] for r in removed} == {"a-espelho/a.warc.gz"}
    kept_ids = {d["id"] for d in originals}
    assert all(r["cluster_id"] in kept_ids for r in removed)
    # the pages the exam quotes are dropped; the report counts them per task
    assert reasons.count("contamination:exames") == len(quoted)
    assert metrics["contamination"]["exames"] == {"items": 5, "items_checked": 5, "items_overlapping": 2,
                                                  "documents_overlapping": 2}
    assert len(originals) == len(pages) - len(quoted) - sum(str(r).startswith("language") for r in reasons)


@pytest.mark.e2e
def test_the_data_stage_scores_with_a_trained_model_and_flags_contamination(ray_cluster, tmp_path,
                                                                           keys_only_shuffles,
                                                                           documents_stay_staged):
    """The other settings on the data stage itself: a jsonl export with its own URL and date fields, the earliest
    capture kept, the trained classifier scoring every document on Ray actors (threshold drops the licence text),
    exact copies resolved by `latest`, and contamination flagged instead of dropped."""
    import pyarrow.parquet as pq

    from amalia_ray.data.curate import curate

    reference = _paragraphs(REFERENCE_TXT, 400)
    neg = _package_boilerplate(400)
    (tmp_path / "pos.jsonl").write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in reference[:300]))
    (tmp_path / "neg.jsonl").write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in neg[:300]))
    train_quality_model(tmp_path / "model", [str(tmp_path / "pos.jsonl")], [str(tmp_path / "neg.jsonl")])
    from amalia_ray.data.steps.cleaning import Normalize

    portuguese = [Normalize().clean(p) for p in reference[300:] if " não " in p or " é " in p]
    good, bad, quoted = portuguese[0], neg[350], portuguese[1]
    rows = [
        {"texto": good, "link": "http://a.pt/x?utm_source=y", "quando": "20200101000000"},
        {"texto": good + " Revisto.", "link": "https://www.a.pt/x/", "quando": "2024-01-01"},  # a later capture
        {"texto": bad, "link": "https://a.pt/licenca", "quando": "2021"},
        {"texto": quoted, "link": "https://a.pt/q1", "quando": "2021"},
        {"texto": quoted, "link": "https://a.pt/q2", "quando": "2023"},  # the same text at another URL, later
    ]
    (tmp_path / "web.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    exam = web_archive.write_json(tmp_path / "exam.json", web_archive.exam_items(
        [next(s for s in quoted.split(". ") if len(s.split()) >= 15)], []))
    cfg = DataConfig.model_validate({
        "sources": [{"name": "web", "paths": [str(tmp_path / "web.jsonl")], "format": "jsonl", "text_field": "texto",
                     "url_field": "link", "date_field": "quando"}],
        "min_chars": 100, "captures": "earliest", "quality_model": str(tmp_path / "model"), "quality_threshold": 0.5,
        "dedup_keep": "latest", "decontaminate": {"tasks": [{"name": "exam", "path": str(exam), "format": "pheb"}],
                                                  "action": "flag"}})
    from amalia_ray.evals.tasks import item_text, load_task

    items = {"exam": [(it.id, item_text(it)) for it in load_task(exam, "pheb")]}
    metrics = curate(cfg, lambda p: Path(p), tmp_path / "out", items)
    kept = {d["text"][:40]: d for d in pq.read_table(tmp_path / "out" / "kept").to_pylist()}
    dropped = pq.read_table(tmp_path / "out" / "dropped").to_pylist()
    assert sorted(d["drop_reason"] for d in dropped) == ["capture:newer", "quality_model:below_threshold"]
    page = kept[good[:40]]
    assert page["text"] == good and page["url_key"] == "a.pt/x" and page["quality_score"] > 0.5
    copy = kept[quoted[:40]]  # exact copies: the latest capture stays, flagged with the item it quotes
    assert copy["url_key"] == "a.pt/q2" and copy["duplicates"] == 2 and copy["contamination"] == ["exam/2023 1.ª Fase Informática I 1"]
    assert metrics["contamination"]["exam"] == {"items": 1, "items_checked": 1, "items_overlapping": 1,
                                                "documents_overlapping": 2}
