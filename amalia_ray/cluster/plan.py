"""`amalia plan`: what each training stage of a recipe will need and cost on the cluster it names, before any GPU-hour
is spent — memory per GPU under FSDP2, step time at a stated MFU, GPU-hours, cost and energy — and which stages
cannot fit, with what to change.

Memory per GPU (bytes; P parameters, N GPUs = the stage's workers, L layers, T tokens per micro-batch):
- sharded training state, FSDP2 over all N (or HSDP over groups of `shard_size` = k): fp32 parameters, fp32
  gradients and AdamW's two fp32 moments, 16·P / N (16·P / k);
- unsharded layers in flight: the bf16 all-gathered parameters of the current and the prefetched decoder block,
  2 · 2 · P_layer;
- activations (bf16, FlashAttention-style attention that stores no s×s matrix): per token and layer the inputs the
  backward pass keeps — two norms' inputs and outputs, q/k/v, the attention output, the residual, and the MLP's gate,
  up, activation and down inputs: 2·(8h + 2·kv_dim + 4·ffn) bytes. Without activation checkpointing all L layers keep
  them; with it each layer keeps only its input (2h) and one layer's worth is rebuilt at a time;
- logits: T·V in bf16 and their bf16 gradient, 4·T·V; the loss upcasts one chunk of C positions at a time to fp32
  (C = 2048; the copy, its log-sum-exp and its gradient), 12·C·V;
- the root module (embeddings, final norm, LM head), which FSDP2 keeps gathered from the forward through the
  backward pass: its bf16 parameters and their gradients, 4·P_root.
DPO micro-batches hold a chosen and a rejected sequence per pair (2× tokens).

Step time = tokens per step × model FLOPs per token / (N · peak · MFU), model FLOPs as the training loop counts them
(core/flops.py, torchtitan's: 6 × matmul parameters + 12·L·attention width·s). Recomputation under activation
checkpointing is not model FLOPs: it shows as a lower MFU, so state the MFU you expect with it. DPO adds its reference
pass (a forward: a third of the training FLOPs, over the same pairs).

GRPO adds its rollouts, one per `num_iterations` steps, each at most (every completion to max_completion_length,
every prompt as long as fits beside it in seq_len): per engine, its share of the step's prompts with all their
completions, at most ENGINE_MAX_SEQS decoded at once; a prefill at the stage's MFU, then one decoding step per
completion token, each bounded by reading the engine's bf16 weights and its sequences' KV cache at
`decode_bandwidth_utilization` of `memory_tb_per_s` (or by its compute, where that is slower). With `async_rollout`
a rollout overlaps the last step on the rollout before it. GPU-hours count, for the whole stage, the GPUs of rollout
engines placed apart from the workers and of the reward models and judges a sampled stage serves; weight pushes and
engines waking are left out. A rollout time a past run measured (`plan.reported_rollout_s`) gives the share of
`memory_tb_per_s` that makes the bound equal it: the decode bandwidth utilization to plan the stage with (not its
engines' own: completions that ended before max_completion_length, weight pushes and scoring are in the time).
On-policy DPO samples once before training, from a tasks file the plan does not read: a note gives the time per
1,000 prompts.

A stage on more GPUs than one node has (`plan.gpus_per_node`) gets notes: HSDP's smallest shard group of whole nodes
that fits, when the stage shards over every GPU; and a warning when the nodes are linked by TCP only
(`plan.interconnect`).
"""

from __future__ import annotations

from dataclasses import dataclass

from amalia_ray.core.config import ENGINE_MAX_SEQS, LOSS_CHUNK_POSITIONS, PlanConfig, Recipe, TrainStageConfig
from amalia_ray.core.console import figure
from amalia_ray.core.flops import model_flops_per_token
from amalia_ray.core.formats.shards import fillers_per_step

GB = 1024**3


