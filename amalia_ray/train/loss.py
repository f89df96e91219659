"""Log-probabilities of target tokens from a language model's logits, a chunk of positions at a time.

At a 128 k vocabulary and 32 k tokens per micro-batch the logits alone are 8 GB in bf16; a plain cross-entropy
adds an fp32 copy and an fp32 log-softmax of the same size for the backward pass. Here each chunk of positions is
upcast and reduced on its own, under activation checkpointing, so what stays alive for the backward pass is the
logits themselves and one chunk's fp32 work at a time (recomputed in the backward pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from amalia_ray.core.config import LOSS_CHUNK_POSITIONS as CHUNK_POSITIONS  # 2048 × 128 k × 4 B = 1 GB at once


def _chunk_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    x = logits.float() if temperature == 1.0 else logits.float() / temperature
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)


def target_logps(logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_POSITIONS,
                 temperature: float = 1.0) -> torch.Tensor:
    """(..., vocab) logits and (...) target ids in [0, vocab) -> (...) fp32 log-probabilities of the targets, under
    softmax(logits / temperature) (the distribution a rollout sampled from; divided a chunk at a time, so no scaled
    copy of the whole logits is made). Under autograd only the logits are kept for the backward pass: each chunk's
    fp32 work is recomputed there."""
    flat, wanted = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    parts = []
    for i in range(0, flat.size(0), chunk):
        piece, ids = flat[i:i + chunk], wanted[i:i + chunk]
        parts.append(checkpoint(_chunk_logps, piece, ids, temperature, use_reentrant=False)
                     if torch.is_grad_enabled() and piece.requires_grad else _chunk_logps(piece, ids, temperature))
    return torch.cat(parts).reshape(targets.shape)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of each position against the next label (-100: not a target), and the target count.
    The labels are shifted, not the logits: slicing (batch, length, vocab) logits would copy them, forward and back."""
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    counted = targets != -100
    logps = target_logps(logits, targets.clamp(min=0))
    return -(logps * counted).sum(), int(counted.sum())
