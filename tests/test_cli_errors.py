"""Each user-facing error is one clear line and a non-zero exit, raised before any work starts."""

import socket
import sys

import pytest
from typer.testing import CliRunner

from amalia_ray.cli import app
from tests.conftest import DEMO_RECIPE, ROOT, free_port, write_recipe

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, list(args))
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    return result.exit_code, lines


def test_validate_ok():
    code, lines = invoke("validate", str(DEMO_RECIPE))
    assert code == 0 and lines[0].startswith("valid:")


def test_unknown_recipe_field_is_one_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(DEMO_RECIPE.read_text().replace("  num_layers: 4", "  num_layer: 4"))
    code, lines = invoke("validate", str(path))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: invalid recipe:") and "model.num_layer: unknown field" in lines[0]


def test_missing_recipe_file():
    code, lines = invoke("validate", "nope.yaml")
    assert code == 1 and lines == ["error: recipe file not found: nope.yaml"]


def test_corpus_path_missing(tmp_path):
    recipe = write_recipe(tmp_path, **{"data.sources.0.paths": ["/nonexistent/corpus/*.txt"]})
    code, lines = invoke("run", str(recipe))
    assert code == 1 and len(lines) == 1
    assert "corpus path not found: data.sources[0].paths[0] = '/nonexistent/corpus/*.txt'" in lines[0]
    assert not (tmp_path / "runs").exists(), "nothing may start before the preflight passes"


def test_judge_must_be_a_served_checkpoint(tmp_path):
    judge_task = {"name": "judged", "path": str(ROOT / "evals" / "tasks" / "judge_sample.jsonl"), "format": "judge"}
    recipe = write_recipe(tmp_path, **{"eval.tasks": [judge_task], "eval.judge": {"model": "gpt-x"}})
    code, lines = invoke("run", str(recipe))
    assert code == 1 and len(lines) == 1
    assert "eval.judge.model 'gpt-x' is not one of the run's served checkpoints ['demo-pretrain']" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_decontamination_task_is_an_eval_task_name_or_a_path(tmp_path):
    """The rule: a string naming one of eval.tasks is that task, any other string a task file (relative to the
    recipe). One that is neither is refused before anything starts, naming the forms accepted."""
    recipe = write_recipe(tmp_path, **{"data.decontaminate": {"tasks": ["exames/2023.json"]}})
    code, lines = invoke("run", str(recipe))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: data.decontaminate.tasks[0]: 'exames/2023.json' is neither the name of one "
                               "of eval.tasks (") and f"nor a task file or folder (nothing at {tmp_path}" in lines[0]
    assert "or a task {name, path, format}" in lines[0] and not (tmp_path / "runs").exists()


@pytest.mark.reliability
def test_a_model_that_cannot_be_served_stops_amalia_serve_with_its_reason(tmp_path, monkeypatch):
    """Without --keep-going, one model whose engine failed its first request (serve_app.start says so: a real one,
    test_e2e_base_models.py) is one error line naming it and the engine's reason, exit 1."""
    from contextlib import nullcontext

    from amalia_ray.cluster import local
    from amalia_ray.serve import app as serve_app

    why = "RuntimeError: Unsupported CPU attention configuration: head_dim=24"
    asked = {}

    def start(models, cfg, gpu, name, adapters=None, keep_going=False):
        asked.update(keep_going=keep_going)
        if not keep_going:
            raise serve_app.ServeFailed({"heads-24": why})
        return serve_app.Served("http://127.0.0.1:9/v1", {"heads-24": why})

    monkeypatch.setattr(serve_app, "start", start)
    monkeypatch.setattr(serve_app, "require_vllm", lambda: None)
    monkeypatch.setattr(local, "ray_session", lambda *a, **k: nullcontext())
    monkeypatch.setattr(local, "cluster_has_gpu", lambda: False)
    monkeypatch.setattr(serve_app, "stop", lambda name: asked.update(stopped=name))
    code, lines = invoke("serve", str(tmp_path), "--name", "heads-24", "--port", str(free_port()))
    assert code == 1 and lines[-1] == f"error: model 'heads-24' cannot be served: {why}" and asked == {
        "keep_going": False}
    # --keep-going with nothing left to serve: the same error, after taking the application down
    code, lines = invoke("serve", str(tmp_path), "--name", "heads-24", "--port", str(free_port()), "--keep-going")
    assert code == 1 and lines[-1] == f"error: model 'heads-24' cannot be served: {why}" and asked["stopped"]


