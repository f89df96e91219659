"""The `model` section of a recipe: a new model's dimensions, or the base model a run starts from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from amalia_ray.core.config.strict import Strict


DIMENSIONS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "max_position_embeddings", "rope_theta", "tie_word_embeddings")


class ModelConfig(Strict):
    """Either a base model to start from (`from`: its config gives the architecture and sizes), or the dimensions of
    a new Llama trained from random weights."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: str | None = Field(
        None, alias="from", description="a Hugging Face causal LM to start from: hub id (e.g. utter-project/EuroLLM-9B) "
        "or local folder (as save_pretrained writes it); its config.json gives architecture, sizes and RoPE")
    revision: str | None = Field(None, description="from: a hub branch, tag or commit (default: main)")
    trust_remote_code: bool = Field(False, description="from: allow the model repository's own Python code")
    config_file: str | None = Field(
        None, description="from: a copy of the base model's config.json (relative to the recipe) that `amalia plan` "
        "and `amalia validate` read instead of fetching it, so they work offline")
    architecture: Literal["llama"] = Field("llama", description="a new model's architecture (transformers' Llama)")
    hidden_size: int = Field(256, ge=8, description="a new model: width of the residual stream")
    intermediate_size: int = Field(768, ge=8, description="a new model: width of the MLP")
    num_layers: int = Field(4, ge=1, description="a new model: decoder blocks")
    num_heads: int = Field(4, ge=1, description="a new model: attention heads")
    num_kv_heads: int = Field(4, ge=1, description="a new model: key/value heads (fewer than num_heads: GQA)")
    max_position_embeddings: int = Field(512, ge=8, description="a new model: longest sequence")
    rope_theta: float = Field(10000.0, description="a new model: RoPE base frequency")
    tie_word_embeddings: bool = Field(False, description="a new model: the LM head shares the embedding matrix")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling for context extension, in the architecture's config.json terms, e.g. "
        "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 8192} (also linear, dynamic, llama3); "
        "max_position_embeddings follows factor × the original unless set")
    attn_implementation: Literal["sdpa", "flex_attention", "flash_attention_2", "eager"] = Field(
        "sdpa", description="attention kernel of training (transformers' name); packed documents attend only within "
        "themselves with each: sdpa and eager through a seq² mask, flex_attention through torch's block-sparse mask "
        "(no seq² memory, no extra package; compiled once per worker; GPU only: torch has no FlexAttention backward "
        "pass on CPU), flash_attention_2 varlen via position ids "
        "(needs the flash-attn package and a GPU)")

    @property
    def base(self) -> str | None:
        return self.from_

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError("model.rope_scaling needs rope_type (linear, dynamic, yarn, llama3, ...)")
        if self.from_:
            if given := [f for f in DIMENSIONS if f in self.model_fields_set]:
                raise ValueError(f"model: from names a base model whose config.json gives the dimensions; remove "
                                 f"{given} (or drop from to build a new model)")
            return self
        if self.revision or self.config_file or self.trust_remote_code:
            raise ValueError("model: revision, config_file and trust_remote_code apply to a base model (from)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self
