"""The data stage's structure at web-archive scale, asserted on plans and small runs (time and memory growth are
bench/data_scaling.py's): shuffles sized by the bytes they move, not by the cluster's CPUs; report counts without a
shuffle; duplicate graphs of any diameter; ids checked without sorting the documents."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pyarrow as pa
import pytest

from amalia_ray.data.exchange.partitions import PIECE_BYTES, plan_exchange

GB = 1 << 30


def test_a_small_exchange_on_a_large_cluster_cuts_few_pieces():
    """50 MB of LSH band rows in 400 blocks on a 20 × 32-core cluster: one map task and a few parts (a shuffle of a
    task per block and two parts per CPU cut 400 × 1,281 pieces of ~100 bytes, all held by the driver)."""
    plan = plan_exchange([125_000] * 400, cpus=640)
    assert len(plan.map_groups) == 1 and sorted(i for g in plan.map_groups for i in g) == list(range(400))
    assert plan.parts <= 8 and plan.objects <= 20


@pytest.mark.parametrize("total", [10 * GB, 100 * GB, 1024 * GB])
def test_pieces_stay_over_a_megabyte_and_objects_grow_with_bytes_not_blocks(total):
    """At scale every piece is >= 1 MB (over Ray's 100 KB inline limit: kept in the object store, not the driver's
    memory), and the objects an exchange creates are about bytes / 1 MB however the input is blocked."""
    for block in (128 << 20, 8 << 20):  # Ray Data's block target, and blocks 16 times smaller
        plan = plan_exchange([block] * (total // block), cpus=640)
        assert total / (len(plan.map_groups) * plan.parts) >= PIECE_BYTES
        assert plan.objects <= 1.2 * total / PIECE_BYTES + 1000
        assert plan.total_bytes / plan.parts <= 2 * GB  # what one reduce task holds


def test_exchange_gives_each_part_all_rows_of_its_keys(ray_cluster):
    from amalia_ray.data.exchange.partitions import ExchangePlan, exchange

    rows = [pa.table({"k": [f"key{(i * 7919) % 50}" for i in range(j * 40, j * 40 + 40)],
                      "v": list(range(j * 40, j * 40 + 40))}) for j in range(12)]
    ds = ray_cluster.data.from_arrow(rows)
    # three map tasks of four blocks, five parts
    plan = ExchangePlan(5, ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)), 12)
    groups = exchange(ds, "k", lambda g: pa.table({"keys": [sorted(set(g["k"].to_pylist()))],
                                                    "v": [g["v"].to_pylist()]}), plan=plan).take_all()
    assert 1 < len(groups) <= 5
    seen = [k for g in groups for k in g["keys"]]
    assert len(seen) == len(set(seen)) == 50, "every key in exactly one part"
    assert sorted(v for g in groups for v in g["v"]) == list(range(480))
    for g in groups:
        assert list(g["v"]) == sorted(g["v"]), "rows of a part come in block order"


@pytest.mark.parametrize("piece_bytes", [256 << 10, 1, 1500], ids=["one-run", "a-run-per-block", "runs-of-blocks"])
def test_decisions_reach_the_rows_they_were_taken_for(ray_cluster, monkeypatch, piece_bytes):
    """Decisions taken on key rows in parts come back to their own block and row, whether the routing cuts them by
    one run of all blocks, a run per block or runs of a few blocks; rows without a decision keep their value."""
    from amalia_ray.data.exchange import decide

    monkeypatch.setattr(decide, "ROUTE_PIECE_BYTES", piece_bytes)
    blocks = [pa.table({"id": [f"d{j}-{i}" for i in range(30)], "group": [f"g{(j * 30 + i) % 7}" for i in range(30)],
                        "label": pa.nulls(30, pa.string())}) for j in range(9)]

    def keys(batch):
        return batch.select(["id", "group", decide.ROW])

    def smallest_of_group(group):  # every member but the group's smallest id is labelled with that id
        rows = group.sort_by([("group", "ascending"), ("id", "ascending")])
        ids, groups = rows["id"].to_pylist(), rows["group"].to_pylist()
        first = {}
        for i, g in zip(ids, groups):
            first.setdefault(g, i)
        keep = [i != first[g] for i, g in zip(ids, groups)]
        return pa.table({decide.ROW: rows[decide.ROW].filter(pa.array(keep)),
                         "label": pa.array([first[g] for g, k in zip(groups, keep) if k], pa.string())})

    out = decide.decide(ray_cluster.data.from_arrow(blocks).materialize(), keys, "group", smallest_of_group,
                        decide.set_columns).take_all()
    assert [r["id"] for r in out] == [f"d{j}-{i}" for j in range(9) for i in range(30)], "rows stay in block order"
    smallest = {}
    for r in out:
        smallest[r["group"]] = min(smallest.get(r["group"], r["id"]), r["id"])
    assert all(r["label"] == (None if r["id"] == smallest[r["group"]] else smallest[r["group"]]) for r in out)


def test_report_counts_sum_per_block_group_bys(ray_cluster):
    from amalia_ray.data.exchange.partitions import count_by

    blocks = [pa.table({"source": ["a", "b", "a", None], "reason": [None, "x", None, "x"]}),
              pa.table({"source": pa.array([], pa.string()), "reason": pa.array([], pa.string())}),
              pa.table({"source": ["a"], "reason": ["x"]})]
    counts = count_by(ray_cluster.data.from_arrow(blocks), ["source", "reason"])
    assert sorted(counts, key=str) == sorted([
        {"source": "a", "reason": None, "count": 2}, {"source": "b", "reason": "x", "count": 1},
        {"source": None, "reason": "x", "count": 1}, {"source": "a", "reason": "x", "count": 1}], key=str)


def _reference_components(edges: list[tuple[str, str]]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


@pytest.mark.parametrize("local_edges", [0, 10_000_000], ids=["on-many-tasks", "in-one-task"])
def test_duplicate_chains_longer_than_any_round_cap_form_one_cluster(ray_cluster, local_edges):
    """A chain of 150 near-copies (each an edit of the one before) plus a random graph: each component labelled by
    its smallest id, on many tasks (star contraction, rounds ~ log² n) and in one (union-find). Label propagation
    needed 150 rounds for the chain and gave up after 64."""
    from amalia_ray.data.dedup.components import connected_components

    chain = [f"c{i:04d}" for i in range(150)]
    random.Random(1).shuffle(chain)
    rng = random.Random(2)
    edges = list(zip(chain[:-1], chain[1:])) + [
        (f"r{rng.randrange(300):03d}", f"r{rng.randrange(300):03d}") for _ in range(200)]
    edges = [(a, b) for a, b in edges if a != b]
    ds = ray_cluster.data.from_arrow([pa.table({"src": [a for a, _ in part], "dst": [b for _, b in part]})
                                      for part in (edges[:100], edges[100:220], edges[220:])])
    labels, rounds = connected_components(ds, local_edges=local_edges)
    found = {r["node"]: r["label"] for r in labels.take_all()}
    assert found == _reference_components(edges)
    assert set(found[c] for c in chain) == {"c0000"}
    assert (rounds == 0) == bool(local_edges) and rounds < 30


def test_a_repeated_id_is_found_without_sorting_the_documents(ray_cluster, keys_only_shuffles):
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.dedup.ray_executor import check_unique_ids

    docs = [pa.table({"id": [f"s/f#{i}" for i in range(j * 50, j * 50 + 50)], "text": ["x" * 1000] * 50})
            for j in range(6)]
    check_unique_ids(ray_cluster.data.from_arrow(docs), "test documents")
    docs[4] = docs[4].set_column(0, "id", pa.array([f"s/f#{i}" for i in range(200, 249)] + ["s/f#17"]))
    with pytest.raises(AmaliaError, match="'s/f#17' appears more than once"):
        check_unique_ids(ray_cluster.data.from_arrow(docs), "test documents")



@pytest.mark.e2e
def test_a_corpus_on_s3_is_listed_streamed_and_rerun_when_an_object_changes(ray_cluster, s3_server, tmp_path,
                                                                             keys_only_shuffles):
    """A recipe whose sources are globs on S3 (moto's server): jsonl.gz under two dated folders, Parquet beside
    an unrelated file, and an uncompressed jsonl read in byte ranges (ranged requests). The data stage lists them
    once, streams them in its read tasks, names each document by its object; a second run skips the stage
    (fingerprints from the listing: URI, size, mtime) and a changed object reruns it. A glob matching no object is
    an error naming the field."""
    import gzip
    import json

    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    import yaml

    from amalia_ray.core.config import DataConfig, SourceConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.data.curate import curate
    from amalia_ray.pipeline.runner import Pipeline

    text = gzip.open("/usr/share/debian-reference/debian-reference.pt.txt.gz", "rt", encoding="utf-8").read()
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p) > 300][:120]
    s3 = pafs.S3FileSystem(**s3_server)

    def put(path: str, data: bytes) -> None:
        with s3.open_output_stream(f"amalia/corpus/{path}", compression=None) as f:  # bytes as given
            f.write(data)
        (tmp_path / "local" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / path).write_bytes(data)

    def jsonl(rows):
        return gzip.compress("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in rows).encode())

    put("2023/crawl-0.jsonl.gz", jsonl(paragraphs[:30]))
    put("2024/crawl-0.jsonl.gz", jsonl(paragraphs[30:60]))
    table = pa.table({"text": paragraphs[60:90]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    put("tables/books.parquet", sink.getvalue().to_pybytes())
    put("tables/README.txt", b"not a table")
    dump = gzip.decompress(jsonl(paragraphs[90:120]))
    put("dump/all.jsonl", dump)
    sources = [{"name": "web", "paths": ["s3://amalia/corpus/**/*.jsonl.gz"], "format": "jsonl",
                "storage_options": s3_server},
               {"name": "books", "paths": ["s3://amalia/corpus/tables/*.parquet"], "format": "parquet",
                "storage_options": s3_server},
               {"name": "dump", "paths": ["s3://amalia/corpus/dump/*.jsonl"], "format": "jsonl",
                "range_bytes": 2048, "storage_options": s3_server}]
    recipe = tmp_path / "s3.yaml"
    recipe.write_text(yaml.safe_dump({"run": {"name": "s3", "output_dir": str(tmp_path / "runs")},
                                      "data": {"sources": sources, "min_chars": 100}}))
    first = Pipeline(load_recipe(recipe))
    first.run()
    metrics = first.manifest.stages["data"].metrics
    assert metrics["documents_in"] == 120 and metrics["documents_kept"] == 120, metrics
    read = pq.read_table(first.run_dir / "data" / "inputs.parquet").to_pylist()
    assert len([r for r in read if r["path"].endswith("all.jsonl")]) == -(-len(dump) // 2048) > 3, "read in ranges"
    assert metrics["input_files"] == 4 and metrics["input_bytes"] == sum(r["bytes"] for r in read)
    kept = pq.read_table(first.run_dir / "data" / "kept").to_pylist()
    assert {r["id"].split("#")[0] for r in kept} == {"web/2023/crawl-0.jsonl.gz", "web/2024/crawl-0.jsonl.gz",
                                                     "books/books.parquet", "dump/all.jsonl"}
    local = curate(DataConfig(min_chars=100, sources=[
        SourceConfig(name="web", paths=[str(tmp_path / "local" / "**" / "*.jsonl.gz")], format="jsonl"),
        SourceConfig(name="books", paths=[str(tmp_path / "local" / "tables" / "*.parquet")], format="parquet"),
        SourceConfig(name="dump", paths=[str(tmp_path / "local" / "dump" / "*.jsonl")], format="jsonl")]),
        Path, tmp_path / "local-out")
    assert local["documents_kept"] == 120
    local_kept = pq.read_table(tmp_path / "local-out" / "kept").to_pylist()
    assert sorted((r["id"], r["text"]) for r in kept) == sorted((r["id"], r["text"]) for r in local_kept), \
        "the same documents as from local copies of the objects"
    assert {r["path"] for r in kept} >= {"s3://amalia/corpus/2024/crawl-0.jsonl.gz"}
    secret = s3_server["secret_key"].encode()
    assert not [f for f in first.run_dir.rglob("*") if f.is_file() and secret in f.read_bytes()], \
        "the storage credentials are in no file of the run"

    again = Pipeline(load_recipe(recipe))
    again.run()
    assert again.manifest.stages["data"].finished_at == first.manifest.stages["data"].finished_at, \
        "unchanged objects: the stage is skipped"
    put("2024/crawl-0.jsonl.gz", jsonl(paragraphs[30:59]))
    changed = Pipeline(load_recipe(recipe))
    changed.run()
    assert changed.manifest.stages["data"].metrics["documents_in"] == 119, "a changed object reruns the stage"

    sources[1]["paths"] = ["s3://amalia/corpus/tables/*.jsonl"]
    recipe.write_text(yaml.safe_dump({"run": {"name": "s3b", "output_dir": str(tmp_path / "runs")},
                                      "data": {"sources": sources, "min_chars": 100}}))
    with pytest.raises(AmaliaError, match=r"data.sources\[1\].paths\[0\] = 's3://amalia/corpus/tables/\*.jsonl' "
                                          "matches no object"):
        Pipeline(load_recipe(recipe)).run()


def test_a_large_jsonl_is_read_in_byte_ranges_with_the_ids_of_a_whole_read(ray_cluster, tmp_path):
    """An uncompressed jsonl file over `range_bytes` is read by a task per range: every record exactly once, with
    the location (and so the id) a whole-file read gives it, whatever the ranges cut: a line ending right at a
    range's end, a line longer than a range, one over max_record_bytes, broken JSON, blank lines, no newline at
    the end. Each range's bytes and sha256 are recorded by its task (the ranges tile the file)."""
    import hashlib
    import json

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read.inputs import ReadLedger, list_sources, read_plan, read_sources
    from amalia_ray.data.read.readers import read_file

    rng = random.Random(7)
    words = "o rio corre para o mar e a cidade acorda devagar sobre as colinas".split()
    first = json.dumps({"text": "x" * 1000})
    lines = [first + " " * (1023 - len(first))]  # with its newline exactly the first range
    for i in range(400):
        lines.append(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 60))), "n": i}))
    lines[50] = json.dumps({"text": "longa " * 900})  # 5 KB: spans several ranges
    lines[90] = json.dumps({"text": "enorme " * 2000})  # over max_record_bytes: quarantined, once
    lines[120] = '{"text": "sem fim'
    lines[121:123] = ["", "   "]
    data = "\n".join(lines).encode()  # the last line has no newline
    path = tmp_path / "dump.jsonl"
    path.write_bytes(data)
    src = SourceConfig(name="d", paths=[str(path)], format="jsonl", range_bytes=1024, max_record_bytes=8192)

    plan = read_plan([src], list_sources([src], Path))
    assert [(i["start"], i["end"]) for i in plan] == [(a, min(a + 1024, len(data))) for a in range(0, len(data), 1024)]
    assert all(i["before"] == data[:i["start"]].count(b"\n") for i in plan)
    ledger = ReadLedger()
    ranged = pa.concat_tables(ray_cluster.get(read_sources([src], list_sources([src], Path), ledger).to_arrow_refs()))
    whole = read_file(str(path), src.model_copy(update={"range_bytes": 1 << 30}))
    rows = sorted(zip(*(ranged[c].to_pylist() for c in ("id", "location", "text", "drop_reason"))))
    assert rows == sorted(zip(*(whole[c].to_pylist() for c in ("id", "location", "text", "drop_reason"))))
    assert len(rows) == 399 and ranged["id"].to_pylist().count("d/dump.jsonl#line 91") == 1
    assert {r[3] for r in rows} == {None, "quarantine:record too large", "quarantine:invalid JSON"}

    stats = ledger.write(tmp_path / "inputs.parquet")
    import pyarrow.parquet as pq

    ledger = sorted(pq.read_table(tmp_path / "inputs.parquet").to_pylist(), key=lambda e: e["start"])
    assert stats == {"input_files": 1, "input_bytes": len(data)}
    assert [(e["start"], e["end"]) for e in ledger] == [(i["start"], i["end"]) for i in plan]
    assert all(e["sha256"] == "sha256:" + hashlib.sha256(data[e["start"]:e["end"]]).hexdigest() for e in ledger)
    assert sum(e["records"] for e in ledger) == 399