@pytest.mark.reliability
def test_an_endpoint_off_loopback_needs_an_api_key(tmp_path, monkeypatch):
    """`amalia serve --host 0.0.0.0` (and a recipe's serve.host) with no API key is refused before anything
    starts; an open endpoint is allowed only when asked for by name (--allow-no-auth / serve.allow_no_auth)."""
    from amalia_ray.core.config import ServeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve.app import check_auth

    monkeypatch.delenv("AMALIA_API_KEY", raising=False)
    code, lines = invoke("serve", str(tmp_path), "--host", "0.0.0.0")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: serving on 0.0.0.0, which other machines can reach, with no API key "
                               "(AMALIA_API_KEY is not set)") and "--allow-no-auth" in lines[0]
    code, lines = invoke("run", str(write_recipe(tmp_path, **{"serve.host": "10.1.2.3"})))
    assert code == 1 and lines[0].startswith("error: serving on 10.1.2.3") and not (tmp_path / "runs").exists()
    for host in ("127.0.0.1", "localhost", "::1"):
        check_auth(ServeConfig(host=host))
    check_auth(ServeConfig(host="0.0.0.0", allow_no_auth=True))
    monkeypatch.setenv("AMALIA_API_KEY", "k")
    check_auth(ServeConfig(host="0.0.0.0"))
    monkeypatch.delenv("AMALIA_API_KEY")
    with pytest.raises(AmaliaError, match="serving on node-7.lab"):
        check_auth(ServeConfig(host="node-7.lab"))


@pytest.mark.reliability
def test_a_secret_is_not_passed_in_a_jobs_environment(tmp_path):
    """A job's runtime environment is listed to anyone who can list jobs: `amalia submit --env HF_TOKEN=…` is
    refused before the cluster is contacted, naming where secrets go instead."""
    code, lines = invoke("submit", str(DEMO_RECIPE), "--address", "http://127.0.0.1:9", "--env", "HF_TOKEN=hf_x",
                         "--env", "TOKENIZERS_PARALLELISM=false")
    assert code == 1 and len(lines) == 1 and "hf_x" not in lines[0]
    assert lines[0].startswith("error: --env HF_TOKEN=…: a job's environment is shown to anyone who can list")
    # a secret in a value whatever the variable's name, or in a requirement pip would fetch with it
    leaks = [("--env", "MLFLOW_TRACKING_URI=https://me:pa55word@mlflow.example", "--env MLFLOW_TRACKING_URI"),
             ("--pip", "git+https://oauth2:glpat-x1y2z3@gitlab.example/a.git", "--pip entry 1")]
    for flag, value, where in leaks:
        code, lines = invoke("submit", str(DEMO_RECIPE), "--address", "http://127.0.0.1:9", flag, value)
        assert code == 1 and len(lines) == 1 and "pa55word" not in lines[0] and "glpat" not in lines[0]
        assert lines[0].startswith(f"error: {where} holds a secret (a URI's password or a token)"), lines


