"""The harness against a scripted OpenAI-compatible server (httpx MockTransport): what each task kind sends, how it
scores, retries, bounded concurrency, the result JSON, and the lm-eval export. Real serving is in test_e2e."""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict

import httpx
import pytest
import yaml

from amalia_ray.core.config import EvalConfig, EvalTaskConfig, JudgeConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.evals.generate import extract_choice, first_word
from amalia_ray.core.judge import parse_score
from amalia_ray.evals.lmeval_export import export_lm_eval
from amalia_ray.evals.evaluate import run_task


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The scripted server's chat template (ChatML-like), ready for the assistant's turn."""
    return "".join(f"<|{m['role']}|> {m['content']} <|end|>\n" for m in messages) + "<|assistant|>\n"


class FakeModel:
    """Whitespace tokens; a token costs -0.5 nats if it is one of `liked` words, else -3. Generations follow the
    prompt: a letter for lettered questions, the cloze target, a pt-PT or pt-BR sentence, a judge's grade."""

    def __init__(self, liked=(), fail_first: int = 0, status: int = 503, delay: float = 0.0, tokenize: bool = True):
        self.liked, self.fail_first, self.status, self.delay = set(liked), fail_first, status, delay
        self.tokenize = tokenize  # vLLM's /tokenize at the server's root
        self.calls = 0
        self.attempts: Counter = Counter()  # per distinct request body
        self.in_flight = self.max_in_flight = 0
        self.requests: list[dict] = []
        self.tokenized: list[str] = []
        self.rendered: list[str] = []  # chat contexts rendered by /tokenize, by fake token id
        self.keys: dict[str, set] = defaultdict(set)  # Authorization headers per host

    def logprob(self, token: str) -> float:
        return -0.5 if token.strip(".,") in self.liked else -3.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/tokenize", "/detokenize"):  # vLLM's (not counted among the API calls)
            body = json.loads(request.content)
            if "prompt" in body:
                self.tokenized.append(body["prompt"])
            if not self.tokenize:
                return httpx.Response(404, json={"detail": "Not Found"})
            if request.url.path == "/detokenize":
                return httpx.Response(200, json={"prompt": self.rendered[body["tokens"][0]]})
            if "messages" in body:  # a chat template: one fake token id that /detokenize turns back into the text
                self.rendered.append(render_chat(body["messages"]))
                return httpx.Response(200, json={"count": 1, "tokens": [len(self.rendered) - 1]})
            return httpx.Response(200, json={"count": len(body["prompt"].split()), "tokens": [], "max_model_len": 512})
        self.calls += 1
        self.keys[request.url.host].add(request.headers.get("authorization"))
        self.attempts[request.content] += 1
        if self.calls <= self.fail_first:
            return httpx.Response(self.status, json={"error": {"message": "try again"}})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            body = json.loads(request.content)
            self.requests.append({"path": request.url.path, **body})
            if request.url.path.endswith("/chat/completions"):
                text = self.generate(body["messages"][-1]["content"])
                return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": text}}]})
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            if body.get("echo"):  # every prompt token's log-probability, then the one generated token's
                choices = []
                for i, prompt in enumerate(reversed(prompts)):  # in any order: `index` says which prompt
                    tokens = prompt.split()
                    lps = [None] + [self.logprob(t) for t in tokens[1:]] + [-1.0]
                    top = [None] + [{t: lp, "·": -0.5} for t, lp in zip(tokens[1:], lps[1:-1])] + [{"x": -1.0}]
                    choices.append({"index": len(prompts) - 1 - i, "text": prompt + " x",
                                    "logprobs": {"token_logprobs": lps, "top_logprobs": top}})
                usage = {"prompt_tokens": sum(len(p.split()) for p in prompts), "completion_tokens": len(prompts)}
                return httpx.Response(200, json={"choices": choices, "usage": usage})
            return httpx.Response(200, json={"choices": [{"index": 0, "text": self.generate(prompts[0])}],
                                             "usage": {"prompt_tokens": len(prompts[0].split())}})
        finally:
            self.in_flight -= 1

    def generate(self, prompt: str) -> str:
        if "Atribui uma nota" in prompt:
            return "Nota: 4" if "Debian" in prompt else "Não sei avaliar."
        if "letra da opção" in prompt:
            return " B. porque sim"
        if "capital de Portugal" in prompt:
            return " Lisboa, claro."
        if "viagem" in prompt:
            return "Apanho o autocarro e estou a ler no ecrã do telemóvel."
        if "fim de semana" in prompt:
            return "Peguei o ônibus e fiquei olhando a tela do celular."
        return " hmm"


def run(fake, tmp_path, fmt, rows, prompts_per_request=24, **task):
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    cfg = EvalTaskConfig(name=fmt, path=str(path), format=fmt, **task)
    settings = EvalConfig(tasks=[cfg], concurrency=3, retries=2, prompts_per_request=prompts_per_request,
                          **({"judge": JudgeConfig(model="juiz")} if fmt == "judge" else {}))
    out = tmp_path / "result.json"
    result = run_task(cfg, path, base_url="http://fake/v1", model="m", settings=settings, output=out,
                      transport=httpx.MockTransport(fake))
    assert json.loads(out.read_text())["scores"] == pytest.approx(result["scores"], nan_ok=True)
    return result


