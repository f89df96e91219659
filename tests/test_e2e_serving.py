"""`amalia serve` end to end, as a user runs it: one server in a subprocess (its own embedded Ray, API key on)
serving the demo run's pretrained checkpoint and two LoRA adapters on one vLLM engine, shared by every test here —
adapters against their merged checkpoints, request guards and fuzzing, lm-eval parity, the `amalia eval` command
line, synthetic data through the server, and a replica killed during an evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, read_jsonl

pytestmark = pytest.mark.e2e

API_KEY = "e2e-secret-key"


@pytest.fixture(scope="module")
def served(demo_run, post_training, tmp_path_factory):
    """`amalia serve` as a user runs it — its own embedded Ray in a subprocess, API key on — serving the pretrained
    checkpoint and two LoRA adapters trained on it on the same vLLM engine (several engines side by side are the
    eval stage's, in the tests that run one): the pipeline's LoRA sft stage's and one trained here with PEFT on
    plain text. Stopped at the end with `amalia serve --stop`, which must shut it down."""
    import httpx

    pipeline, _ = demo_run
    port, state = free_port(), tmp_path_factory.mktemp("serve-state")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(AMALIA_API_KEY=API_KEY, AMALIA_STATE_DIR=str(state), RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    ckpt = str(pipeline.checkpoint_of("pretrain"))
    adapters = {"sft": pipeline.run_dir / "sft" / "adapter",
                "plain": _peft_adapter(ckpt, tmp_path_factory.mktemp("adapter") / "plain")}
    cli = [sys.executable, "-m", "amalia_ray.cli"]
    log = state / "serve.log"  # a file, not a pipe: an unread pipe fills up and blocks the server
    proc = subprocess.Popen([*cli, "serve", ckpt, "--name", "pre", "--port", str(port),
                             *[f"--lora={name}={path}" for name, path in adapters.items()]],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(3)
    assert proc.poll() is None, log.read_text()[-3000:]
    yield {"base": base, "url": f"{base}/v1", "key": API_KEY, "checkpoint": ckpt, "state": state, "pid": proc.pid,
           "adapters": adapters}
    stop = subprocess.run([*cli, "serve", "--stop", "--port", str(port)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr + log.read_text()[-3000:]
    assert proc.wait(timeout=60) == 0 and not list(state.rglob("*.json"))


PLAIN_TEXT = ["O Debian é um sistema operativo livre, feito por voluntários de todo o mundo.",
              "Os pacotes são instalados e atualizados com o apt, a partir dos repositórios oficiais.",
              "A documentação explica como configurar a rede, o teclado e o ecrã depois da instalação."]


def _peft_adapter(checkpoint: str, out: Path) -> Path:
    """A LoRA adapter of another shape than the sft stage's (rank 4 on q_proj and v_proj), trained a few steps on
    plain text with PEFT + transformers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for text in PLAIN_TEXT * 2:
        ids = tok(text, return_tensors="pt").input_ids
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out))
    return out


