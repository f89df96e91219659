"""`amalia plan`: what each training stage of a recipe will need and cost on the cluster it names, before any GPU-hour
is spent — memory per GPU under FSDP2, step time at a stated MFU, GPU-hours, cost and energy — and which stages
cannot fit, with what to change.

Memory per GPU (bytes; P parameters, N GPUs = the stage's workers, L layers, T tokens per micro-batch):
- sharded training state, FSDP2 over all N: fp32 parameters, fp32 gradients and AdamW's two fp32 moments,
  16·P / N;
- unsharded layers in flight: the bf16 all-gathered parameters of the current and the prefetched decoder block,
  2 · 2 · P_layer;
- activations (bf16, FlashAttention-style attention that stores no s×s matrix): per token and layer the inputs the
  backward pass keeps — two norms' inputs and outputs, q/k/v, the attention output, the residual, and the MLP's gate,
  up, activation and down inputs: 2·(8h + 2·kv_dim + 4·ffn) bytes. Without activation checkpointing all L layers keep
  them; with it each layer keeps only its input (2h) and one layer's worth is rebuilt at a time;
- logits: T·V in bf16 plus their fp32 softmax gradient, 6·T·V.
DPO micro-batches hold a chosen and a rejected sequence per pair (2× tokens).

Step time = tokens per step × FLOPs per token / (N · peak · MFU), FLOPs per token = 6P + 6·L·h·s (causal attention),
8P instead of 6P with activation checkpointing (the forward runs twice). DPO adds its reference pass (a forward,
2P per token, over the same pairs). GRPO's generation time depends on the rollout engine and is not included.
"""

from __future__ import annotations

from dataclasses import dataclass

from amalia_ray.core.config import ModelConfig, PlanConfig, Recipe, TrainStageConfig

GB = 1024**3


def parameter_count(m: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """(total parameters, parameters of one decoder block) of the Llama the recipe builds."""
    head_dim = m.hidden_size // m.num_heads
    kv_dim = m.num_kv_heads * head_dim
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv_dim
    block = attention + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    embeddings = vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * block + embeddings + m.hidden_size, block


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

    @property
    def total_memory_gb(self) -> float:
        return sum(self.memory_gb.values())


def plan_stage(stage: TrainStageConfig, recipe: Recipe) -> StagePlan:
    m, hw = recipe.model, recipe.plan
    vocab = recipe.tokenizer.vocab_size
    params, block = parameter_count(m, vocab)
    gpus = stage.worker_range[1]
    seq = stage.seq_len or (recipe.pack.seq_len if stage.objective == "pretrain" else m.max_position_embeddings)
    per_pair = 2 if stage.objective == "dpo" else 1
    tokens_micro = stage.micro_batch_size * seq * per_pair
    kv_dim = m.num_kv_heads * (m.hidden_size // m.num_heads)
    per_token_layer = 2 * (8 * m.hidden_size + 2 * kv_dim + 4 * m.intermediate_size)
    if stage.activation_checkpointing:
        activations = tokens_micro * (m.num_layers * 2 * m.hidden_size + per_token_layer)
    else:
        activations = tokens_micro * m.num_layers * per_token_layer
    memory = {
        "params+grads+adam (sharded)": 16 * params / gpus / GB,
        "gathered layers": 4 * block / GB,
        "activations": activations / GB,
        "logits": 6 * tokens_micro * vocab / GB,
        "headroom": hw.headroom_gb,
    }
    total = sum(memory.values())
    fits = total <= hw.gpu_memory_gb
    advice = "" if fits else _advice(stage, memory, hw)

    tokens_per_step = stage.global_batch_size * seq * per_pair
    flops_per_token = (8 if stage.activation_checkpointing else 6) * params + 6 * m.num_layers * m.hidden_size * seq
    if stage.objective == "dpo":
        flops_per_token += 2 * params  # the reference pass over the same pairs
    step_flops = tokens_per_step * flops_per_token
    step_time = step_flops / (gpus * hw.peak_tflops * 1e12 * hw.mfu)
    gpu_hours = stage.steps * step_time * gpus / 3600
    energy_kwh = gpu_hours * hw.watts_per_gpu / 1000
    tokens = stage.steps * tokens_per_step
    reported = hw.reported_gpu_hours.get(stage.name)
    implied = stage.steps * step_flops / (reported * 3600 * hw.peak_tflops * 1e12) if reported else None
    return StagePlan(stage.name, gpus, seq, tokens_per_step, memory, fits, advice, step_time, gpu_hours,
                     gpu_hours * hw.usd_per_gpu_hour, energy_kwh, tokens / (energy_kwh * 3.6e6),
                     tokens / gpu_hours, implied)


def _advice(stage: TrainStageConfig, memory: dict[str, float], hw: PlanConfig) -> str:
    biggest = max(memory, key=memory.get)
    over = sum(memory.values()) - hw.gpu_memory_gb
    tips = []
    if not stage.activation_checkpointing and biggest == "activations":
        tips.append("set activation_checkpointing: true")
    if stage.micro_batch_size > 1 and biggest in ("activations", "logits"):
        tips.append("lower micro_batch_size (gradient accumulation keeps global_batch_size)")
    if biggest == "params+grads+adam (sharded)":
        tips.append("shard over more GPUs (num_workers)")
    if biggest == "logits" and stage.micro_batch_size == 1:
        tips.append("use a shorter seq_len or a chunked loss")
    tips = tips or ["use GPUs with more memory, or more of them"]
    return (f"needs {sum(memory.values()):.1f} GB per GPU, {over:.1f} GB over the {hw.gpu_memory_gb:.0f} GB of a "
            f"{hw.gpu} ({biggest} is the largest part): " + "; ".join(tips))


def plan(recipe: Recipe) -> list[StagePlan]:
    return [plan_stage(s, recipe) for s in recipe.train]