MC = [{"id": "1", "question": "Qual é a capital de Portugal?", "choices": ["Madrid", "Lisboa", "Roma"], "answer": 1},
      {"id": "2", "question": "Qual é a cor do céu?", "choices": ["verde", "azul"], "answer": 0}]


def test_loglik_picks_the_likeliest_choice_and_normalizes_by_characters(tmp_path):
    fake = FakeModel(liked={"Lisboa", "azul"})
    result = run(fake, tmp_path, "mcq", MC)
    first, second = result["items"]
    assert first["pred"] == 1 and first["logprobs"] == [-3.0, -0.5, -3.0] and first["acc"] == 1.0
    assert second["pred"] == 1 and second["acc"] == 0.0
    assert result["scores"]["acc"] == 0.5 and result["scores"]["acc_stderr"] == pytest.approx(0.5)
    assert result["scores"]["chance"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert [r["pred_norm"] for r in result["items"]] == [1, 1]
    # both items in one request, context + each choice; each context's token count from the server's /tokenize
    (request,) = fake.requests
    assert request["temperature"] == 0 and request["max_tokens"] == 1 and request["echo"]
    context = "Pergunta: Qual é a capital de Portugal?\nResposta:"
    assert request["prompt"][:3] == [context + " Madrid", context + " Lisboa", context + " Roma"]
    assert len(request["prompt"]) == 3 + 2
    assert set(fake.tokenized) == {context, "Pergunta: Qual é a cor do céu?\nResposta:"}
    assert first["greedy"] == [False, True, False]

    # a server without /tokenize: each item's context goes alone first, its echo giving the token count
    plain = FakeModel(liked={"Lisboa", "azul"}, tokenize=False)
    assert run(plain, tmp_path, "mcq", MC)["items"] == result["items"]
    (request,) = plain.requests
    assert request["prompt"][:4] == [context, context + " Madrid", context + " Lisboa", context + " Roma"]
    assert len(request["prompt"]) == 4 + 3 and len(plain.tokenized) == 1, "asked once"


def test_items_are_grouped_whole_into_requests_and_come_back_in_order(tmp_path):
    rows = [{"id": str(i), "question": f"pergunta {i}", "choices": ["Lisboa", "Porto", "Faro"][:2 + i % 2],
             "answer": i % 2} for i in range(7)]
    grouped, alone = FakeModel(liked={"Lisboa"}, delay=0.01), FakeModel(liked={"Lisboa"})
    result = run(grouped, tmp_path, "mcq", rows, prompts_per_request=8)
    # 2, 3, 2, 3, ... prompts per item: never split, at most 8 per request unless one item alone is bigger
    assert [len(r["prompt"]) for r in grouped.requests] == [7, 8, 2]
    echoed = FakeModel(liked={"Lisboa"}, delay=0.01, tokenize=False)  # 3, 4, 3, 4, ...: each context too
    assert run(echoed, tmp_path, "mcq", rows, prompts_per_request=8)["items"] == result["items"]
    assert [len(r["prompt"]) for r in echoed.requests] == [7, 7, 7, 3]
    assert [r["id"] for r in result["items"]] == [str(i) for i in range(7)]
    assert [r["pred"] for r in result["items"]] == [0] * 7
    assert run(alone, tmp_path, "mcq", rows, prompts_per_request=1)["items"] == result["items"]
    assert len(alone.requests) == 7


def test_an_echo_without_the_generated_token_is_refused(tmp_path):
    class NoGeneratedToken(FakeModel):
        async def __call__(self, request):
            response = await super().__call__(request)
            if request.url.path == "/tokenize":
                return response
            body = json.loads(response.content)
            for choice in body["choices"]:
                for key in ("token_logprobs", "top_logprobs"):
                    choice["logprobs"][key] = choice["logprobs"][key][:-1]
            return httpx.Response(200, json=body)

    with pytest.raises(AmaliaError, match="exactly one generated token"):
        run(NoGeneratedToken(), tmp_path, "mcq", MC)

    class NoEcho(FakeModel):  # a server that ignores echo: completions without prompt log-probabilities
        async def __call__(self, request):
            if request.url.path == "/tokenize":
                return await super().__call__(request)
            body = json.loads((await super().__call__(request)).content)
            return httpx.Response(200, json={**body, "choices": [{**c, "logprobs": None} for c in body["choices"]]})

    with pytest.raises(AmaliaError, match="no prompt log-probabilities .*method: generate"):
        run(NoEcho(), tmp_path, "mcq", MC)


def test_acc_norm_can_differ_from_acc(tmp_path):
    rows = [{"question": "q", "choices": ["um dois tres quatro", "sim"], "answer": 0}]
    result = run(FakeModel(liked={"um", "dois", "tres"}), tmp_path, "mcq", rows)
    item = result["items"][0]
    assert item["logprobs"] == [-4.5, -3.0] and item["pred"] == 1
    assert item["pred_norm"] == 0  # -4.5 / 19 characters beats -3.0 / 3


def test_pheb_is_scored_per_subject(tmp_path):
    rows = [{**MC[0], "year": 2020, "phase": 1, "subject": "Geografia"},
            {**MC[1], "year": 2021, "phase": 2, "subject": "Ciências"}]
    result = run(FakeModel(liked={"Lisboa", "azul"}), tmp_path, "pheb", rows)
    assert result["by_subject"]["Geografia"]["acc"] == 1.0 and result["by_subject"]["Ciências"]["acc"] == 0.0


def test_a_pheb_completion_item_is_scored_as_the_sentence_each_choice_completes(tmp_path):
    """PHEB's `is_completion` items: the question is a sentence to complete, so each choice continues the sentence
    itself, not a "Pergunta: …\\nResposta:" frame; the other items keep the frame, and the lm-eval export carries
    the same context for both."""
    rows = [{"year": 2019, "phase": "1.ª Fase", "subject": "Portuguese", "question_group": "II",
             "question_number": "1", "question": "Segundo o autor, classificar a obra torna-se ",
             "choices": ["impossível.", "indiferente."], "answer": 1, "is_completion": True},
            {"year": 2019, "phase": "1.ª Fase", "subject": "Portuguese", "question_group": "II",
             "question_number": "2", "question": "Qual é a capital de Portugal?", "choices": ["Madrid", "Lisboa"],
             "answer": 1, "is_completion": False}]
    fake = FakeModel(liked={"indiferente", "Lisboa"})
    result = run(fake, tmp_path, "pheb", rows)
    sentence = "Segundo o autor, classificar a obra torna-se"
    assert fake.requests[0]["prompt"][:3] == [sentence + " impossível.", sentence + " indiferente.",
                                              "Pergunta: Qual é a capital de Portugal?\nResposta: Madrid"]
    assert sentence in fake.tokenized
    assert [r["id"] for r in result["items"]] == ["2019 1.ª Fase Portuguese II 1", "2019 1.ª Fase Portuguese II 2"]
    assert result["scores"]["acc"] == 1.0
    path = tmp_path / "pheb.jsonl"
    exported = export_lm_eval(EvalTaskConfig(name="pheb", path=str(path), format="pheb"), path, tmp_path / "lm")
    assert yaml.safe_load(exported.read_text())["doc_to_text"] == "{{query}}"
    rows = [json.loads(ln) for ln in (tmp_path / "lm" / "pheb.jsonl").read_text().splitlines()]
    assert [r["description"] + r["query"] for r in rows] == [sentence, "Pergunta: Qual é a capital de Portugal?\nResposta:"]


def test_pheb_by_generation_sends_the_prompt_of_phebs_own_script(tmp_path):
    """PHEB's evaluate_mcq_instruct.py (letter_only): "Pergunta:" on its own line, "A) …" options, its instruction
    naming the letters; the lm-eval export carries the same prompt."""
    rows = [{"year": 2019, "phase": "1.ª Fase", "subject": "Geography", "question_group": "I",
             "question_number": "1", "question": "Qual é a capital de Portugal?", "choices": ["Madrid", "Lisboa"],
             "answer": 1, "is_completion": False}]
    fake = FakeModel()
    result = run(fake, tmp_path, "pheb", rows, method="generate", chat=True)
    prompt = ("Pergunta:\nQual é a capital de Portugal?\nA) Madrid\nB) Lisboa\nEscolha a opção correta para a "
              "pergunta acima. Responda apenas com a letra da opção correta (A ou B). Não inclua nenhum outro texto.")
    assert fake.requests[0]["messages"] == [{"role": "user", "content": prompt}] and result["scores"]["acc"] == 1.0
    fake = FakeModel()
    run(fake, tmp_path, "pheb", rows, method="generate", chat=True, system_prompt="És um examinador.")
    assert fake.requests[0]["messages"] == [{"role": "system", "content": "És um examinador."},
                                            {"role": "user", "content": prompt}]
    path = tmp_path / "pheb.jsonl"
    cfg = EvalTaskConfig(name="pheb", path=str(path), format="pheb", method="generate")
    assert yaml.safe_load(export_lm_eval(cfg, path, tmp_path / "lm").read_text())["doc_to_text"] == "{{prompt}}"
    assert json.loads((tmp_path / "lm" / "pheb.jsonl").read_text())["prompt"] == prompt


class Sampler(FakeModel):
    """Answers each prompt with its scripted samples, `n` at a time (the OpenAI API's `n`)."""

    def __init__(self, script: dict[str, list[str]]):
        super().__init__()
        self.script = script

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        texts = self.script[body["prompt"]][:body.get("n", 1)]
        return httpx.Response(200, json={"choices": [{"index": i, "text": t} for i, t in reversed(
            list(enumerate(texts)))], "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}})


def test_sampled_exact_answers_give_pass_at_k_and_majority(tmp_path):
    """n samples per item in one request each, the answer read from <answer>, \\boxed{} or the last number, numbers
    compared as numbers; pass@1 and pass@n by the unbiased estimator, maj@n by the most frequent answer; item i's
    request carries seed + i."""
    from amalia_ray.evals.sampled import extracted, pass_at_k

    script = {"Quanto é 6 x 7?": ["São 42.", "<think>6 x 7</think><answer>42</answer>", "41", "\\boxed{42}"],
              "Quanto é 3,5 + 3,5?": ["7,0", "8", "<answer>8</answer>", "<think>sem fim"]}
    rows = [{"id": "a", "prompt": "Quanto é 6 x 7?", "answer": 42},
            {"id": "b", "prompt": "Quanto é 3,5 + 3,5?", "answer": "7"}]
    fake = Sampler(script)
    result = run(fake, tmp_path, "answer", rows, n=4, temperature=0.8, top_p=0.95, seed=5)
    a, b = result["items"]
    assert a["correct"] == [True, True, False, True] and a["pass@1"] == 0.75 and a["pass@4"] == 1.0
    assert a["maj@4"] == 1.0 and a["majority"] == "42.0"
    assert b["preds"] == ["7.0", "8.0", "8.0", None] and b["pass@1"] == 0.25 and b["maj@4"] == 0.0
    assert result["scores"]["pass@1"] == 0.5 and result["scores"]["maj@4"] == 0.5
    assert [(r["n"], r["temperature"], r["top_p"], r["seed"]) for r in fake.requests] == [(4, 0.8, 0.95, 5),
                                                                                          (4, 0.8, 0.95, 6)]
    assert [r["seed"] for r in result["items"]] == [5, 6]
    assert pass_at_k(10, 2, 3) == pytest.approx(1 - (8 * 7 * 6) / (10 * 9 * 8)) and pass_at_k(4, 0, 4) == 0.0
    assert extracted("<answer>\\boxed{1 234,5}</answer>") == "1234.5" and extracted("Lisboa.") == "lisboa"
    greedy = run(Sampler(script), tmp_path, "answer", rows)
    assert greedy["scores"]["exact_match"] == 1.0 and "pass@1" not in greedy["scores"]


def test_sampling_settings_are_checked_when_the_task_is_read():
    with pytest.raises(ValueError, match="n \\(samples per item\\) applies to answer tasks, not 'mcq'"):
        EvalTaskConfig(name="t", path="t.jsonl", format="mcq", n=4, temperature=1.0)
    with pytest.raises(ValueError, match="n = 4 greedy samples would all be the same answer"):
        EvalTaskConfig(name="t", path="t.jsonl", format="answer", n=4)


def test_multiple_choice_by_generation(tmp_path):
    fake = FakeModel()
    result = run(fake, tmp_path, "mcq", MC, method="generate", chat=True)
    assert [r["pred"] for r in result["items"]] == [1, 1] and result["scores"]["acc"] == 0.5
    assert result["scores"]["invalid"] == 0 and fake.requests[0]["path"].endswith("/chat/completions")
    assert "A. Madrid\nB. Lisboa\nC. Roma" in fake.requests[0]["messages"][0]["content"]


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{C}", 2), ("A resposta correta é (B).", 1), ("b) Lisboa", 1), ("Resposta: A", 0),
    ("Penso que é Lisboa.", 1), ("Não sei.", None), ("A ou B?", None), ("\\boxed{E}", None),
    # reasoning models (R1's format): the answer after the reasoning, not a letter weighed inside it
    ("<think>Não é A. Talvez C?</think> <answer>B</answer>", 1), ("<think>A ou C…</think>\nResposta: C", 2),
    ("<think>Será A? Será", None), ("<answer>Roma</answer>", 2),
])
def test_answer_extraction(text, expected):
    assert extract_choice(text, ["Madrid", "Lisboa", "Roma"]) == expected


