"""The model a training stage builds: its transformers config (a new Llama from the recipe's dimensions, or a base
model's own config.json), and the module itself — materialized shard by shard when weights are loaded, so no
worker ever holds the whole model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from amalia_ray.core.config import LoraConfig, ModelConfig
from amalia_ray.core.hf_model import with_overrides
from amalia_ray.core.errors import AmaliaError
from amalia_ray.train.heads import auto_class

# families whose checkpoints the tests train, export and serve; any other decoder-only causal LM whose blocks sit
# at `model.model.layers` is sharded the same way
TESTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")


def llama_config(cfg: ModelConfig, vocab_size: int, bos_id: int, eos_ids: list[int], pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )


def config_from_dict(config_dict: dict, trust_remote_code: bool = False, source: str | None = None):
    """A transformers config from its dict (as `hf_config` travels to the workers)."""
    from transformers import AutoConfig

    if trust_remote_code and source:  # the model's own config class lives in its repository
        extra = {k: v for k, v in config_dict.items() if k not in ("auto_map", "architectures", "model_type")}
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **extra)
    d = dict(config_dict)
    attn = d.pop("attn_implementation", None)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    if attn:
        config._attn_implementation = attn
    return config


def base_config(cfg: ModelConfig, folder: Path) -> dict:
    """The base model's config.json with the recipe's overrides, as a plain dict."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    return with_overrides(config.to_dict(), cfg)


@contextlib.contextmanager
def parameters_on_meta():
    """Create parameters on the meta device (no memory) while buffers — RoPE's inverse frequencies, embedding
    scales — are computed for real on the CPU as the model's own __init__ defines them (they are not in a
    checkpoint). The same idea as accelerate's init_empty_weights(include_buffers=False)."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def instantiate(config, *, empty: bool, trust_remote_code: bool = False, head: str = "lm"):
    """The causal LM (or, with head "score", the sequence classifier) of `config`: random weights (seeded by the
    caller), or with `empty` parameters on meta, to be sharded and then filled from a checkpoint."""
    with parameters_on_meta() if empty else contextlib.nullcontext():
        try:
            model = auto_class(head).from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
        except ValueError as e:
            if "Unrecognized configuration class" in str(e):
                raise AmaliaError(unsupported(getattr(config, "model_type", "?"))) from None
            raise
    check_shardable(model)
    return model


def unsupported(model_type: str) -> str:
    return (f"model type '{model_type}' is not a decoder-only causal LM that training can shard (its decoder "
            f"blocks at model.model.layers); supported: {', '.join(TESTED_FAMILIES)} and other transformers causal "
            "LMs built the same way")


def check_shardable(model) -> None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise AmaliaError(unsupported(getattr(model.config, "model_type", type(model).__name__)))


def check_config(config_dict: dict, trust_remote_code: bool = False, source: str | None = None):
    """Fail before any work starts when the architecture cannot be trained: built on the meta device (no memory).
    Returns the transformers config."""
    # the attention kernel is the worker nodes' concern (flash-attn is installed on GPU nodes, not where a recipe
    # is checked): the architecture is checked with the default one
    config_dict = {**config_dict, "attn_implementation": "sdpa"}
    with torch.device("meta"):
        config = config_from_dict(config_dict, trust_remote_code, source)
        instantiate(config, empty=False, trust_remote_code=trust_remote_code)
    return config


def materialize(model, device: torch.device) -> None:
    """Allocate the (sharded) meta parameters on `device`, uninitialized, keeping the buffers computed at
    construction (`to_empty` alone would wipe them too)."""
    buffers = {name: b for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = value.to(device)


def check_attention(kernel: str | None, device: torch.device) -> None:
    """flash_attention_2 runs on CUDA with the flash-attn package, and flex_attention trains on CUDA only (torch's
    compiled FlexAttention, which transformers runs, is inference-only on CPU); anywhere else they fail here in one
    line instead of inside transformers' model construction or the first backward pass."""
    if kernel == "flex_attention" and device.type != "cuda":
        raise AmaliaError(f"model.attn_implementation flex_attention trains on CUDA GPUs only: torch "
                          f"{torch.__version__}'s compiled FlexAttention, which transformers runs, has no backward pass "
                          f"on {device.type}; "
                          "use sdpa there")
    if kernel != "flash_attention_2":
        return
    from transformers.utils import is_flash_attn_2_available

    if device.type != "cuda" or not is_flash_attn_2_available():
        found = f"device {device.type}, flash-attn {'installed' if is_flash_attn_2_available() else 'not installed'}"
        raise AmaliaError(f"model.attn_implementation flash_attention_2 needs CUDA GPUs and the flash-attn package on "
                          f"every training node ({found}); use sdpa elsewhere")


def build(config, device: torch.device, shard, *, init_dir: Path | None, seed: int,
          trust_remote_code: bool = False, new_token_ids: list[int] | None = None, lora: LoraConfig | None = None,
          head: str = "lm"):
    """The training model, sharded by `shard(model)` while its parameters are on the meta device, so that no rank
    ever holds the whole model: random weights from `seed` for a new model (transformers' initialization, module
    by module, each rank keeping its shard), or the checkpoint in `init_dir` (a base model or the previous stage's
    export) read shard by shard into each rank, the rows of `new_token_ids` (an extended vocabulary) starting at
    the mean of the checkpoint's. With `lora`, PEFT's adapters are added before sharding and everything else is
    frozen. With head "score" (a reward model) a causal LM's checkpoint gives the decoder, its LM head is left out,
    and a score head it lacks starts from `seed`."""
    from amalia_ray.train import lora as adapters
    from amalia_ray.train.hf_weights import init_new, load_sharded

    check_attention(getattr(config, "_attn_implementation", None), device)

    model = instantiate(config, empty=True, trust_remote_code=trust_remote_code, head=head)
    if lora:
        adapters.add_adapters(model, lora)
    shard(model)
    materialize(model, device)
    if init_dir is None:
        init_new(model, seed)
    else:
        load_sharded(model, Path(init_dir), new_token_ids, seed)
    if lora:
        adapters.init_adapters(model, seed)
    return model