@dataclass(frozen=True)
class Dims:
    """The sizes the plan needs, from the recipe's dimensions or a base model's config.json."""
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int

    @classmethod
    def of(cls, recipe: Recipe, hf_config: dict | None = None) -> Dims:
        """`hf_config`: the base model's config (model.from); a recipe without one builds a Llama of its own."""
        m = recipe.model
        if hf_config is None:
            if m.base:
                raise ValueError("a base model's config.json is needed to plan it")
            return cls(m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads,
                       m.hidden_size // m.num_heads, recipe.tokenizer.vocab_size, m.tie_word_embeddings,
                       m.max_position_embeddings)
        c = {**hf_config.get("text_config", {}), **hf_config} if "hidden_size" in hf_config else \
            hf_config.get("text_config", {})
        heads = c["num_attention_heads"]
        added = recipe.tokenizer.add_tokens  # an extended vocabulary grows the embeddings (at most by this many)
        added = len(added) if isinstance(added, list) else added or 0
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                   c["vocab_size"] + added, bool(c.get("tie_word_embeddings", False)),
                   c.get("max_position_embeddings", 0))


def parameter_count(d: Dims) -> tuple[int, int]:
    """(total parameters, parameters of one decoder block): q/k/v/o projections, gated MLP, two norms per block
    (extra norms some families add are a few thousand parameters of billions)."""
    q_dim, kv_dim = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = 2 * d.hidden * q_dim + 2 * d.hidden * kv_dim
    block = attention + 3 * d.hidden * d.ffn + 2 * d.hidden
    embeddings = d.vocab * d.hidden * (1 if d.tied else 2)
    return d.layers * block + embeddings + d.hidden, block


@dataclass(frozen=True)
class StagePlan:
    stage: str
    gpus: int
    seq_len: int
    tokens_per_step: int
    memory_gb: dict[str, float]
    fits: bool
    advice: str
    step_time_s: float
    gpu_hours: float
    cost_usd: float
    energy_kwh: float
    tokens_per_joule: float
    tokens_per_gpu_hour: float
    implied_mfu: float | None
    checkpoint_s: float = 0.0  # a save of the weights and AdamW state at the storage's write rate
    rollout_s: float = 0.0  # GRPO: one rollout's generation, at most (already in step_time_s, averaged over steps)
    longest_step_s: float = 0.0  # a step that waits for a whole rollout (GRPO); the step time otherwise
    nodes: int = 1
    implied_decode_utilization: float | None = None  # GRPO: what plan.reported_rollout_s implies
    notes: tuple[str, ...] = ()  # what to know or change on a stage that fits (HSDP, the interconnect)

    @property
    def total_memory_gb(self) -> float:
        return sum(self.memory_gb.values())