def test_cloze_exact_match_on_the_first_generated_word(tmp_path):
    rows = [{"text": "A capital de Portugal é Lisboa."}, {"context": "O céu é", "target": "azul"}]
    result = run(FakeModel(), tmp_path, "cloze", rows)
    assert [r["pred"] for r in result["items"]] == ["Lisboa", "hmm"]
    assert result["scores"]["exact_match"] == 0.5 and first_word("  «Olá», disse") == "Olá"
    assert first_word("<think>Lisboa ou Porto</think> Porto.") == "Porto"


def test_variety_rate_of_generations(tmp_path):
    rows = [{"prompt": "Descreve a tua viagem."}, {"prompt": "O que fizeste no fim de semana?"}, {"prompt": "Olá"}]
    result = run(FakeModel(), tmp_path, "variety", rows, max_tokens=48)
    assert [r["label"] for r in result["items"]] == ["pt-PT", "pt-BR", "unknown"]
    s = result["scores"]
    assert s["pt_pt"] == s["pt_br"] == s["unknown"] == pytest.approx(1 / 3)


def test_llm_judge_scores_and_counts_unreadable_verdicts(tmp_path):
    fake = FakeModel()
    rows = [{"prompt": "O que é o Debian?", "reference": "Uma distribuição."}, {"prompt": "Olá"}]
    result = run(fake, tmp_path, "judge", rows)
    assert [r["score"] for r in result["items"]] == [4, None]
    assert result["scores"]["score"] == 4.0 and result["scores"]["invalid"] == 1 and result["judge"] == "juiz"
    judge_requests = [r for r in fake.requests if r.get("model") == "juiz"]
    assert len(judge_requests) == 2 and "Resposta de referência: Uma distribuição." in \
        judge_requests[0]["messages"][0]["content"]