def test_a_large_parquet_file_is_read_by_row_groups_across_tasks_with_the_ids_of_a_whole_read(ray_cluster, tmp_path):
    """A Parquet file over `range_bytes` is read by a task per byte range, each reading the row groups whose first
    page starts in its range: every row exactly once (an oversized one quarantined once), located by the row number
    a whole-file read gives it, and the ranges' bytes and sha256 tile the file."""
    import hashlib

    import pyarrow.parquet as pq

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read.inputs import ReadLedger, list_sources, read_plan, read_sources
    from amalia_ray.data.read.readers import read_file

    rng = random.Random(3)
    words = "a serra desce ao mar por entre vinhas e socalcos de xisto".split()
    texts = [" ".join(rng.choices(words, k=rng.randint(5, 80))) for _ in range(300)]
    texts[77] = "grande " * 2000  # over max_record_bytes
    path = tmp_path / "dump.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(300)], "text": texts}), path, row_group_size=20,
                   use_dictionary=["id"])
    data = path.read_bytes()
    src = SourceConfig(name="d", paths=[str(path)], format="parquet", range_bytes=4096, max_record_bytes=8192)

    plan = read_plan([src], list_sources([src], Path))
    assert len(plan) > 3 and [(i["start"], i["end"]) for i in plan] == [
        (a, min(a + 4096, len(data))) for a in range(0, len(data), 4096)]
    ledger = ReadLedger()
    ranged = pa.concat_tables(ray_cluster.get(read_sources([src], list_sources([src], Path), ledger).to_arrow_refs()))
    whole = read_file(str(path), src.model_copy(update={"range_bytes": 1 << 30}))
    columns = ("id", "location", "text", "drop_reason", "metadata")
    rows = sorted(zip(*(ranged[c].to_pylist() for c in columns)))
    assert rows == sorted(zip(*(whole[c].to_pylist() for c in columns)))
    assert len(rows) == 300 and [r[3] for r in rows].count("quarantine:record too large") == 1
    assert "row 77" in {r[1] for r in rows if r[3]}

    ledger.write(tmp_path / "inputs.parquet")
    entries = sorted(pq.read_table(tmp_path / "inputs.parquet").to_pylist(), key=lambda e: e["start"])
    assert [(e["start"], e["end"]) for e in entries] == [(i["start"], i["end"]) for i in plan]
    assert all(e["sha256"] == "sha256:" + hashlib.sha256(data[e["start"]:e["end"]]).hexdigest() for e in entries)
    assert sum(e["records"] for e in entries) == 300 and sum(e["records"] > 0 for e in entries) > 3

    broken = tmp_path / "broken" / "cut.parquet"  # its footer cut off: quarantined once, not once per range
    broken.parent.mkdir()
    broken.write_bytes(data[: len(data) // 2])
    src = src.model_copy(update={"paths": [str(broken)]})
    rows = pa.concat_tables(ray_cluster.get(read_sources([src], list_sources([src], Path)).to_arrow_refs()))
    assert len(read_plan([src], list_sources([src], Path))) > 1
    assert rows["drop_reason"].to_pylist() == ["quarantine:unreadable file"], rows.to_pylist()


def test_a_large_web_archive_is_read_in_ranges_of_whole_records_with_the_ids_of_a_whole_read(ray_cluster, tmp_path):
    """A .warc.gz written a gzip member per record, over `range_bytes`: each cut moves to the next member that begins
    a record (gzip magic bytes inside compressed data, or a member that does not start a record, are passed over),
    every record is read once, located at its offset in the decompressed stream as a whole-file read locates it;
    broken and non-HTML records behave as in a whole read. The same records compressed as one member cannot be
    entered in the middle: one range. Uncompressed, each cut moves to the next record start (a version line quoted
    in a page after a blank line is passed over), located by byte offset."""
    import gzip
    import hashlib

    import pyarrow.parquet as pq

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read.inputs import ReadLedger, list_sources, read_plan, read_sources
    from amalia_ray.data.read.readers import read_file
    from tests.test_readers import warc_record

    rng = random.Random(3)
    words = "o arquivo guarda páginas da web portuguesa desde mil novecentos e noventa e seis".split()
    records = [warc_record(f"https://arquivo.pt/p{i}", "<html><body><p>"
                           + " ".join(rng.choices(words, k=rng.randint(20, 200))) + f" número {i}.</p></body></html>")
               for i in range(120)]
    records[30] = records[30].replace(b"Content-Length: ", b"Content-Length: x", 1)  # broken: quarantined once
    records[31] = warc_record("https://arquivo.pt/img.png", "PNG", content_type="image/png")  # skipped
    quoted = "\r\n\r\nWARC/1.0\r\nWARC-Type: response\r\nContent-Length: 9\r\n\r\n<p>x</p>\r\n"
    records[90:100] = [warc_record(f"https://arquivo.pt/q{i}", "<html><body><pre>" + quoted * 20 + f"</pre>{i}"
                                   "<p>Um registo citado dentro de uma página.</p></body></html>") for i in range(10)]
    body = "<p>um registo no fim</p>" * 40  # a whole record quoted at the very end of a page: after it comes the
    tail = f"\r\n\r\nWARC/1.0\r\nWARC-Type: resource\r\nContent-Length: {len(body)}\r\n\r\n{body}"  # next record
    records[100:110] = [warc_record(f"https://arquivo.pt/t{i}", f"<html><body><p>Página {i} {'com texto ' * 30}"
                                    "</p></body></html>" + tail) for i in range(10)]
    members = [gzip.compress(r) for r in records]
    members[60] = gzip.compress(records[60][:50]) + gzip.compress(records[60][50:])  # a member inside a record
    (tmp_path / "crawl.warc.gz").write_bytes(b"".join(members))
    (tmp_path / "whole.warc.gz").write_bytes(gzip.compress(b"".join(records)))
    (tmp_path / "plain.warc").write_bytes(b"".join(records))
    src = SourceConfig(name="w", paths=[str(tmp_path / "*.warc*")], format="warc", range_bytes=2048)

    plan = read_plan([src], list_sources([src], Path))
    ranged = [i for i in plan if i["name"] == "crawl.warc.gz"]
    assert [i["end"] for i in plan if i["name"] == "whole.warc.gz"] == [-1], "one member: read whole"
    data = (tmp_path / "crawl.warc.gz").read_bytes()
    member_starts = {sum(len(m) for m in members[:k]) for k in range(len(members))}
    assert len(ranged) > 5 and {i["start"] for i in ranged} <= member_starts
    assert all(i["before"] == len(gzip.decompress(data[:i["start"]])) for i in ranged[1:])
    inner = sum(len(m) for m in members[:60]) + len(gzip.compress(records[60][:50]))
    assert inner not in {i["start"] for i in ranged}, "a member that does not begin a record is no cut"
    plain = [i for i in plan if i["name"] == "plain.warc"]
    record_starts = {sum(len(r) for r in records[:k]) for k in range(len(records))}
    assert len(plain) > 10 and {i["start"] for i in plain} <= record_starts
    assert all(i["before"] == i["start"] for i in plain)

    ledger = ReadLedger()
    docs = pa.concat_tables(ray_cluster.get(read_sources([src], list_sources([src], Path), ledger).to_arrow_refs()))
    for name in ("crawl.warc.gz", "whole.warc.gz", "plain.warc"):
        whole = read_file(str(tmp_path / name), src.model_copy(update={"range_bytes": 1 << 30}), name)
        mine = docs.filter(pa.compute.equal(docs["path"], str(tmp_path / name)))
        cols = ("id", "text", "drop_reason")
        assert sorted(zip(*(mine[c].to_pylist() for c in cols))) == sorted(zip(*(whole[c].to_pylist() for c in cols)))
        assert len(mine) == 119 and mine["drop_reason"].to_pylist().count("quarantine:broken WARC record") == 1
    ledger.write(tmp_path / "inputs.parquet")
    entries = pq.read_table(tmp_path / "inputs.parquet").to_pylist()
    for name, items in (("crawl.warc.gz", ranged), ("plain.warc", plain)):
        data = (tmp_path / name).read_bytes()
        ledger = [e for e in entries if e["path"].endswith(name)]
        assert sorted((e["start"], e["end"]) for e in ledger) == [(i["start"], i["end"]) for i in items]
        assert all(e["sha256"] == "sha256:" + hashlib.sha256(data[e["start"]:e["end"]]).hexdigest() for e in ledger)


def test_a_large_text_file_is_read_in_ranges_of_whole_documents_with_the_ids_of_a_whole_read(ray_cluster, tmp_path):
    """A plain text file over `range_bytes` (paragraphs or separator blocks; UTF-8 or a one-byte encoding) is read
    by a task per range of whole documents: each cut moves to the end of the next boundary found on the bytes by the
    reader's own rule (runs of blank lines with spaces or CRs, a separator line only at a line start, a boundary right
    after a document over max_record_bytes), and every document is read once, numbered as a whole-file read numbers
    it. Text in UTF-16 cannot be cut on its bytes: one task."""
    import hashlib

    import pyarrow.parquet as pq

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read.inputs import ReadLedger, list_sources, read_plan, read_sources
    from amalia_ray.data.read.readers import read_file

    rng = random.Random(5)
    words = "à beira do Tejo a luz da manhã cai sobre os telhados e as gaivotas".split()
    docs = [" ".join(rng.choices(words, k=rng.randint(3, 120))) for _ in range(300)]
    docs[40] = "comprido " * 1200  # spans several ranges
    docs[90] = "enorme " * 3000  # over max_record_bytes: quarantined once, the boundary after it still found
    for i in range(100, 300, 3):  # a document that starts with spaces or tabs (no cut before it: the blank run
        docs[i] = rng.choice(["  ", "\t", " " * 100]) + docs[i]  # could go on) or a carriage return
    docs[101] = "\r" + docs[101]
    gaps = [rng.choice(["\n\n", "\n  \n\t\n", "\n\n\n\n", "\n \n", "\r\n\r\n", "\r\n \r\n\n"]) for _ in docs]
    paragraphs = "".join(d + g for d, g in zip(docs, gaps)).encode()
    blocks = "".join(d.replace(" e ", "\n%% e\n", 1) + ("\n%\n" if i % 7 else "\n% \t\n%\n")
                     for i, d in enumerate(docs)).encode("latin-1")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "book.txt").write_bytes(paragraphs)
    (tmp_path / "p" / "wide.txt").write_bytes(paragraphs.decode().encode("utf-16"))
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "fortunes").write_bytes(blocks)
    para = SourceConfig(name="p", paths=[str(tmp_path / "p" / "*")], format="text", range_bytes=1024,
                        max_record_bytes=16384)
    wide = para.model_copy(update={"paths": [str(tmp_path / "p" / "wide.txt")], "encoding": "utf-16"})
    para = para.model_copy(update={"paths": [str(tmp_path / "p" / "book.txt")]})
    sep = SourceConfig(name="s", paths=[str(tmp_path / "s" / "*")], format="text", split="separator",
                       encoding="latin-1", range_bytes=1024, max_record_bytes=16384)

    sources = [para, sep, wide]
    plan = read_plan(sources, list_sources(sources, Path))
    assert [i["end"] for i in plan if i["name"] == "wide.txt"] == [-1], "UTF-16: read whole"
    for source, data in ((0, paragraphs), (1, blocks)):
        ranges = [i for i in plan if i["source"] == source]
        assert len(ranges) > 20 and ranges[0]["start"] == 0 and ranges[-1]["end"] == len(data)
        assert all(a["end"] == b["start"] for a, b in zip(ranges, ranges[1:])), "the ranges tile the file"
        ends = {m.end() for m in re.finditer(rb"\n(?:[ \t\r]*\n)+" if source == 0 else rb"(?m)^%[ \t\r]*\n", data)}
        assert {i["start"] for i in ranges[1:]} <= ends, "every cut ends a boundary"
    ledger = ReadLedger()
    read = pa.concat_tables(ray_cluster.get(read_sources(sources, list_sources(sources, Path), ledger).to_arrow_refs()))
    cols = ("id", "location", "text", "drop_reason")
    for source, path in ((para, "p/book.txt"), (sep, "s/fortunes"), (wide, "p/wide.txt")):
        whole = read_file(str(tmp_path / path), source.model_copy(update={"range_bytes": 1 << 30}))
        mine = read.filter(pa.compute.equal(read["path"], str(tmp_path / path)))
        assert sorted(zip(*(mine[c].to_pylist() for c in cols))) == sorted(zip(*(whole[c].to_pylist() for c in cols)))
        assert len(mine) == 300, path
        assert mine["drop_reason"].to_pylist().count("quarantine:record too large") == 1
        assert source.split + " 90" in mine.filter(pa.compute.is_valid(mine["drop_reason"]))["location"].to_pylist()
    ledger.write(tmp_path / "inputs.parquet")
    entries = pq.read_table(tmp_path / "inputs.parquet").to_pylist()
    for path, data in ((para.paths[0], paragraphs), (sep.paths[0].replace("*", "fortunes"), blocks)):
        mine = sorted((e for e in entries if e["path"] == path), key=lambda e: e["start"])
        assert [(e["start"], e["end"]) for e in mine] == [(i["start"], i["end"]) for i in plan if i["path"] == path]
        assert all(e["sha256"] == "sha256:" + hashlib.sha256(data[e["start"]:e["end"]]).hexdigest() for e in mine)


