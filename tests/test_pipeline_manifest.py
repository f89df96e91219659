"""Skip / rerun / resume decisions of the stage runner, recorded in manifest.json."""

import json

import pytest

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import load_recipe
from amalia_ray.core.storage import hash_path
from amalia_ray.pipeline.runner import Pipeline, StageSpec
from tests.conftest import write_recipe


@pytest.fixture
def pipeline(tmp_path):
    return Pipeline(load_recipe(write_recipe(tmp_path)))


def make_spec(p, source, calls, fail=False):
    out = p.stage_dir("thing")

    def body():
        calls.append(1)
        if fail:
            raise RuntimeError("worker died")
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.txt").write_text(source.read_text().upper())
        return {"chars": len(source.read_text())}

    return StageSpec("thing", [p.recipe.pack], {"source": source}, {"result": out}, body, {"CPU": 1})


def test_second_run_skips_unchanged_and_reruns_on_change(pipeline, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("olá")
    calls = []
    assert pipeline.execute(make_spec(pipeline, source, calls)) == {"chars": 3}
    rec = json.loads((pipeline.run_dir / "manifest.json").read_text())["stages"]["thing"]
    assert rec["status"] == "completed" and rec["inputs"]["source"] == hash_path(source)
    assert rec["outputs"] == {"result": "thing"} and rec["wall_time_s"] >= 0 and rec["code_version"]
    assert rec["config_hash"] and rec["resources"] == {"CPU": 1}

    again = Pipeline(pipeline.loaded)
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 1 and "skipped" in capsys.readouterr().out

    source.write_text("adeus")
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 2


@pytest.mark.reliability
def test_a_skip_checks_the_outputs_are_what_the_run_made(pipeline, tmp_path, capsys):
    """A completed stage is skipped only while its outputs hash to what it recorded: an output changed on disk
    (half-written by another process, edited by hand) runs the stage again."""
    source = tmp_path / "in.txt"
    source.write_text("olá")
    calls = []
    pipeline.execute(make_spec(pipeline, source, calls))
    (pipeline.stage_dir("thing") / "result.txt").write_text("OLÁ, mexido")
    again = Pipeline(pipeline.loaded)
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 2 and "its output result changed since the completed run" in capsys.readouterr().out
    assert (pipeline.stage_dir("thing") / "result.txt").read_text() == "OLÁ"


@pytest.mark.reliability
def test_a_second_process_on_a_stage_is_refused_naming_the_first(pipeline, tmp_path):
    """Two `amalia run`s of one run name (or a run and a stage job) never run one stage side by side: the second
    is refused, naming the process that holds it; once that one exits, the stage runs."""
    import subprocess
    import sys

    source = tmp_path / "in.txt"
    source.write_text("x")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from amalia_ray.pipeline.locks import stage_lock\n"
        f"with stage_lock(Path({str(pipeline.run_dir)!r}), 'thing'):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        calls = []
        with pytest.raises(AmaliaError, match=rf"stage 'thing' of run '{pipeline.run_dir.name}' is being run by "
                                              rf"another process \(process {holder.pid} on "):
            pipeline.execute(make_spec(pipeline, source, calls))
        assert calls == [] and not (pipeline.run_dir / "manifest.d" / "thing.json").exists()
    finally:
        holder.kill()
        holder.wait()
    pipeline.execute(make_spec(pipeline, source, calls))  # the kernel released the dead holder's lock
    assert calls == [1]


@pytest.mark.reliability
def test_an_unreadable_record_reruns_its_stage_and_keeps_the_others(pipeline, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("x")
    calls = []
    pipeline.execute(make_spec(pipeline, source, calls))
    (pipeline.run_dir / "manifest.d" / "thing.json").write_text('{"status": "compl')  # cut short
    (pipeline.run_dir / "manifest.d" / "other.json").write_text(json.dumps({"status": "completed"}))
    (pipeline.run_dir / "manifest.d" / "deep.json").write_text("[" * 100_000)  # past the parser's depth
    (pipeline.run_dir / "manifest.json").write_text("{" * 100_000)
    again = Pipeline(pipeline.loaded)
    assert again.manifest.stages["other"].status == "completed" and not {"thing", "deep"} & set(again.manifest.stages)
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 2 and "record unreadable" in capsys.readouterr().out


def test_failed_stage_is_recorded_then_resumed(pipeline, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("x")
    calls = []
    with pytest.raises(RuntimeError):
        pipeline.execute(make_spec(pipeline, source, calls, fail=True))
    rec = json.loads((pipeline.run_dir / "manifest.json").read_text())["stages"]["thing"]
    assert rec["status"] == "failed" and "worker died" in rec["error"]

    again = Pipeline(pipeline.loaded)
    again.execute(make_spec(again, source, calls))
    assert "resuming" in capsys.readouterr().out
    assert again.manifest.stages["thing"].attempts == 2


@pytest.mark.reliability
def test_a_failed_stage_whose_inputs_changed_says_it_starts_over(pipeline, tmp_path, capsys):
    """A failed attempt's checkpoints belong to its inputs, settings and code: with another input the stage starts
    over, and says so and why, instead of a plain "running" that hides the lost work."""
    source = tmp_path / "in.txt"
    source.write_text("x")
    calls = []
    with pytest.raises(RuntimeError):
        pipeline.execute(make_spec(pipeline, source, calls, fail=True))
    source.write_text("y")
    again = Pipeline(pipeline.loaded)
    again.execute(make_spec(again, source, calls))
    assert "starting over: its failed attempt ran with other inputs" in capsys.readouterr().out
    assert again.manifest.stages["thing"].attempts == 1


def test_a_stage_that_completed_partially_runs_again(pipeline, tmp_path, capsys):
    """A stage whose completed run left part of its work undone (the eval stage, with a model it could not serve:
    its metrics say `incomplete`) is not skipped by the next run, as an unchanged complete one is."""
    source = tmp_path / "in.txt"
    source.write_text("olá")
    calls, partial = [], [True]
    spec = make_spec(pipeline, source, calls)
    body = spec.body
    spec.body = lambda: {**body(), **({"incomplete": "1 model(s) could not be served"} if partial[0] else {})}
    pipeline.execute(spec)
    capsys.readouterr()
    partial[0] = False
    pipeline.execute(spec)
    assert len(calls) == 2 and "running again: its completed run was partial (1 model(s) could not be served)" in \
        capsys.readouterr().out
    pipeline.execute(spec)
    assert len(calls) == 2, "complete now: skipped"


def test_force_reruns(pipeline, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("x")
    calls = []
    pipeline.execute(make_spec(pipeline, source, calls))
    forced = Pipeline(pipeline.loaded, force=True)
    forced.execute(make_spec(forced, source, calls))
    assert len(calls) == 2


def test_a_stage_whose_inputs_are_missing_says_which(pipeline, tmp_path):
    calls = []
    with pytest.raises(AmaliaError, match=r"stage 'thing' is missing its input\(s\) source \(.*nowhere.txt\)"):
        pipeline.execute(make_spec(pipeline, tmp_path / "nowhere.txt", calls))
    assert not calls and "thing" not in pipeline.manifest.stages


@pytest.mark.parametrize("job, args, message", [
    ("train", ["--stage", "nope"], "unknown stage 'nope'; stages of this recipe: data, tokenizer, pack, pretrain"),
    ("pipeline", ["--until", "evaluate"], "unknown stage 'evaluate'"),
])
def test_stage_jobs_reject_unknown_stages_before_any_work(tmp_path, capsys, job, args, message):
    import importlib

    recipe = write_recipe(tmp_path)
    assert importlib.import_module(f"jobs.{job}").main([str(recipe), *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("job, message", [
    ("train", "nothing for python -m jobs.train to run in this recipe"),
    ("eval", "unknown stage 'eval'; stages of this recipe: data"),
])
def test_a_curation_recipe_has_only_data_stages(tmp_path, capsys, job, message):
    """A recipe with only `data` is valid; its stages are the data stage (and tokenizer/pack when given), and the
    train and eval jobs say there is nothing for them."""
    import importlib

    import yaml

    data = yaml.safe_load(write_recipe(tmp_path).read_text())
    recipe = tmp_path / "curate.yaml"
    recipe.write_text(yaml.safe_dump({"run": data["run"], "data": data["data"]}))
    assert Pipeline(load_recipe(recipe)).stage_names() == ["data"]
    assert importlib.import_module(f"jobs.{job}").main([str(recipe)]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    recipe.write_text(yaml.safe_dump({"run": data["run"], "data": data["data"], "pack": {"seq_len": 64}}))
    assert Pipeline(load_recipe(recipe)).stage_names() == ["data", "tokenizer", "pack"]


def test_serve_job_needs_a_cluster(tmp_path, capsys, monkeypatch):
    from jobs import serve

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert serve.main([str(write_recipe(tmp_path))]) == 1
    assert "deploys onto a cluster" in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # refused before it connects: nothing trained yet
    assert serve.main([str(write_recipe(tmp_path)), "--stage", "pretrain"]) == 1
    assert "no exported checkpoint at " in capsys.readouterr().err


def _finish_stage(run_dir, name, barrier) -> None:
    from amalia_ray.pipeline.manifest import Manifest, now_iso

    manifest = Manifest.load_or_new(run_dir, "r")  # loaded before the other process saves: a stale copy of it
    rec = manifest.stage(name)
    rec.status, rec.attempts, rec.started_at = "completed", 1, now_iso()
    barrier.wait()
    manifest.save(run_dir, [name])


@pytest.mark.reliability
def test_two_stage_jobs_finishing_at_the_same_moment_are_both_recorded(tmp_path):
    """Two processes of one run (stage jobs) each load the manifest, finish a different stage and save at the same
    moment, 50 times in a row: both stages are recorded every time, and the stage recorded before them stays."""
    import multiprocessing

    from amalia_ray.pipeline.manifest import Manifest

    ctx = multiprocessing.get_context("fork")
    for attempt in range(50):
        run_dir = tmp_path / str(attempt)
        earlier = Manifest(run_name="r")
        earlier.stage("pretrain").status = "completed"
        earlier.save(run_dir, ["pretrain"])
        barrier = ctx.Barrier(2)
        jobs = [ctx.Process(target=_finish_stage, args=(run_dir, name, barrier)) for name in ("sft", "dpo")]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(60)
            assert job.exitcode == 0
        want = {"pretrain": "completed", "sft": "completed", "dpo": "completed"}
        stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
        assert {name: rec["status"] for name, rec in stages.items()} == want, f"attempt {attempt}"
        loaded = Manifest.load_or_new(run_dir, "r").stages
        assert {name: rec.status for name, rec in loaded.items()} == want and list(loaded)[0] == "pretrain"


def test_a_training_history_left_empty_or_damaged_does_not_break_the_report(pipeline, tmp_path):
    """A stage restarted from no checkpoint cuts its metrics back to nothing; stopped before its first step, that
    empty history (or lines that are not step records: a list, a step that is not a number, nesting past the
    parser's depth) is left out of the report, instead of an IndexError in every later command that writes it."""
    from amalia_ray.core.formats.step_metrics import read_step_records
    from amalia_ray.pipeline.report import write_report

    source = tmp_path / "in.txt"
    source.write_text("x")
    pipeline.execute(make_spec(pipeline, source, []))
    history = pipeline.run_dir / "thing" / "metrics.jsonl"
    history.parent.mkdir(exist_ok=True)
    history.write_text('[1, 2]\n{"step": "one"}\n{"step": true}\n' + "[" * 100_000 + "\n")
    assert read_step_records(history) == []
    report = write_report(pipeline.run_dir, pipeline.manifest).read_text()
    assert "first loss" not in report, "no training table: no stage has a step"


@pytest.mark.reliability
def test_a_code_change_reruns_a_completed_stage_unless_reuse_stale(pipeline, tmp_path, monkeypatch, capsys):
    """The package's code is part of a stage's fingerprint: after a change a completed stage runs again; with
    --reuse-stale its result is kept on purpose, recorded, and the report says so."""
    from amalia_ray.pipeline import runner
    from amalia_ray.pipeline.report import write_report

    source = tmp_path / "in.txt"
    source.write_text("olá")
    calls = []
    pipeline.execute(make_spec(pipeline, source, calls))
    first = pipeline.manifest.stages["thing"].code_hash
    assert first == runner.code_hash() and len(first) == 16
    monkeypatch.setattr(runner, "code_hash", lambda: "0123456789abcdef")  # the package's source changed

    kept = Pipeline(pipeline.loaded, reuse_stale=True)
    kept.execute(make_spec(kept, source, calls))
    assert len(calls) == 1 and "reused" in capsys.readouterr().out
    rec = kept.manifest.stages["thing"]
    assert rec.reused_stale == "0123456789abcdef" and rec.code_hash == first
    report = write_report(kept.run_dir, kept.manifest).read_text()
    assert "completed (stale, reused)" in report and "Reused on purpose (--reuse-stale)" in report

    again = Pipeline(pipeline.loaded)
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 2 and "the code changed" in capsys.readouterr().out
    rec = again.manifest.stages["thing"]
    assert rec.code_hash == "0123456789abcdef" and rec.reused_stale is None
    again.execute(make_spec(again, source, calls))
    assert len(calls) == 2, "and now it is current"


@pytest.mark.reliability
def test_an_unchanged_input_is_not_read_again(tmp_path, monkeypatch):
    """Input hashing is incremental: a file whose size, mtime, ctime and inode are unchanged takes its digest from
    the cache (no byte read); a changed or replaced file is read again; the digests are the contents'."""
    import hashlib

    from amalia_ray.core import storage

    monkeypatch.setenv("AMALIA_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"part-{i}.jsonl").write_text(f'{{"text": "documento {i}"}}\n' * 1000)
    reads = []
    real = storage.hash_file
    monkeypatch.setattr(storage, "hash_file", lambda path, h=None: reads.append(path) or real(path, h))
    inputs = {"corpus": corpus, "one": corpus / "part-3.jsonl"}
    first = storage.hash_paths(inputs)
    assert len(reads) == 20 and first["one"] == "sha256:" + hashlib.sha256(
        (corpus / "part-3.jsonl").read_bytes()).hexdigest()
    reads.clear()
    assert storage.hash_paths(inputs) == first and reads == [], "nothing read when nothing changed"
    with open(corpus / "part-7.jsonl", "a") as f:
        f.write('{"text": "mais um"}\n')
    changed = storage.hash_paths(inputs)
    assert reads == [corpus / "part-7.jsonl"] and changed["corpus"] != first["corpus"]
    reads.clear()
    (corpus / "new.tmp").write_bytes((corpus / "part-3.jsonl").read_bytes())
    (corpus / "new.tmp").replace(corpus / "part-3.jsonl")  # same bytes, another inode: read again, same digest
    assert storage.hash_paths(inputs) == changed and reads == [corpus / "part-3.jsonl"]


def test_the_loss_plot_has_a_panel_per_objective_each_with_its_own_axis(tmp_path):
    """Pretraining's and SFT's cross-entropy on one panel; DPO's loss with its reward margin and GRPO's mean reward
    with its KL each on their own, with their own axis labels; validation points where a stage has them. What was
    drawn is read back from the PNG's metadata."""
    from PIL import Image

    from amalia_ray.pipeline.report import plot_losses

    logged = {
        "pretrain": lambda i: {"loss": 6 - i, **({"val_loss": 6.2 - i} if i == 3 else {})},
        "sft": lambda i: {"loss": 2 - i / 10},
        "dpo": lambda i: {"loss": 0.69 - i / 100, "rewards/margins": i / 10, "rewards/accuracies": 0.5},
        "grpo": lambda i: {"loss": 0.01, "reward": i / 4, "kl": i / 1000},
    }
    for name, record in logged.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, **record(i)}) + "\n" for i in range(1, 4)))
    png = plot_losses(tmp_path, list(logged), {"pretrain": "pretrain", "sft": "sft", "dpo": "dpo", "grpo": "grpo"})
    panels = json.loads(Image.open(png).text["Panels"])
    assert [(p["panel"], p["stages"]) for p in panels] == [("cross-entropy", ["pretrain", "sft"]), ("dpo", ["dpo"]),
                                                          ("grpo", ["grpo"])]
    assert panels[0]["ylabel"] == "cross-entropy (nats/token)" and "ylabel_right" not in panels[0]
    assert panels[1]["ylabel"].startswith("DPO loss") and panels[1]["ylabel_right"].startswith("reward margin")
    assert panels[2]["ylabel"] == "mean reward" and panels[2]["ylabel_right"].startswith("KL")
    # a stage no longer in the recipe goes on the panel of what it logged
    assert [p["panel"] for p in json.loads(Image.open(plot_losses(tmp_path, ["dpo"])).text["Panels"])] == ["dpo"]