def test_two_adapters_on_one_engine_score_as_their_merged_checkpoints(served):
    """The pretrained checkpoint and two adapters trained differently, each its own model id on one engine: every
    token's log-likelihood through the server equals transformers' on the adapter merged into the checkpoint
    (PEFT's merge_and_unload) within 1e-3, the two adapters' differ from each other and from the base's, and the
    evaluation harness scores an adapter by its model id (its /tokenize included)."""
    import httpx
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from amalia_ray.core.config import EvalConfig, EvalTaskConfig
    from amalia_ray.evals.evaluate import run_task

    headers = {"Authorization": f"Bearer {served['key']}"}
    listed = httpx.get(f"{served['url']}/models", headers=headers, timeout=30).json()["data"]
    assert {m["id"] for m in listed} == {"pre", "pre:sft", "pre:plain"}
    assert {m["id"]: m["metadata"].get("base_model_id") for m in listed}["pre:sft"] == "pre"
    tok = AutoTokenizer.from_pretrained(served["checkpoint"])
    prompts = [tok(t).input_ids for t in PLAIN_TEXT]
    served_ll, merged_ll = {}, {}
    for model_id, adapter in (("pre", None), *((f"pre:{n}", p) for n, p in served["adapters"].items())):
        got = httpx.post(f"{served['url']}/completions", headers=headers, timeout=120, json={
            "model": model_id, "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0})
        assert got.status_code == 200, got.text
        by_index = {c["index"]: c["logprobs"]["token_logprobs"] for c in got.json()["choices"]}
        served_ll[model_id] = torch.tensor([lp for i, ids in enumerate(prompts) for lp in by_index[i][1:len(ids)]])
        model = AutoModelForCausalLM.from_pretrained(served["checkpoint"], dtype=torch.float32)
        if adapter:
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        with torch.no_grad():
            merged_ll[model_id] = torch.cat([
                torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
                .gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1) for ids in prompts])
        assert torch.allclose(served_ll[model_id], merged_ll[model_id], atol=1e-3), (
            model_id, (served_ll[model_id] - merged_ll[model_id]).abs().max())
    for a, b in (("pre:sft", "pre:plain"), ("pre:sft", "pre"), ("pre:plain", "pre")):
        assert (served_ll[a] - served_ll[b]).abs().max() > 1e-2, (a, b)
    mc = Path(__file__).parent.parent / "evals/tasks/pt_mc_sample.jsonl"
    scored = run_task(EvalTaskConfig(name="mc", path=str(mc)), mc, base_url=served["url"], model="pre:sft",
                      settings=EvalConfig(), api_key=served["key"])
    assert scored["n"] == 20 and not scored["rejected"] and 0 <= scored["scores"]["acc"] <= 1


@pytest.mark.reliability
def test_serving_guards_bad_requests_and_keeps_serving(served):
    """401 without the key (not on /health), 404 naming the served ids, 400 for a prompt or max_tokens over the
    context, 400 for broken JSON or wrong types, 413 for a huge body — and a normal request still works."""
    import httpx

    base, auth = served["base"], {"Authorization": f"Bearer {served['key']}"}
    ok = {"model": "pre", "prompt": "O sistema Debian", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", json=ok).status_code == 401
    assert httpx.post(f"{base}/v1/completions", json=ok, headers={"Authorization": "Bearer nope"}).status_code == 401
    health = httpx.get(f"{base}/health")
    healthy = {"pre": "ok", "pre:plain": "ok", "pre:sft": "ok"}  # the adapters as healthy as their engine
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": healthy}
    # /readiness (a failed engine's reason, log text) is behind the key
    assert httpx.get(f"{base}/readiness").status_code == 401
    assert httpx.get(f"{base}/readiness", headers=auth).json() == {"status": "ok", "models": healthy}
    assert {m["id"] for m in httpx.get(f"{base}/v1/models", headers=auth).json()["data"]} == set(healthy)
    r = httpx.post(f"{base}/v1/completions", json={**ok, "model": "nope"}, headers=auth)
    assert r.status_code == 404 and "served models: ['pre', 'pre:plain', 'pre:sft']" in r.text
    cases = [({**ok, "prompt": "palavra " * 3000}, 400), ({**ok, "max_tokens": 100_000}, 400),
             ({**ok, "prompt": 5.5, "max_tokens": "x"}, 400), ({**ok, "prompt": "a" * (9 << 20)}, 413)]
    for body, code in cases:
        assert httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=120).status_code == code
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{base}/v1/completions", json=ok, headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    # bound to loopback only (the default), and the key is in no log or file the server wrote
    import psutil

    port = int(base.rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port}
    assert listening == {"127.0.0.1"}, listening
    for f in Path(served["state"]).rglob("*"):
        assert not f.is_file() or served["key"].encode() not in f.read_bytes(), f


@pytest.mark.reliability
def test_fuzzed_requests_get_no_5xx_and_the_server_stays_up(served):
    """1000 malformed, oversized and adversarial requests (tests/http_fuzz.py: broken and deeply nested JSON, NaN,
    wrong types and sizes in every field, odd paths, methods and headers; seeded) sent 8 at a time on loopback: no
    5xx and no dropped connection, the server answers a good request and /health afterwards, and its memory (the
    whole process tree: Ray, Serve, vLLM) grows by less than 256 MiB."""
    import asyncio
    import collections

    import httpx
    import psutil

    from tests.http_fuzz import cases

    base, auth = served["base"], {"Authorization": f"Bearer {served['key']}"}
    todo = cases(int(os.environ.get("AMALIA_FUZZ_SEED", "2026")), 1000, auth)

    def tree_rss() -> int:
        root = psutil.Process(served["pid"])
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    async def send_all():
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=base, timeout=180) as client:
            async def one(case):
                method, path, headers, body = case
                async with limit:
                    try:
                        r = await client.request(method, path, headers=headers,
                                                 content=body if method not in ("GET", "HEAD") else None)
                        return r.status_code, r.text[:200]
                    except httpx.HTTPError as e:
                        return type(e).__name__, str(e)[:200]
            return await asyncio.gather(*(one(c) for c in todo))

    before = tree_rss()
    results = asyncio.run(send_all())
    after = tree_rss()
    bad = [(case[0], case[1], case[3][:100], code, text) for case, (code, text) in zip(todo, results)
           if not isinstance(code, int) or code >= 500]
    assert not bad, f"{len(bad)} of {len(todo)}: {bad[:8]}"
    codes = collections.Counter(code for code, _ in results)
    assert sum(n for c, n in codes.items() if 400 <= c < 500) >= 700, codes  # mostly refused, as they should be
    r = httpx.post(f"{base}/v1/completions", json={"model": "pre", "prompt": "O sistema", "max_tokens": 4},
                   headers=auth, timeout=60)
    assert r.status_code == 200 and httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert after - before < 256 << 20, f"memory grew by {(after - before) >> 20} MiB ({codes})"