@pytest.mark.parametrize("judge, keys", [
    ({}, {"fake": {"Bearer served-key"}}),  # the run's own server grades: its key
    ({"base_url": "http://judge/v1"}, {"fake": {"Bearer served-key"}, "judge": {None}}),  # another: not our key
    ({"base_url": "http://judge/v1", "api_key_env": "JUDGE_KEY"}, {"fake": {"Bearer served-key"},
                                                                   "judge": {"Bearer judge-key"}}),
])
@pytest.mark.reliability
def test_the_judge_gets_only_its_own_key(tmp_path, monkeypatch, judge, keys):
    monkeypatch.setenv("JUDGE_KEY", "judge-key")
    fake = FakeModel()
    path = tmp_path / "judge.jsonl"
    path.write_text(json.dumps({"prompt": "O que é o Debian?"}))
    cfg = EvalTaskConfig(name="judge", path=str(path), format="judge")
    settings = EvalConfig(tasks=[cfg], judge=JudgeConfig(model="juiz", **judge))
    run_task(cfg, path, base_url="http://fake/v1", model="m", settings=settings, api_key="served-key",
             transport=httpx.MockTransport(fake))
    assert dict(fake.keys) == keys


@pytest.mark.parametrize("text, score", [("Nota: 5", 5), ("nota = 2.", 2), ("Dou-lhe 3.", 3), ("Nota: 7", None),
                                         ("entre 2 e 4", None), ("3,5 de 5", None), ("4/5", 4), ("4", 4),
                                         # a count in a justification is no grade; two different named grades
                                         ("A resposta tem 2 erros de concordância mas a fluência é", None),
                                         ("Tem 3 frases claras; nota: 4", 4), ("Nota: 2. Melhor, nota: 4", None),
                                         # the grade first, on a line of its own; markdown around a named grade
                                         ("4\n\nA resposta é fluente, com 2 erros.", 4),
                                         ("**Nota:** 4 — tem 2 erros", 4), ("2 erros de concordância.", None)])
