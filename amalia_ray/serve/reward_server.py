"""A trained reward model (a transformers sequence classifier with one output, as the reward stage exports) served by
Ray Serve for a sampled training stage: the stage's trainer sends each completion as a request through a deployment
handle, and Serve gathers the requests that arrive together into batches (`serve.batch`) the model scores in one
forward pass each. The application has no HTTP route (handles only), and where this starts Serve it starts it with
no HTTP proxy: nothing listens on a port for it."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from pathlib import Path

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.reward_text import reward_input_ids

# requests gathered into one batch, and how long the first waits for others (a rollout sends all of its at once)
MAX_BATCH_SIZE = 64
BATCH_WAIT_S = 0.02
# padded tokens of one forward pass: a batch of long completions is scored in slices of at most this many
MAX_BATCH_TOKENS = 32768


def app_name(run_label: str, index: int) -> str:
    """The Serve application of a stage's `index`-th reward model."""
    return f"amalia-{run_label}-reward-{index}"


def score_head_in_fp32(model) -> None:
    """The classifier's last layer in fp32 on the bf16 model's final hidden states: a score computed in bf16 keeps
    8 bits (steps of 0.03 near 4), so completions of one GRPO group that differ a little would tie."""
    import torch

    head = getattr(model, "score", None)  # the head's name in transformers' decoder classifiers
    if isinstance(head, torch.nn.Linear) and head.weight.dtype != torch.float32:
        head.float()
        head.register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args))


class RewardModel:
    """One replica: the tokenizer and the classifier of a checkpoint folder, on the replica's GPU when it has one."""

    def __init__(self, checkpoint: str, use_gpu: bool):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if use_gpu and not torch.cuda.is_available():
            raise AmaliaError(f"the reward model {checkpoint} was given a GPU that torch {torch.__version__} cannot "
                              "use (CUDA unavailable on its node)")
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.tok = AutoTokenizer.from_pretrained(checkpoint)
        dtype = torch.bfloat16 if use_gpu else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(checkpoint, dtype=dtype).to(self.device)
        self.model.eval()
        score_head_in_fp32(self.model)
        if self.model.config.num_labels != 1:
            raise AmaliaError(f"{checkpoint}: a sequence classifier with {self.model.config.num_labels} outputs; a "
                              "reward model has one (a reward stage's export, or num_labels: 1)")
        text = self.model.config.get_text_config()  # where the classifier reads its pad id
        pad = text.pad_token_id
        self.pad_id = pad if pad is not None else (self.tok.pad_token_id if self.tok.pad_token_id is not None
                                                   else self.tok.eos_token_id)
        text.pad_token_id = self.pad_id  # the classifier finds each sequence's last token by it
        self.max_len = getattr(text, "max_position_embeddings", None) or 1 << 30
        self.seen = {"requests": 0, "batches": 0, "largest_batch": 0, "cut": 0}

    def _scores(self, items: list[tuple]) -> list[float]:
        import torch

        ids = [reward_input_ids(self.tok, prompt, answer) for prompt, answer in items]
        self.seen["cut"] += sum(len(s) > self.max_len for s in ids)
        ids = [s[:self.max_len] for s in ids]  # past the model's positions: scored on its start
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        start = 0
        while start < len(order):  # shortest first, slices of at most MAX_BATCH_TOKENS padded tokens
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(ids[order[end]]) <= MAX_BATCH_TOKENS:
                end += 1
            part = [ids[i] for i in order[start:end]]
            width = max(map(len, part))
            input_ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(part), width), dtype=torch.long)
            for row, s in enumerate(part):
                input_ids[row, :len(s)], attention[row, :len(s)] = torch.tensor(s), 1
            with torch.no_grad():
                out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            for i, value in zip(order[start:end], out.logits[:, 0].float().cpu().tolist()):
                scores[i] = value
            start = end
        return scores

    async def score(self, items: list[tuple]) -> list[float]:
        """Each (prompt, answer)'s reward; Serve calls this with the requests it gathered."""
        self.seen["requests"] += len(items)
        self.seen["batches"] += 1
        self.seen["largest_batch"] = max(self.seen["largest_batch"], len(items))
        return await asyncio.to_thread(self._scores, items)

    def stats(self) -> dict:
        """Requests and batches served so far (how well requests were gathered)."""
        return dict(self.seen)