def test_port_in_use(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        code, lines = invoke("run", str(write_recipe(tmp_path, **{"serve.port": port})))
    assert code == 1 and len(lines) == 1
    assert f"error: port {port} on 127.0.0.1 is already in use" in lines[0]


def test_vllm_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when the package is absent
    code, lines = invoke("serve", str(tmp_path))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: vLLM is not installed") and "amalia-ray[cpu]" in lines[0]
    code, lines = invoke("run", str(write_recipe(tmp_path)))
    assert code == 1 and lines[0].startswith("error: vLLM is not installed")


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--stop", "--port", "9"], "error: no `amalia serve` on 127.0.0.1:9 on this machine"),
        (["serve"], "error: name at least one checkpoint folder to serve"),
        (["eval", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--task", "t.jsonl", "--format", "judge"],
         "error: --format judge needs --judge-model"),
        (["eval", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--task", "t.jsonl", "--format", "cloze",
          "--method", "loglik"], "error: --options: Value error, task 't': method 'loglik' applies to mcq, pheb"),
        (["eval", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--task", "t.jsonl", "--format", "exam"],
         "error: --format: Input should be 'mcq', 'pheb'"),
        (["eval", "--task", "t.jsonl", "--format", "mcq"], "error: amalia eval needs --base-url and --model"),
        (["eval", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--task", "nope.jsonl"],
         "error: task file not found: nope.jsonl"),
    ],
)
def test_bad_serve_and_eval_options_are_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.setenv("AMALIA_STATE_DIR", str(tmp_path))
    code, lines = invoke(*args)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(message), lines[0]


def test_show_prompt_prints_what_is_sent_without_a_server(tmp_path):
    """`amalia eval --show-prompt`: the exact text of the first items' requests, the format told by the fields."""
    import json

    rows = [{"year": 2019, "phase": "1.ª Fase", "subject": "Portuguese", "question_group": "II",
             "question_number": n, "question": q, "choices": ["uma", "duas"], "answer": 0, "is_completion": c}
            for n, q, c in (("1", "O texto serve ao autor como", True), ("2", "Quantas são?", False))]
    path = tmp_path / "all.json"
    path.write_text(json.dumps(rows, ensure_ascii=False))
    result = runner.invoke(app, ["eval", "--task", str(path), "--show-prompt", "--limit", "2"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["format"] == "pheb" and shown["method"] == "loglik"
    first, second = shown["items"]
    assert first["id"] == "2019 1.ª Fase Portuguese II 1" and first["context"] == "O texto serve ao autor como"
    assert first["prompts"] == ["O texto serve ao autor como uma", "O texto serve ao autor como duas"]
    assert second["prompts"][0] == "Pergunta: Quantas são?\nResposta: uma"
    result = runner.invoke(app, ["eval", "--task", str(path), "--show-prompt", "--method", "generate", "--chat",
                                 "--system-prompt", "És um professor."])
    (item,) = json.loads(result.output)["items"]
    system, user = item["messages"]
    assert item["endpoint"] == "/v1/chat/completions" and system == {"role": "system", "content": "És um professor."}
    assert user["role"] == "user" and user["content"].startswith("Pergunta:\nO texto serve ao autor como\nA) uma\nB) duas\n")
    result = runner.invoke(app, ["eval", "--task", str(path), "--show-prompt", "--system-prompt", "És um professor."])
    assert result.exit_code == 1 and "system_prompt applies to chat tasks" in " ".join(result.output.split())


@pytest.mark.parametrize("space, message", [
    ("parameters: {lrr: {values: [0.1]}}", "error: parameters.lrr: not a tunable field of train stage 'pretrain'"),
    ("parameters: {lr: {distribution: uniform, low: 0.1, high: 0.01}}",
     "error: {path}: parameters.lr: Value error, empty range: low 0.1 is not below high 0.01"),
    ("parameters: {lr: {values: [fast]}}", "error: parameters.lr: value 'fast' does not fit train stage 'pretrain'"),
    ("parameters: {global_batch_size: {values: [0]}}", "error: parameters.global_batch_size: value 0 does not fit"),
    ("parameters: {lr: {values: []}}", "error: {path}: parameters.lr: Value error, values is empty"),
    ("metric: bleu\nparameters: {lr: {values: [0.1]}}", "error: metric 'bleu' is not reported by a pretrain stage"),
])
def test_a_bad_search_space_fails_before_any_trial(space, message, tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(space)
    recipe = write_recipe(tmp_path)
    code, lines = invoke("sweep", str(recipe), "--stage", "pretrain", "--space", str(path))
    assert code == 1 and len(lines) == 1 and lines[0].startswith(message.format(path=path)), lines
    assert not (tmp_path / "runs").exists(), "nothing ran"


def test_debug_shows_traceback():
    result = runner.invoke(app, ["--debug", "validate", "nope.yaml"])
    assert result.exit_code == 1 and result.exception is not None


def test_status_of_missing_run(tmp_path):
    code, lines = invoke("status", str(tmp_path / "nope"))
    assert code == 1 and lines == [f"error: no run at {tmp_path / 'nope'} (no manifest.json); for a submitted job's "
                                   "status pass --address"]


def test_status_lists_stages(tmp_path):
    from amalia_ray.pipeline.manifest import Manifest, StageRecord

    Manifest(run_name="r", stages={"data": StageRecord(status="completed", wall_time_s=1.5, attempts=1)}).save(tmp_path)
    code, lines = invoke("status", str(tmp_path))
    assert code == 0 and any("data" in ln and "completed" in ln and "1.5" in ln for ln in lines)