def test_judge_score_parsing(text, score):
    assert parse_score(text) == score


def test_a_judge_reply_cut_at_max_tokens_counts_only_with_its_named_grade():
    """What ends a reply cut at max_tokens is where it was cut ("… numa escala de 1 a 5, dou 3" may go on
    "… mas …"): only an explicit "Nota: N" in it counts (or a grade alone on its first line)."""
    assert parse_score("Avaliando a fluência, dou 3", cut_short=True) is None
    assert parse_score("Nota: 3. A resposta é fluente mas", cut_short=True) == 3


@pytest.mark.reliability
def test_a_reply_crafted_to_make_the_parsers_backtrack_is_read_in_linear_time():
    """Megabytes of white space after "Nota" or "resposta", unclosed answer tags, a run of punctuation (an external
    judge's reply, a served model's generation): before, 20,000 spaces took 9 s to parse and the time grew as the
    square (2 MB: hours, with the asyncio loop, and the step's deadline, blocked). Now the grade is read from the
    reply's first and last 1,024 characters and runs of white space are made one before choices are looked for;
    60 s is a guard against a hang, not a speed target. Honest replies parse as before."""
    import time

    from amalia_ray.core.judge import final_answer

    started = time.monotonic()
    for reply in ("Nota" + " " * 2_000_000 + "x", "Nota" + "*" * 2_000_000, "<answer>" * 300_000, "!" * 2_000_000):
        assert parse_score(final_answer(reply)) is None
    assert parse_score("Nota: 4" + " " * 2_000_000) == 4 and parse_score("x" * 2_000_000 + " Dou-lhe 4.") == 4
    for text in ("resposta" + " " * 2_000_000 + "B", "Resposta:" + "\n" * 2_000_000 + "B"):
        assert extract_choice(text, ["x", "y", "z"]) == 1
    assert time.monotonic() - started < 60
    assert final_answer("<answer>a</answer></answer>") == "a" and final_answer("<answer>1</answer> <answer>2") == "1"


class TooLong(FakeModel):
    """Answers 400, as vLLM does for a prompt over the model's context, to any request holding a 'LONGO' prompt."""

    async def __call__(self, request):
        body = json.loads(request.content)
        text = json.dumps(body.get("prompt") or body.get("messages"), ensure_ascii=False)
        if "LONGO" in text and request.url.path != "/tokenize":
            self.requests.append({"path": request.url.path, "rejected": True, **body})
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 512"}})
        return await super().__call__(request)


@pytest.mark.parametrize("fmt, task", [("mcq", {}), ("mcq", {"method": "generate"})])
def test_an_item_the_server_refuses_is_reported_and_the_rest_still_scored(tmp_path, fmt, task):
    rows = [{**MC[0], "id": "a"}, {**MC[1], "id": "b", "question": "LONGO " * 3}, {**MC[0], "id": "c"}]
    fake = TooLong(liked={"Lisboa"})
    result = run(fake, tmp_path, fmt, rows, **task)
    assert result["n"] == 2 and result["rejected"] == 1
    assert [r["id"] for r in result["items"]] == ["a", "b", "c"]
    assert "maximum context length" in result["items"][1]["rejected"] and "acc" not in result["items"][1]
    assert result["scores"]["acc"] == 1.0 and result["scores"]["chance"] == pytest.approx(1 / 3)
    if not task:  # the group was refused whole, then sent again item by item
        assert len(fake.requests[0]["prompt"]) == 3 + 2 + 3
        assert sorted(len(r["prompt"]) for r in fake.requests[1:]) == [2, 3, 3]
    with pytest.raises(AmaliaError,
                       match=r"no item could be scored \(1 rejected by the server\), e.g. item b: .*maximum context"):
        run(TooLong(), tmp_path, fmt, rows[1:2], **task)


