"""One-shot GPU check (run where a CUDA GPU is lent): packed documents attend only within themselves under each
attention kernel training offers (flex_attention compiled, as training runs it), and the model builder accepts
flash_attention_2 there. Prints JSON.

    .venv/bin/python bench/gpu/packed_attention.py      # needs CUDA; flash-attn for the flash_attention_2 row

For each kernel: two documents packed into one row with positions restarting at the second (as pretraining with
document_masking and packed SFT feed them) must give the second document the same logits as when it is alone.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import is_flash_attn_2_available

    from amalia_ray.train.model import check_attention

    device = torch.device("cuda")
    base = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    first, second = torch.randint(0, 1000, (1, 100)), torch.randint(0, 1000, (1, 156))
    packed = torch.cat([first, second], dim=1).to(device)
    positions = torch.cat([torch.arange(100), torch.arange(156)]).unsqueeze(0).to(device)
    rows = []
    kernels = ["eager", "sdpa", "flex_attention"] + (["flash_attention_2"] if is_flash_attn_2_available() else [])
    for kernel in kernels:
        check_attention(kernel, device)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(base, attn_implementation=kernel, dtype=torch.bfloat16).to(device)
        with torch.no_grad():
            together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0, 100:].float()
            alone = model(input_ids=second.to(device), use_cache=False).logits[0].float()
        diff = (together - alone).abs().max().item()
        rows.append({"kernel": kernel, "max_logit_difference": diff, "isolated": diff < 0.05})
    print(json.dumps({"device": torch.cuda.get_device_name(), "flash_attn_installed": is_flash_attn_2_available(),
                      "kernels": rows}, indent=1))
    return 0 if all(r["isolated"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