def deployment(checkpoint: Path, use_gpu: bool, cpus: float = 1.0):
    """The Serve application of one reward model: one replica (one GPU, or `cpus` CPUs)."""
    from ray import serve

    cls = type("RewardModel", (RewardModel,), {
        "score": serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)(RewardModel.score)})
    resources = {"num_gpus": 1, "num_cpus": 1} if use_gpu else {"num_cpus": cpus}
    return serve.deployment(cls, name="reward-model", ray_actor_options=resources,
                            max_ongoing_requests=4 * MAX_BATCH_SIZE).bind(str(checkpoint), use_gpu)


def check_checkpoint(checkpoint: Path) -> None:
    """A reward model's folder, read from its config.json alone: a sequence classifier with one output."""
    import json

    config_file = Path(checkpoint) / "config.json"
    if not config_file.is_file():
        raise AmaliaError(f"reward model {checkpoint}: no config.json there (a reward stage's hf/ folder, or a HF "
                          "sequence-classification checkpoint)")
    try:
        config = json.loads(config_file.read_text())
        architectures = list(config.get("architectures") or [])
        outputs = config.get("num_labels", len(config.get("id2label") or {}) or 2)  # transformers' default: 2
    except (ValueError, AttributeError, TypeError) as e:
        raise AmaliaError(f"reward model {checkpoint}: config.json cannot be read ({e})") from None
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise AmaliaError(f"reward model {checkpoint}: architectures {architectures} has no sequence classifier "
                          "(…ForSequenceClassification): a reward stage's export, or a reward model, scores text")
    if outputs != 1:
        raise AmaliaError(f"reward model {checkpoint}: {outputs} outputs; a reward model has one (num_labels: 1)")


def start(checkpoint: Path, name: str, use_gpu: bool, timeout_s: float = 900, poll_s: float = 1.0) -> str:
    """Deploy the reward model in `checkpoint` as the application `name` and wait, at most `timeout_s`, until its
    replica is up; returns the name (what `handle(name)` reaches). Where Serve does not run yet it is started
    without an HTTP proxy. A replica that cannot be placed (no free GPU) or does not start in time is an error, and
    nothing of the application is left: serve.run would wait for it with no time limit."""
    from ray import serve

    from amalia_ray.serve.app import note_started_serve, running_serve, stop

    checkpoint = Path(checkpoint)
    check_checkpoint(checkpoint)
    if running_serve() is None:
        serve.start(proxy_location="Disabled")
        note_started_serve(name)
    try:
        serve.run_many([serve.RunTarget(target=deployment(checkpoint, use_gpu), name=name, route_prefix=None)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        deadline = time.monotonic() + timeout_s
        while (status := _status(name)) != "RUNNING":
            if status in ("DEPLOY_FAILED", "UNHEALTHY") or time.monotonic() > deadline:
                why = _message(name) or "no replica came up"
                raise AmaliaError(f"reward model {checkpoint} could not be served: {status} after "
                                  f"{timeout_s - max(0.0, deadline - time.monotonic()):.0f} s "
                                  f"({why}; it asks {'a GPU' if use_gpu else '1 CPU'} per replica)")
            time.sleep(poll_s)
    except BaseException:
        with suppress(Exception):  # the cause, not a failed clean-up, is what the caller hears of
            stop(name)
        raise
    return name


def _status(name: str) -> str:
    from ray import serve

    app = serve.status().applications.get(name)
    return str(getattr(app.status, "value", app.status)) if app else "NOT_STARTED"


def _message(name: str) -> str:
    from ray import serve

    app = serve.status().applications.get(name)
    lines = (app.message or "").strip().splitlines() if app else []
    return lines[0][:500] if lines else ""