class Garbles(FakeModel):
    """Answers 200 with a body that is not JSON to any request holding a 'RUIDO' prompt (a broken proxy)."""

    async def __call__(self, request):
        body = json.loads(request.content)
        text = json.dumps(body.get("prompt") or body.get("messages"), ensure_ascii=False)
        if "RUIDO" in text and request.url.path != "/tokenize":
            return httpx.Response(200, content=b"<html>bad gateway</html>")
        return await super().__call__(request)


@pytest.mark.parametrize("task", [{}, {"method": "generate"}])
def test_an_item_whose_request_fails_is_reported_and_the_rest_still_scored(tmp_path, task):
    """A reply that is not JSON (or retries spent, or a reply over the size limit) fails that item, or that
    request's group of items for log-likelihood: they are kept in the result as failed and left out of the scores;
    the task fails only when every item did."""
    rows = [{**MC[0], "id": "a"}, {**MC[1], "id": "b", "question": "RUIDO"}, {**MC[0], "id": "c"}]
    result = run(Garbles(liked={"Lisboa"}), tmp_path, "mcq", rows, prompts_per_request=1, **task)
    assert result["failed"] == 1 and result["n"] == 2 and result["scores"]["acc"] == 1.0
    assert result["items"][1]["failed"] and "not a JSON object" in result["items"][1]["rejected"]
    with pytest.raises(AmaliaError, match=r"no item could be scored \(1 failed\), e\.g\. item b: .*not a JSON"):
        run(Garbles(), tmp_path, "mcq", rows[1:2], **task)


def test_transient_errors_are_retried_and_others_are_not(tmp_path):
    fake = FakeModel(liked={"Lisboa"}, fail_first=2)
    assert run(fake, tmp_path, "mcq", MC[:1])["scores"]["acc"] == 1.0
    for status in (401, 404):  # the key or the model id: every request would fail alike
        refused = FakeModel(fail_first=99, status=status)
        with pytest.raises(AmaliaError, match=f"failed for model 'm': HTTP {status}"):
            run(refused, tmp_path, "mcq", MC)
        assert refused.calls == 1
    broken = FakeModel(fail_first=99, status=503)
    with pytest.raises(AmaliaError, match="HTTP 503"):
        run(broken, tmp_path, "mcq", MC[:1])
    assert max(broken.attempts.values()) == 3  # the first try and 2 retries, then the task fails


def test_requests_in_flight_are_bounded(tmp_path):
    fake = FakeModel(delay=0.02)
    rows = [{"id": str(i), "question": f"q{i}", "choices": ["a", "b", "c"], "answer": 0} for i in range(10)]
    result = run(fake, tmp_path, "mcq", rows, prompts_per_request=4)  # one item (4 prompts) per request
    assert result["n"] == 10 and len(fake.requests) == 10 and fake.max_in_flight == 3


def test_lm_eval_export(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MC))
    spec = yaml.safe_load(export_lm_eval(EvalTaskConfig(name="t", path=str(path)), path, tmp_path / "out").read_text())
    assert spec["output_type"] == "multiple_choice" and spec["doc_to_text"] == "{{query}}"
    assert spec["description"] == "{{description}}" and "num_fewshot" not in spec
    assert spec["target_delimiter"] == " " and [m["metric"] for m in spec["metric_list"]] == ["acc", "acc_norm"]
    rows = [json.loads(ln) for ln in open(spec["dataset_kwargs"]["data_files"]["test"])]
    assert rows[0]["choices"] == MC[0]["choices"] and rows[0]["answer"] == 1 and rows[0]["letter"] == "B"
    assert rows[0]["context"] == "Pergunta: Qual é a capital de Portugal?\nResposta:"
    gen = yaml.safe_load(export_lm_eval(EvalTaskConfig(name="g", path=str(path), method="generate"), path,
                                        tmp_path / "out").read_text())
    assert gen["output_type"] == "generate_until" and gen["doc_to_target"] == "{{letter}}"
    with pytest.raises(AmaliaError, match="no counterpart for 'variety'"):
        export_lm_eval(EvalTaskConfig(name="v", path=str(path), format="variety"), path, tmp_path / "out")


