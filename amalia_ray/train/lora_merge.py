"""LoRA adapters merged into their base weights, as PEFT's `merge_and_unload` computes them: plain tensor arithmetic on
a state dict or a stream of tensors, used by the HF export (hf_weights.py) and the rollout engine's weight push."""

from __future__ import annotations

import torch

from amalia_ray.train.weight_names import ADAPTER_MARK, ADAPTER_NAME, BASE_LAYER, base_name, is_adapter, plain_name  # noqa: E501


def scalings(model) -> dict[str, float]:
    """Each LoRA layer's scale (PEFT's alpha / r) by the layer's name without the wrappers' prefixes; empty for a
    model without adapters."""
    return {plain_name(name): float(module.scaling[ADAPTER_NAME]) for name, module in model.named_modules()
            if isinstance(getattr(module, "scaling", None), dict) and ADAPTER_NAME in module.scaling}


class Merger:
    """Turns the adapted model's tensors, fed one at a time in any order, into the merged model's, as PEFT's
    `merge_and_unload` computes them: each LoRA layer's base weight plus scale · B · A under the base weight's own
    name, its bias renamed likewise, everything else as it is. A layer comes out once its three parts are in, so a
    stream (the rollout engine's weight push) holds at most a layer's worth."""

    def __init__(self, layer_scalings: dict[str, float]):
        self.scalings = layer_scalings
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if ".lora_embedding_" in name or ".lora_magnitude_vector" in name:
            raise NotImplementedError(f"merging {name}: only LoRA on linear layers is merged on the fly")
        if BASE_LAYER not in name and not is_adapter(name):
            return [(name, tensor)]
        if name.endswith(BASE_LAYER + ".bias"):
            return [(base_name(name), tensor)]
        layer, part = (name.removesuffix(BASE_LAYER + ".weight"), "W") if name.endswith(BASE_LAYER + ".weight") else (
            name.split(ADAPTER_MARK)[0], "A" if ".lora_A." in name else "B")
        got = self.pending.setdefault(layer, {})
        got[part] = tensor
        if len(got) < 3:
            return []
        del self.pending[layer]
        delta = (got["B"].float() @ got["A"].float()) * self.scalings[layer]
        return [(layer + ".weight", (got["W"].float() + delta).to(got["W"].dtype))]

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"LoRA layers left without all their parts: {sorted(self.pending)[:5]}")


def merged(state: dict[str, torch.Tensor], layer_scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A whole adapted state dict merged (see Merger)."""
    merger, out = Merger(layer_scalings), {}
    for name, tensor in state.items():
        out.update(merger.feed(name, tensor))
    merger.close()
    return out