def test_log_likelihood_accuracy_equals_lm_eval(served, tmp_path, monkeypatch):
    """Our tasks exported as lm-eval YAML, run by lm-eval's `local-completions` against the same server: the same
    accuracy and acc_norm, and the same log-likelihood per choice — for our multiple-choice sample zero-shot,
    3-shot (lm-eval drawing its own examples) and 2-shot through the model's chat template with a system prompt,
    and for a EuroEval dataset folder (its letters scored after EuroEval's prompt)."""
    import httpx
    import lm_eval
    from lm_eval.tasks import TaskManager

    from amalia_ray.core.config import EvalConfig, EvalTaskConfig
    from amalia_ray.evals.lmeval_export import export_lm_eval
    from amalia_ray.evals.evaluate import run_task
    from tests.test_euroeval import TEST, hub_snapshot

    mc = str(Path(__file__).parent.parent / "evals/tasks/pt_mc_sample.jsonl")
    tasks = [EvalTaskConfig(name="pt-mc-parity", path=mc),
             EvalTaskConfig(name="pt-mc-3shot-parity", path=mc, num_fewshot=3),
             EvalTaskConfig(name="pt-exams-parity", path=str(hub_snapshot(tmp_path / "pt-exams")), format="euroeval")]
    # the contexts' token counts come from the server's /tokenize (not from the fallback of echoing each context)
    counted = httpx.post(f"{served['base']}/tokenize", json={"model": "pre", "prompt": "Pergunta: Olá?\nResposta:"},
                         headers={"Authorization": f"Bearer {served['key']}"}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] > 3, counted.text
    ours = {t.name: run_task(t, Path(t.path), base_url=served["url"], model="pre", settings=EvalConfig(),
                             api_key=served["key"]) for t in tasks}
    for t in tasks:
        export_lm_eval(t, Path(t.path), tmp_path / "lm")
    monkeypatch.setenv("OPENAI_API_KEY", served["key"])  # lm-eval's local-completions sends it as the Bearer token
    theirs = lm_eval.simple_evaluate(
        model="local-completions", tasks=[t.name for t in tasks], task_manager=TaskManager(
            include_path=str(tmp_path / "lm"), include_defaults=False),
        model_args=f"model=pre,base_url={served['url']}/completions,tokenizer={served['checkpoint']},"
                   "tokenizer_backend=huggingface,num_concurrent=4,max_retries=2", log_samples=True)
    # the context rendered by the model's chat template, with a system prompt and 2-shot examples (lm-eval's
    # --apply_chat_template --system_instruction)
    chat = EvalTaskConfig(name="pt-mc-chat-parity", path=mc, num_fewshot=2, chat=True,
                          system_prompt="És um examinador de português.")
    ours[chat.name] = run_task(chat, Path(mc), base_url=served["url"], model="pre", settings=EvalConfig(),
                               api_key=served["key"])
    export_lm_eval(chat, Path(mc), tmp_path / "lm-chat")
    theirs_chat = lm_eval.simple_evaluate(
        model="local-completions", tasks=[chat.name], task_manager=TaskManager(
            include_path=str(tmp_path / "lm-chat"), include_defaults=False),
        model_args=f"model=pre,base_url={served['url']}/completions,tokenizer={served['checkpoint']},"
                   "tokenizer_backend=huggingface,num_concurrent=4,max_retries=2", log_samples=True,
        apply_chat_template=True, system_instruction=chat.system_prompt)
    theirs["results"] |= theirs_chat["results"]
    theirs["samples"] |= theirs_chat["samples"]
    assert ours["pt-mc-parity"]["n"] == ours["pt-mc-3shot-parity"]["n"] == ours[chat.name]["n"] == 20
    assert ours["pt-exams-parity"]["n"] == len(TEST)
    for name, result in ours.items():
        scores = theirs["results"][name]
        assert result["scores"]["acc"] == scores["acc,none"] and result["scores"]["acc_norm"] == scores[
            "acc_norm,none"], name
        their_ll = {str(s["doc"]["id"]): [r[0][0] for r in s["resps"]] for s in theirs["samples"][name]}
        for item in result["items"]:
            assert item["logprobs"] == pytest.approx(their_ll[item["id"]], abs=1e-4), name