def test_items_seen_in_a_runs_corpus_are_flagged_and_scored_apart(tmp_path):
    """`--contamination-of`: an item whose text (question + choices) a training document quotes is `seen`; the
    scores on the unseen items come beside the full ones. Corpora: a run folder's curated Parquet, or jsonl whose
    every string field counts (chat sets)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    quoted = ("Em que ano foi assinado o tratado que fixou a fronteira entre Portugal e Castela ao longo do rio "
              "Guadiana e das terras de Riba-Coa?")
    items = [{"id": "a", "question": quoted, "choices": ["1297", "1143"], "answer": 0},
             {"id": "b", "question": "Qual é a cor do céu?", "choices": ["verde", "azul"], "answer": 0}]
    run = tmp_path / "runs" / "r"
    (run / "data" / "kept").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "pack").mkdir()  # a run folder's other Parquet files are not its corpus
    pq.write_table(pa.table({"text": [quoted + " " + "Qual é a cor do céu? verde azul"]}), run / "pack" / "p.parquet")
    pq.write_table(pa.table({"id": ["d"], "text": [f"Um texto de história. {quoted} Resposta: 1297."]}),
                   run / "data" / "kept" / "part-000000.parquet")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Qual é a cor do céu? verde azul"}]},
                                ensure_ascii=False) + "\n")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in items))
    cfg = EvalTaskConfig(name="t", path=str(path), format="mcq")
    fake = FakeModel(liked={"1297", "azul"})
    result = run_task(cfg, path, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[cfg]),
                      transport=httpx.MockTransport(fake), contamination_of=[run])
    assert [r["seen"] for r in result["items"]] == [True, False]
    assert result["n_seen"] == 1 and result["n_clean"] == 1
    assert result["scores"]["acc"] == 0.5 and result["scores_clean"]["acc"] == 0.0
    both = run_task(cfg, path, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[cfg]),
                    transport=httpx.MockTransport(fake), contamination_of=[run, chats])
    assert both["n_seen"] == 2 and both["scores_clean"] is None  # the short item is matched whole in the chat
    with pytest.raises(Exception, match="not found"):
        run_task(cfg, path, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[cfg]),
                 transport=httpx.MockTransport(fake), contamination_of=[tmp_path / "nope"])


def test_every_tasks_items_are_looked_up_in_one_parallel_pass_over_the_corpus(ray_cluster, tmp_path):
    """The eval stage's `contamination_of`: one index of all tasks' items, the corpus files scanned in Ray tasks
    side by side, each returning only the items it found; each task gets its own seen ids."""
    from amalia_ray.evals.contamination import seen_items
    from amalia_ray.evals.tasks import load_task

    long_a = ("Em que ano foi assinado o tratado que fixou a fronteira entre Portugal e Castela ao longo do rio "
              "Guadiana e das terras de Riba-Coa?")
    long_b = ("Qual foi o nome da primeira universidade portuguesa, fundada em Lisboa no final do século treze pelo "
              "rei Dom Dinis?")
    tasks = {}
    for name, question in (("history", long_a), ("culture", long_b)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps({"id": f"{name}-{i}", "question": q, "choices": ["x", "y"], "answer": 0},
                                             ensure_ascii=False)
                                  for i, q in enumerate([question, f"Uma pergunta de {name} que ninguém citou?"])))
        tasks[name] = load_task(path, "mcq")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):  # the quotes in two of six files
        text = {1: f"Lido num fórum: {long_a} Ninguém sabia.", 4: f"{long_b} Resposta: Estudo Geral."}.get(i, "nada")
        (corpus / f"part-{i}.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    # lines JSON cannot read (nesting past its depth, a 5,000-digit number) are scanned as text, not a failed stage
    (corpus / "part-2.jsonl").write_text("[" * 100_000 + "\n" + '{"n": ' + "9" * 5000 + "}\n")
    seen = seen_items(tasks, [corpus])
    assert seen == {"history": {"history-0"}, "culture": {"culture-0"}}
    assert seen_items(tasks, [corpus / "part-4.jsonl"]) == {"history": set(), "culture": {"culture-0"}}


def test_the_corpora_items_are_looked_up_in_are_inputs_of_the_eval_stage(ray_cluster, tmp_path):
    """Another run re-curated, or a corpus file changed: the eval stage's fingerprint holds the text its items are
    looked up in (this run's curated corpus, another run's, a corpus file), so its seen flags are scored again."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline import stages
    from amalia_ray.pipeline.runner import Pipeline
    from tests.conftest import write_recipe

    corpus, other = tmp_path / "corpus.jsonl", tmp_path / "runs" / "other"
    corpus.write_text('{"text": "x"}\n')
    (other / "data" / "kept").mkdir(parents=True)
    (other / "manifest.json").write_text("{}")
    p = Pipeline(load_recipe(write_recipe(tmp_path, **{"eval.contamination_of": ["this_run", str(corpus),
                                                                                  str(other)]})))
    p.cluster_info = {"resources": {"CPU": 4}, "billable_cpus": 4}
    (spec,) = stages.build(p, ["eval"])
    assert {k: v for k, v in spec.inputs.items() if k.startswith("contamination:")} == {
        "contamination:0": p.run_dir / "data" / "kept", "contamination:1": corpus,
        "contamination:2": other / "data" / "kept"}


