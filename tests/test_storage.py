"""run.storage: finished stages mirrored to a pyarrow/fsspec filesystem, a fresh machine carrying the run on from it.
(memory:// here, in-process; tests/test_e2e.py runs a pipeline against an S3 server with Ray Train checkpoints.)"""

import shutil
import uuid

import pytest

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import RunStore, open_filesystem
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline, StageSpec
from tests.conftest import write_recipe


@pytest.fixture
def storage():
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/runs"


def stage(p, calls, fail=False):
    out = p.stage_dir("thing")

    def body():
        calls.append(1)
        if fail:
            raise RuntimeError("preempted")
        (out / "part").mkdir(parents=True, exist_ok=True)
        (out / "part" / "x.txt").write_text("olá")
        return {"n": 1}

    return StageSpec("thing", [1], {}, {"result": out / "part"}, body, {"CPU": 1})


def test_a_fresh_machine_skips_what_the_store_has(tmp_path, storage, capsys):
    recipe = write_recipe(tmp_path, **{"run.storage": storage})
    first = Pipeline(load_recipe(recipe))
    calls = []
    first.execute(stage(first, calls))
    store = RunStore(storage, None, first.run_name)
    assert store.exists("manifest.json") and store.exists("thing/part/x.txt")

    shutil.rmtree(first.run_dir)  # another machine: nothing local
    second = Pipeline(load_recipe(recipe))
    assert second.manifest.stages["thing"].status == "completed", "the manifest comes from the store"
    second.execute(stage(second, calls))
    assert len(calls) == 1 and "skipped" in capsys.readouterr().out
    assert (second.run_dir / "thing" / "part" / "x.txt").read_text() == "olá"


def test_a_failed_stage_resumes_on_another_machine(tmp_path, storage, capsys):
    recipe = write_recipe(tmp_path, **{"run.storage": storage})
    first = Pipeline(load_recipe(recipe))
    with pytest.raises(RuntimeError):
        first.execute(stage(first, [], fail=True))
    shutil.rmtree(first.run_dir)
    second = Pipeline(load_recipe(recipe))
    second.execute(stage(second, []))
    assert "resuming" in capsys.readouterr().out and second.manifest.stages["thing"].attempts == 2


def test_storage_added_later_receives_the_finished_stages(tmp_path, storage):
    calls = []
    local = Pipeline(load_recipe(write_recipe(tmp_path)))
    local.execute(stage(local, calls))
    stored = Pipeline(load_recipe(write_recipe(tmp_path, **{"run.storage": storage})))
    stored.execute(stage(stored, calls))
    assert len(calls) == 1 and RunStore(storage, None, stored.run_name).exists("thing/part/x.txt")


def test_inputs_missing_here_come_from_the_store(tmp_path, storage):
    recipe = write_recipe(tmp_path, **{"run.storage": storage})
    first = Pipeline(load_recipe(recipe))
    first.execute(stage(first, []))
    shutil.rmtree(first.run_dir)
    second = Pipeline(load_recipe(recipe))
    made = second.stage_dir("next")
    consumer = StageSpec("next", [1], {"part": second.stage_dir("thing") / "part"}, {"out": made},
                         lambda: made.mkdir(parents=True) or {}, {"CPU": 1})
    second.execute(consumer)
    assert (second.stage_dir("thing") / "part" / "x.txt").exists()


def test_local_paths_and_uris_open(tmp_path):
    fs, path = open_filesystem(str(tmp_path / "store"))
    assert type(fs).__name__ == "LocalFileSystem" and path == str(tmp_path / "store")
    fs, path = open_filesystem("s3://bucket/prefix/", {"endpoint_override": "http://127.0.0.1:9000",
                                                       "region": "eu-west-1"})
    assert type(fs).__name__ == "S3FileSystem" and path == "bucket/prefix"
    fs, path = open_filesystem("memory://b/p")
    assert type(fs).__name__ == "PyFileSystem"


@pytest.mark.parametrize("uri, options, message", [
    ("s3://bucket/p", {"endpoint": "x"}, "cannot open storage 's3://bucket/p': TypeError"),
    ("nosuchscheme://b/p", {}, "cannot open storage 'nosuchscheme://b/p'"),
    ("/tmp/somewhere", {"region": "x"}, "storage_options ['region'] given for a local path"),
])
def test_bad_storage_is_named(uri, options, message):
    with pytest.raises(AmaliaError) as e:
        open_filesystem(uri, options)
    assert message in str(e.value)