def test_eval_command_line_contract(served, tmp_path):
    """`amalia eval --base-url --model --task --format --output`: a result JSON with scores and per-item
    predictions, for a PHEB exam file, a variety task and an LLM-judged task."""
    env = {**os.environ, "AMALIA_API_KEY": served["key"]}
    tasks = Path(__file__).parent.parent / "evals" / "tasks"
    cli_eval = [sys.executable, "-m", "amalia_ray.cli", "eval", "--base-url", served["url"]]
    # a training corpus that quotes the first exam question: --contamination-of flags that item
    first = json.loads((tasks / "pheb_sample.json").read_text())[0]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": f"Exame nacional. {first['question']} " + " ".join(first["choices"])},
                                 ensure_ascii=False) + "\n")
    for fmt, name, metric in [("pheb", "pheb_sample.json", "acc"), ("variety", "variety_sample.jsonl", "pt_pt")]:
        out = tmp_path / f"{fmt}.json"
        proc = subprocess.run([sys.executable, "-m", "amalia_ray.cli", "eval", "--base-url", served["url"],
                               "--model", "pre", "--task", str(tasks / name), "--format", fmt,
                               "--output", str(out), *(["--contamination-of", str(corpus)] if fmt == "pheb" else [])],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(out.read_text())
        assert result["model"] == "pre" and result["format"] == fmt and len(result["items"]) == result["n"] >= 8
        assert 0.0 <= result["scores"][metric] <= 1.0 and f"{metric}_stderr" in result["scores"]
    pheb = json.loads((tmp_path / "pheb.json").read_text())
    assert set(pheb["by_subject"]) >= {"Matemática", "História"}
    assert [it["seen"] for it in pheb["items"]][:2] == [True, False] and pheb["n_seen"] == 1
    assert pheb["n_clean"] == pheb["n"] - 1 and "acc" in pheb["scores_clean"]
    # an item over the served context (512 tokens) is refused by vLLM (400): reported, the others still scored
    rows = [json.loads(ln) for ln in (tasks / "pt_mc_sample.jsonl").open()][:3]
    rows[1]["question"] = "Qual é a palavra que se repete? " + "palavra " * 800
    long_task = tmp_path / "long.jsonl"
    long_task.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    proc = subprocess.run([*cli_eval, "--model", "pre", "--task", str(long_task), "--output", str(tmp_path / "l.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "l.json").read_text())
    assert result["n"] == 2 and result["rejected"] == 1 and "HTTP 400" in result["items"][1]["rejected"]
    assert [it["id"] for it in result["items"]] == [r["id"] for r in rows] and "rejected" in proc.stderr
    # ALBA-style: the served model answers, a served judge (here the same tiny model) grades
    proc = subprocess.run([sys.executable, "-m", "amalia_ray.cli", "eval", "--base-url", served["url"], "--model",
                           "pre", "--task", str(tasks / "judge_sample.jsonl"), "--format", "judge", "--judge-model",
                           "pre", "--output", str(tmp_path / "judge.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    judged = json.loads((tmp_path / "judge.json").read_text())
    assert judged["judge"] == "pre" and judged["n"] == 6 and all(it["judge_reply"] for it in judged["items"])
    valid = [it["score"] for it in judged["items"] if it["score"] is not None]
    assert judged["scores"]["invalid"] == 6 - len(valid) and all(1 <= v <= 5 for v in valid)


def test_synthetic_data_from_seeds_through_a_served_model(served, tmp_path):
    """R1's seeds -> many samples at small scale: Ray Data actors send each seed prompt to the model served by
    Ray Serve + vLLM (OpenAI API over HTTP), n samples per request; with a reward only accepted samples stay."""
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.synthesize import synthesize
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks

    seeds = tmp_path / "seeds.jsonl"
    # and one seed over the served context (512 tokens): the server refuses it, it is quarantined, the rest expand
    write_tasks([*arithmetic_tasks(12, seed=3), {"id": "longo", "prompt": "Repete: " + "palavra " * 800}], seeds)
    common = {"base_url": served["url"], "model": "pre", "per_seed": 3, "max_tokens": 24, "api_key": served["key"]}
    everything = synthesize(seeds, tmp_path / "all.jsonl", **common)
    accepted = synthesize(seeds, tmp_path / "kept.jsonl", **common, reward="has_number")
    rows = read_jsonl(tmp_path / "all.jsonl")
    assert everything["seeds"] == 13 and everything["sampled"] == 36 and len(rows) == everything["kept"] >= 18
    assert everything["rejected_seeds"] == 1 and "longo" not in {r["seed_id"] for r in rows}
    (refused,) = read_jsonl(Path(everything["rejected_file"]))
    assert refused["seed_id"] == "longo" and "HTTP 400" in refused["error"]
    seed_prompts = {t["id"]: t["prompt"] for t in read_jsonl(seeds)}
    for row in rows:
        assert row["model"] == "pre" and row["reward"] is None
        assert row["messages"][:-1] == seed_prompts[row["seed_id"]] and row["messages"][-1]["role"] == "assistant"
    kept = read_jsonl(tmp_path / "kept.jsonl")
    assert len(kept) == accepted["kept"] <= 36 and all(r["reward"] == 1.0 for r in kept)
    assert all(any(ch.isdigit() for ch in r["messages"][-1]["content"]) for r in kept)


@pytest.mark.reliability
def test_a_replica_killed_during_an_evaluation(served, tmp_path):
    """The vLLM replica serving `pre` SIGKILLed, engine process and all, while an evaluation runs against it:
    Serve starts a new replica, the client retries the requests that failed, and every score and log-likelihood
    equals those of an undisturbed evaluation of the same task. (Last of the tests on the served app.)"""
    import psutil

    from amalia_ray.core.config import EvalConfig, EvalTaskConfig
    from amalia_ray.evals.evaluate import run_task

    sample = [json.loads(ln) for ln in (Path(__file__).parent.parent / "evals/tasks/pt_mc_sample.jsonl").open()]
    items = tmp_path / "mc.jsonl"  # the sample 8 times (new ids), one item per request, 2 in flight: a run of seconds
    items.write_text("".join(json.dumps({**row, "id": f"{row['id']}-{k}"}) + "\n" for k in range(8) for row in sample))
    task = EvalTaskConfig(name="mc", path=str(items))
    settings = EvalConfig(concurrency=2, prompts_per_request=1)
    args = dict(base_url=served["url"], model="pre", settings=settings, api_key=served["key"])
    calm = run_task(task, items, **args)
    assert calm["wall_time_s"] > 2.0, "the evaluation must still be running when the replica is killed after 1 s"

    def replica() -> psutil.Process:
        for p in psutil.Process(served["pid"]).children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "ServeReplica" in title and "LLMServer:pre" in title:
                return p
        raise AssertionError("no Serve replica of pre found")

    victim = replica()
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(run_task(task, items, **args)))
    runner.start()
    time.sleep(1.0)
    for p in [*victim.children(recursive=True), victim]:  # the engine core dies with it, as in a node crash
        p.kill()
    runner.join(timeout=600)
    assert outcome, "the evaluation did not finish"
    disturbed = outcome[0]
    assert disturbed["scores"] == calm["scores"] and disturbed["n"] == calm["n"]
    for a, b in zip(disturbed["items"], calm["items"]):
        assert a["id"] == b["id"] and a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert replica().pid != victim.pid, "a new replica serves pre"
