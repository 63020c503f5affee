"""Next-token cross-entropy, computed in chunks of tokens so the [T, vocab] fp32 logits never exist whole.

Legend: T tokens of one packed row, D hidden, V vocabulary, C chunk tokens.

    h = model.model(input_ids, cu_seqlens=cu_seqlens)                 [1, T, D] final hidden state
    loss_sum = sum over chunks of  CE( float(lm_head(h[c])), labels[c] )   (sum over non-ignored tokens)

Each chunk runs under `torch.utils.checkpoint`: forward keeps only the chunk's hidden rows (a view of h), and
backward recomputes that chunk's logits, so peak logits memory is [C, V] instead of [T, V] (K3: 163,840 x 4
bytes = 640 KB per token, i.e. 2.6 GB for a 4096-token row). The loss is a SUM; the step divides by the
global number of target tokens, so micro-batches and ranks add up to the global-batch mean.

Which tokens are targets is decided by the labels alone: IGNORE_INDEX marks a document's first token and every
token outside a chat document's assistant turns (train/data.py), and such a position adds nothing to the sum or
its gradient (`tests/train/test_chat_data.py` checks the gradient is exactly zero there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kimik3.model import K3ForCausalLM
from kimik3.train.data import IGNORE_INDEX


def _chunk_ce(h_CD: Tensor, weight_VD: Tensor, labels_C: Tensor) -> Tensor:
    logits_CV = F.linear(h_CD, weight_VD)  # compute dtype (bf16 under autocast), as the model's lm_head
    return F.cross_entropy(logits_CV.float(), labels_C, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """Sum of next-token CE over tokens whose label is not IGNORE_INDEX; fp32 scalar.

    Args:
        hidden: [..., D] final hidden states (any leading dims, flattened to T).
        weight: [V, D] the LM head weight.
        labels: [...] int64 targets (the input shifted by one), IGNORE_INDEX where there is none.
        chunk_tokens: C; a chunk's logits are recomputed in backward instead of stored.
    """
    if chunk_tokens < 1:
        raise ValueError(f"train.loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    h_TD, labels_T = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = h_TD.new_zeros((), dtype=torch.float32)
    for start in range(0, h_TD.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_ce, h_TD[start:end], weight, labels_T[start:end], use_reentrant=False)
    return total


def plain_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """The unchunked reference: sum of CE over all [..., V] logits in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class CausalLMLoss(nn.Module):
    """The training objective as a module: forward(input_ids, labels, cu_seqlens) -> summed CE (fp32 scalar).

    It owns the language model (`self.lm`, unchanged), so one FSDP root covers the embeddings, the output
    norm and the LM head, which the chunked loss calls outside `K3ForCausalLM.forward`.
    """

    def __init__(self, lm: K3ForCausalLM, chunk_tokens: int = 1024):
        super().__init__()
        self.lm, self.chunk_tokens = lm, chunk_tokens

    def forward(self, input_ids: Tensor, labels: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        hidden = self.lm.model(input_ids, cu_seqlens=cu_seqlens)
        return chunked_cross_entropy(hidden, self.lm.lm_head.weight, labels, self.chunk_tokens)