def test_a_storage_error_fails_the_read_instead_of_quarantining_the_rest(monkeypatch):
    """A connection that drops half-way through an object is not a broken file: the read fails, naming the object,
    instead of keeping what came before and quarantining the rest (which would lose documents silently)."""
    import io

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.read import readers, streams

    class Dropping(io.RawIOBase):
        def __init__(self):
            self.left = b"".join(b'{"text": "linha %d"}\n' % i for i in range(5000))

        def readable(self):
            return True

        def readinto(self, buffer):
            if len(self.left) < 50_000:
                raise OSError("AWS Error NETWORK_CONNECTION: connection reset")
            n = min(len(buffer), 4096)
            buffer[:n], self.left = self.left[:n], self.left[n:]
            return n

    class Storage:
        def open_input_stream(self, path, compression=None):
            return Dropping()

    monkeypatch.setattr(streams, "open_filesystem", lambda uri, options=None: (Storage(), uri.split("://")[1]))
    src = SourceConfig(name="web", paths=["s3://b/x.jsonl"], format="jsonl")
    with pytest.raises(AmaliaError, match=r"reading s3://b/x.jsonl failed after \d+ records, not because of its "
                                          r"content: StorageReadError: s3://b/x.jsonl: AWS Error NETWORK_CONNECTION"):
        list(readers.read_file_tables("s3://b/x.jsonl", src))


def test_object_globs_match_as_shell_globs_do():
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.read.inputs import _glob_regex, list_remote

    rx = _glob_regex("bucket/crawl/**/part-[!x]?.jsonl.gz")
    assert rx.match("bucket/crawl/part-a1.jsonl.gz") and rx.match("bucket/crawl/2024/05/part-b2.jsonl.gz")
    assert not rx.match("bucket/crawl/part-x1.jsonl.gz") and not rx.match("bucket/crawl/part-a10.jsonl.gz")
    one = _glob_regex("bucket/*.jsonl")
    assert one.match("bucket/a.jsonl") and not one.match("bucket/sub/a.jsonl"), "* stays inside one folder"
    with pytest.raises(AmaliaError, match="wildcard in the bucket"):
        list_remote("s3://corpus-*/a.jsonl", {"region": "us-east-1"}, "data.sources[0].paths[0]")