def plan_stage(stage: TrainStageConfig, recipe: Recipe, dims: Dims | None = None, advise: bool = True) -> StagePlan:
    m, hw = dims or Dims.of(recipe), recipe.plan
    vocab = m.vocab
    params, block = parameter_count(m)
    gpus = stage.worker_range[1]
    seq = stage.sequence_length or (recipe.pack.seq_len if stage.objective == "pretrain" else m.max_positions)
    per_pair = 2 if stage.objective in ("dpo", "reward") else 1  # both sides of a preference pair
    vocab_out = 0 if stage.objective == "reward" else vocab  # a reward model's head has one output
    tokens_micro = stage.micro_batch_size * seq * per_pair
    kv_dim = m.kv_heads * m.head_dim
    per_token_layer = 2 * (8 * m.hidden + 2 * kv_dim + 4 * m.ffn)
    # a checkpointed block keeps its bf16 input, the others everything; backward recomputes a checkpointed block
    # after the blocks above it have freed theirs (`held_blocks`)
    recomputed = recomputed_blocks(stage, m.layers)
    activations = tokens_micro * (recomputed * 2 * m.hidden + held_blocks(stage, m.layers) * per_token_layer)
    shard = min(stage.shard_size or gpus, gpus)
    memory = {
        "params+grads+adam (sharded)": 16 * params / shard / GB,
        **({"unsharded gradients (synced once a step)": 4 * params / GB}
           if stage.gradient_sync == "last_micro_batch" else {}),
        "gathered layers": 4 * block / GB,
        "activations": activations / GB,
        "root module (unsharded)": 4 * (vocab * m.hidden + vocab_out * m.hidden * (0 if m.tied else 1) + m.hidden)
        / GB,
        "logits": 4 * tokens_micro * vocab_out / GB,
        "loss chunk (fp32)": 12 * min(tokens_micro, LOSS_CHUNK_POSITIONS) * vocab_out / GB,
        **attention_memory(stage, recipe, m, seq),
        "headroom": hw.headroom_gb,
    }
    total = sum(memory.values())
    fits = total <= hw.gpu_memory_gb
    advice = "" if fits or not advise else _advice(stage, memory, hw, _least_recompute_that_fits(stage, recipe, m))

    tokens_per_step = stage.global_batch_size * seq * per_pair
    flops_per_token = model_flops_per_token(m.hidden, m.ffn, m.layers, m.heads, m.kv_heads, m.head_dim, vocab_out, seq)
    if stage.objective == "dpo":
        flops_per_token *= 4 / 3  # the reference pass over the same pairs: one more forward
    # what the GPUs run: a step's sequences, and a filler pass for every micro-batch slot left without one
    rows = stage.global_batch_size + fillers_per_step(stage.global_batch_size, stage.micro_batch_size, gpus)
    step_flops = rows * seq * per_pair * flops_per_token
    train_time = step_flops / (gpus * hw.peak_tflops * 1e12 * hw.mfu)
    prompts = stage.global_batch_size // stage.num_generations if stage.objective == "grpo" else 0
    rollout = rollout_seconds(stage, m, hw, seq, prompts) if prompts else 0.0
    measured = hw.reported_rollout_s.get(stage.name)
    decode_utilization = implied_decode_utilization(stage, m, hw, seq, prompts, measured) if measured else None
    wall = stage_seconds(stage, train_time, rollout)
    step_time = wall / stage.steps
    gpu_hours = wall * (gpus + stage.engine_gpus(True) + served_gpus(stage, recipe)) / 3600
    energy_kwh = gpu_hours * hw.watts_per_gpu / 1000
    tokens = stage.steps * tokens_per_step
    reported = hw.reported_gpu_hours.get(stage.name)
    # the hours a past run reported also paid for its rollouts and the GPUs held beside its workers: as planned
    extra_hours = gpu_hours - stage.steps * train_time * gpus / 3600
    implied = stage.steps * step_flops / ((reported - extra_hours) * 3600 * hw.peak_tflops * 1e12) \
        if reported and reported > extra_hours else None
    nodes = -(-gpus // hw.gpus_per_node)
    return StagePlan(stage.name, gpus, seq, tokens_per_step, memory, fits, advice, step_time, gpu_hours,
                     gpu_hours * hw.usd_per_gpu_hour, energy_kwh, tokens / (energy_kwh * 3.6e6),
                     tokens / gpu_hours, implied,
                     checkpoint_s=12 * params / (hw.storage_write_gb_per_s * 1e9),  # fp32 weights + 2 moments
                     rollout_s=rollout, longest_step_s=train_time + rollout, nodes=nodes,
                     implied_decode_utilization=decode_utilization,
                     notes=(_multi_node_notes(stage, recipe, m, nodes)
                            + _sampling_notes(stage, recipe, m, seq, rollout) + _unimplied_note(reported, implied)
                            + _measured_rollout_note(stage, m, hw, seq, prompts, measured, decode_utilization)
                            if advise and fits else ()))


def _unimplied_note(reported: float | None, implied: float | None) -> tuple[str, ...]:
    if not reported or implied is not None:
        return ()
    return (f"the {figure(reported)} GPU-hours reported are no more than the plan's rollouts and the GPUs held "
            "beside the workers take: no training MFU can be implied from them",)


def served_gpus(stage: TrainStageConfig, recipe: Recipe) -> int:
    """GPUs the reward models and judges a sampled stage serves hold for the whole stage: a GPU per reward model,
    and the replicas in use of each engine the judges run on, as the recipe's `serve` sizes them (more while they
    scale up under load); judges that are LoRA stages of one checkpoint share its engine."""
    engines = {recipe.engine_serving(name) for name in stage.judge_stages}
    return len(stage.reward_models_named) + len(engines) * recipe.serve.replicas_in_use * recipe.serve.replica_gpus


def rollout_seconds(stage: TrainStageConfig, m: Dims, hw: PlanConfig, seq: int, prompts: int,
                    decode_utilization: float | None = None) -> float:
    """One rollout of `num_generations` completions for each of `prompts` prompts on the stage's engines, at most
    (see the module's docstring); an engine samples whole prompts. `decode_utilization`: in place of the plan's
    decode_bandwidth_utilization."""
    tp, out = stage.rollout.tensor_parallel, stage.max_completion_length
    prompt = max(seq - out, 0)
    per_engine = -(-prompts // stage.rollout.engines) * stage.num_generations
    waves = -(-per_engine // ENGINE_MAX_SEQS)
    batch = -(-per_engine // waves)
    params = parameter_count(m)[0]
    flops_per_s = tp * hw.peak_tflops * 1e12 * hw.mfu
    bytes_per_s = tp * hw.memory_tb_per_s * 1e12 * (decode_utilization or hw.decode_bandwidth_utilization)
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * 2  # K and V of every layer, bf16
    prefill = 2 * params * batch * prompt / flops_per_s
    decode_step = max((2 * params + batch * (prompt + out / 2) * kv_per_token) / bytes_per_s,
                      2 * params * batch / flops_per_s)
    return waves * (prefill + out * decode_step)


def implied_decode_utilization(stage: TrainStageConfig, m: Dims, hw: PlanConfig, seq: int, prompts: int,
                               measured_s: float) -> float | None:
    """The share of `memory_tb_per_s` at which the plan's rollout bound takes `measured_s`; None where the bound is
    longer even at the whole bandwidth (the completions ended early, or the decoding is bound by compute). The bound
    falls as the share grows: bisected on its logarithm."""
    if rollout_seconds(stage, m, hw, seq, prompts, 1.0) > measured_s:
        return None
    low, high = 1e-9, 1.0
    for _ in range(100):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if rollout_seconds(stage, m, hw, seq, prompts, mid) > measured_s else (low, mid)
    return high


def _measured_rollout_note(stage: TrainStageConfig, m: Dims, hw: PlanConfig, seq: int, prompts: int,
                           measured_s: float | None, utilization: float | None) -> tuple[str, ...]:
    if not measured_s:
        return ()
    said = f"the {figure(measured_s)} s a past run's rollouts took (plan.reported_rollout_s)"
    if utilization is None:
        fastest = rollout_seconds(stage, m, hw, seq, prompts, 1.0)
        return (f"{said} are less than the plan's bound at the whole of memory_tb_per_s ({figure(fastest)} s): its "
                "completions ended before max_completion_length, or its batch differs from this stage's",)
    return (f"{said} imply decoding at {figure(100 * utilization)}% of memory_tb_per_s for this batch (the plan "
            f"assumes {hw.decode_bandwidth_utilization:.0%}: set plan.decode_bandwidth_utilization to plan with it)",)


def stage_seconds(stage: TrainStageConfig, train_step_s: float, rollout_s: float) -> float:
    """The stage's wall time: its steps, and a rollout before every `num_iterations` of them. Asynchronous, the
    first rollout is waited for on its own and each later one is sampled during the last step on the rollout before
    it (the step that starts it): that step takes the longer of the two."""
    if not rollout_s:
        return stage.steps * train_step_s
    k = stage.num_iterations
    rollouts = -(-stage.steps // k)
    if stage.async_rollout:  # a stage with rollouts is a GRPO stage
        overlapped = rollouts - 1
        return (rollout_s + overlapped * ((k - 1) * train_step_s + max(train_step_s, rollout_s))
                + (stage.steps - overlapped * k) * train_step_s)
    return stage.steps * train_step_s + rollouts * rollout_s


def _sampling_notes(stage: TrainStageConfig, recipe: Recipe, m: Dims, seq: int, rollout: float) -> tuple[str, ...]:
    """What the plan of a stage that samples estimates (`rollout`: GRPO's, as planned), and what it leaves out."""
    if stage.objective == "grpo":
        apart = stage.engine_gpus(True)
        notes = [f"rollouts: at most {figure(rollout)} s each on {stage.rollout.engines} engine(s), one per "
                 f"{stage.num_iterations} step(s)" + (", each overlapping the last step on the one before"
                                                        if stage.async_rollout else "") + ", in the step time"
                 + (f"; the engines' {apart} GPU(s) of their own are in the GPU-hours" if apart else "")
                 + "; weight pushes and engines waking are not"]
    elif getattr(stage, "on_policy", False):
        per_thousand = rollout_seconds(stage, m, recipe.plan, seq, 1000)
        notes = [f"samples its pairs once before training, about {figure(per_thousand)} s per 1,000 task prompts "
                 f"({stage.num_generations} completions each) on {stage.rollout.engines} engine(s): not in the "
                 "step time or GPU-hours (the plan does not read the tasks file)"]
    else:
        return ()
    if served := served_gpus(stage, recipe):
        notes.append(f"the reward models and judges it serves hold {served} GPU(s) of their own for the whole "
                     "stage, in the GPU-hours (judges at serve.min_replicas, one at least: more while they scale up; "
                     "judges on one engine count once)")
    return tuple(notes)


def _multi_node_notes(stage: TrainStageConfig, recipe: Recipe, m: Dims, nodes: int) -> tuple[str, ...]:
    """For a stage spanning nodes: the HSDP shard group to set (the fewest whole nodes whose GPUs hold the sharded
    state with the step, and that divide every worker count of the stage), and a warning when NCCL between nodes
    would run over TCP."""
    if nodes < 2:
        return ()
    hw, notes = recipe.plan, []
    low, high = stage.worker_range
    if not stage.shard_size:
        for k in range(hw.gpus_per_node, high, hw.gpus_per_node):
            if low % k == 0 and high % k == 0 and \
                    plan_stage(stage.model_copy(update={"shard_size": k}), recipe, m, advise=False).fits:
                notes.append(f"set shard_size: {k} (HSDP: each weight split over {k} GPUs and copied "
                             f"{high // k}×, so the per-layer all-gathers stay within a node's links and one "
                             "gradient all-reduce a step crosses nodes)")
                break
    if hw.interconnect == "tcp":
        notes.append(f"WARNING: {nodes} nodes linked by TCP (plan.interconnect: tcp): NCCL over sockets can spend "
                     "most of a step in the collectives between nodes at this size; use nodes with EFA or InfiniBand "
                     "(cluster.yaml and deploy/kuberay wire EFA) and set plan.interconnect; the first step logs the "
                     "transport NCCL chose on each node")
    return tuple(notes)


def attention_memory(stage: TrainStageConfig, recipe: Recipe, m: Dims, seq: int) -> dict[str, float]:
    """What the attention kernel keeps beyond FlashAttention's nothing: with packed documents (pretraining with
    document_masking, packed SFT) sdpa gets a boolean block-diagonal mask of seq² per sequence (flex_attention a
    block-sparse one of (seq/128)², nothing to count); eager also keeps each layer's bf16 attention probabilities,
    heads × seq² per sequence, for the backward pass."""
    kernel = recipe.model.attn_implementation
    sequences = stage.micro_batch_size * (2 if stage.objective in ("dpo", "reward") else 1)
    packed = stage.objective == "sft" or (stage.objective == "pretrain" and stage.document_masking)
    out = {}
    if kernel in ("sdpa", "eager") and packed:
        out["attention mask"] = sequences * seq * seq / GB
    if kernel == "eager":
        kept = held_blocks(stage, m.layers)
        out["attention scores"] = kept * sequences * m.heads * seq * seq * 2 / GB
    return out


RESIDENT = ("params+grads+adam (sharded)", "unsharded gradients (synced once a step)", "headroom")


def step_transient_gb(plan: StagePlan) -> float:
    """What a training step adds on a GPU above the sharded weights, gradients and AdamW state: activations, the
    logits and the loss's chunk, the gathered blocks and root module, attention masks. A rollout engine colocated
    with the worker must leave this free."""
    return sum(v for k, v in plan.memory_gb.items() if k not in RESIDENT)


def step_transient_bytes(stage: TrainStageConfig, recipe: Recipe, dims: Dims, sequence_tokens: int) -> int:
    """`step_transient_gb` in bytes for sequences of `sequence_tokens` (GRPO pads to its longest prompt and
    completion, not to seq_len)."""
    at = stage.model_copy(update={"seq_len": sequence_tokens}) if "seq_len" in type(stage).model_fields else stage
    return int(step_transient_gb(plan_stage(at, recipe, dims, advise=False)) * GB)


@dataclass(frozen=True)
class StepTransient:
    """`step_transient_bytes` of one stage as the function its training workers call with a sequence's tokens. Its
    repr names the stage only: Ray Train keeps the text of what its workers are given in its run state, and the
    recipe may hold storage credentials."""
    stage: TrainStageConfig
    recipe: Recipe
    dims: Dims

    def __call__(self, sequence_tokens: int) -> int:
        return step_transient_bytes(self.stage, self.recipe, self.dims, sequence_tokens)

    def __repr__(self) -> str:
        return f"StepTransient(stage={self.stage.name!r})"


def recomputed_blocks(stage: TrainStageConfig, layers: int) -> int:
    """Blocks checkpointed (recomputed in the backward pass): one in every `recompute_every`, from the first."""
    return -(-layers // stage.recompute_every) if stage.recompute_every else 0


def held_blocks(stage: TrainStageConfig, layers: int) -> int:
    """The most blocks whose full activations are held at once: the uncheckpointed ones after the forward pass, or,
    while the top checkpointed block is recomputed, it and the uncheckpointed ones below it."""
    r, k = recomputed_blocks(stage, layers), stage.recompute_every
    return layers if r == 0 else max(layers - r, (k - 1) * (r - 1) + 1)


def _least_recompute_that_fits(stage: TrainStageConfig, recipe: Recipe, m: Dims) -> int | None:
    """The largest k (the fewest blocks recomputed) with which checkpointing every k-th block fits, if any beyond
    what the stage does."""
    current = stage.recompute_every or m.layers + 1
    for k in range(min(current - 1, m.layers), 0, -1):
        every = {"activation_checkpointing": k if k > 1 else True}
        if plan_stage(stage.model_copy(update=every), recipe, m, advise=False).fits:
            return k
    return None


def _advice(stage: TrainStageConfig, memory: dict[str, float], hw: PlanConfig, recompute: int | None = None) -> str:
    biggest = max(memory, key=memory.get)
    over = sum(memory.values()) - hw.gpu_memory_gb
    tips = []
    if recompute is not None and biggest == "activations":
        tips.append("set activation_checkpointing: " + ("true" if recompute == 1 else
                                                         f"{recompute} (one block in {recompute} recomputed: the "
                                                         "least recompute that fits)"))
    elif not stage.activation_checkpointing and biggest == "activations":
        tips.append("set activation_checkpointing: true")
    if stage.micro_batch_size > 1 and biggest in ("activations", "logits"):
        tips.append("lower micro_batch_size (gradient accumulation keeps global_batch_size)")
    if biggest == "params+grads+adam (sharded)":
        tips.append("shard over more GPUs (num_workers)")
    if biggest == "logits" and stage.micro_batch_size == 1:
        tips.append("use a shorter seq_len or a chunked loss")
    if biggest in ("attention mask", "attention scores"):
        tips.append("set model.attn_implementation: flex_attention, or flash_attention_2 where flash-attn is "
                    "installed (packed documents without a seq² mask)")
    tips = tips or ["use GPUs with more memory, or more of them"]
    return (f"needs {sum(memory.values()):.1f} GB per GPU, {over:.1f} GB over the {hw.gpu_memory_gb:.0f} GB of a "
            f"{hw.gpu} ({biggest} is the largest part): " + "; ".join(tips))


def plan(recipe: Recipe, hf_config: dict | None = None) -> list[StagePlan]:
    dims = Dims.of(recipe, hf_config)
    return [plan_stage(s, recipe, dims) for s in recipe.train]