def test_the_eval_stage_scores_the_models_that_answer_and_says_why_the_others_cannot_be(tmp_path, monkeypatch):
    """A model whose engine fails its first request (the server's start reports it, see readiness.py) gets rows
    that say why in the results and the report; every other model is scored. (A real engine that dies:
    test_e2e_base_models.py.)"""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline import stages
    from amalia_ray.pipeline.report import evaluation_section
    from amalia_ray.pipeline.runner import Pipeline
    from amalia_ray.serve.app import Served
    from tests.conftest import write_recipe

    pipeline = Pipeline(load_recipe(write_recipe(tmp_path, **{"resources.device": "cpu"})))
    why = "RuntimeError: Unsupported CPU attention configuration: head_dim=24"
    asked = {}
    monkeypatch.setattr(stages.serve_app, "start", lambda *a, keep_going=False: asked.update(keep_going=keep_going)
                        or Served("http://127.0.0.1:9/v1", {"wide-heads": why}))
    monkeypatch.setattr(stages.serve_app, "stop", lambda name: None)
    scored = []

    def run_task(task, path, *, model, **_):
        scored.append((model, task.name))
        return {"scores": {"acc": 0.5, "acc_stderr": 0.1}, "n": 4, "rejected": 0, "usage": {"prompt_tokens": 7}}

    monkeypatch.setattr(stages, "run_task", run_task)
    out = stages._serve_and_evaluate(pipeline, {"demo-pretrain": tmp_path, "wide-heads": tmp_path}, {})
    tasks = [t.name for t in pipeline.recipe.eval.tasks]
    assert asked == {"keep_going": True} and scored == [("demo-pretrain", t) for t in tasks]
    assert all(out["results"][f"wide-heads/{t}"]["failed"] == why for t in tasks)
    assert all(out["results"][f"demo-pretrain/{t}"]["acc"] == 0.5 for t in tasks)
    assert out["incomplete"] == "1 model(s) could not be served", "so the next run evaluates again"
    report = "\n".join(evaluation_section(tmp_path, out))
    assert "not served (below)" in report and f"- wide-heads: {why}" in report and "0.500 ± 0.100" in report
    # items that failed (a judge's outage, a bad reply) leave the stage incomplete too: scored on fewer items
    monkeypatch.setattr(stages, "run_task", lambda task, path, *, model, **_: {**run_task(task, path, model=model),
                                                                               "failed": 2})
    out = stages._serve_and_evaluate(pipeline, {"demo-pretrain": tmp_path, "wide-heads": tmp_path}, {})
    assert out["incomplete"] == (f"1 model(s) could not be served; {2 * len(tasks)} item(s) failed (retries spent, "
                                 "or a bad reply)")
    assert all(out["results"][f"demo-pretrain/{t}"]["failed_items"] == 2 for t in tasks)


def test_the_reason_an_engine_gives_is_its_first_error_line_not_the_wrapper_that_it_died():
    from amalia_ray.serve.readiness import error_line

    log = ("(Worker pid=9) INFO loading\n(Worker pid=9) ERROR [multiproc_executor.py:1063] Traceback:\n"
           "(Worker pid=9) ERROR [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention configuration: "
           "head_dim=24 isa=1\n(EngineCore pid=8) ERROR     raise RuntimeError(\n"
           "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)\n")
    assert error_line(log) == "RuntimeError: Unsupported CPU attention configuration: head_dim=24 isa=1"
    assert error_line("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.") is None
    assert error_line("torch.OutOfMemoryError: CUDA out of memory. " + "x" * 400).endswith("…")


@pytest.mark.reliability
def test_a_reply_that_is_endless_slow_or_not_the_apis_is_an_error_naming_the_server():
    """A server (a judge elsewhere, a proxy) that sends no end of bytes, one byte now and then, HTML, or JSON without
    the completions: each is an error naming the URL and model, after at most max_reply_bytes read and timeout_s per
    attempt (httpx's own timeout bounds each read only); never a bare JSONDecodeError or KeyError."""
    import asyncio

    from amalia_ray.core.openai_client import OpenAIClient, generate

    async def endless():
        while True:
            yield b"x" * 65536

    async def drip():
        while True:
            yield b" "
            await asyncio.sleep(0.2)

    replies = {"endless": lambda: httpx.Response(200, content=endless()),
               "drip": lambda: httpx.Response(200, content=drip()),
               "html": lambda: httpx.Response(200, text="<html>Bad gateway</html>"),
               "shape": lambda: httpx.Response(200, json={"choices": [{"delta": "x"}]}),
               "message": lambda: httpx.Response(200, json={"choices": [{"index": None, "message": "olá"}]})}

    async def ask(kind):
        async def handler(request):
            return replies[kind]()

        async with OpenAIClient("http://judge.example/v1", "juiz", timeout_s=1, retries=0,
                                transport=httpx.MockTransport(handler), max_reply_bytes=1 << 20) as client:
            return await generate(client, "Olá", max_tokens=4, chat=True)

    expected = {"endless": "the reply runs past 1,048,576 bytes", "drip": "no whole reply within 1 s",
                "html": "the reply is not a JSON object: '<html>Bad gateway</html>'",
                "shape": "the reply does not hold 1 completion(s) (`choices` with message.content)",
                "message": "the reply does not hold 1 completion(s) (`choices` with message.content)"}
    for kind, message in expected.items():
        with pytest.raises(AmaliaError) as e:
            asyncio.run(ask(kind))
        assert "http://judge.example/v1/chat/completions" in str(e.value) and "juiz" in str(e.value)
        assert message in str(e.value), (kind, str(e.value))
