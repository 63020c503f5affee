"""Live numbers from a loaded checkpoint and a prompt: expert load, AttnRes depth weights, KDA decay spectra.

One forward of the prompt with light instrumentation; nothing in the model changes:
- expert load: a forward hook on every Router reads its top-k indices (hooks return None, so the forward's
  outputs are untouched); counts per layer sum to tokens x top_k.
- AttnRes depth weights: `attn_res_mix` is wrapped for the duration of the forward (in the decoder's module
  namespace, restored afterwards) and the softmax weights over the sources are recomputed from its inputs
  with the reference formula; mixes are labeled by layer (a pre-hook on each layer) and sublayer.
- KDA decay: a hook on each KDA layer's f_b projection gives the raw gate; the decay exp(g) per head and
  channel follows `ops.kda.reference.gate_inputs` (the op's own activation), and A_h = exp(A_log[:H]).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

import kimik3.model.decoder as decoder_module
from kimik3.model.kda import KimiDeltaAttention
from kimik3.ops.kda.reference import gate_inputs

DECAY_BINS = 20


def mix_weights(blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """The softmax weights over the S = M + 1 sources, mean over tokens: [S] (the reference op's scores)."""
    v_SND = torch.cat([blocks, partial[None]]).float().flatten(1, -2)
    w_D = norm_weight.float() * proj_weight.float().reshape(-1)
    k_SND = v_SND * torch.rsqrt(v_SND.pow(2).mean(-1, keepdim=True) + eps)
    return (k_SND * w_D).sum(-1).softmax(0).mean(1)


@contextmanager
def _recording_mixes(record: list, where: dict):
    real = decoder_module.attn_res_mix

    def wrapped(blocks, partial, norm_weight, proj_weight, eps):
        record.append({"layer": where.get("layer"), "sublayer": where.get("next", "output"),
                       "weights": mix_weights(blocks, partial, norm_weight, proj_weight, eps).tolist()})
        return real(blocks, partial, norm_weight, proj_weight, eps)

    decoder_module.attn_res_mix = wrapped
    try:
        yield
    finally:
        decoder_module.attn_res_mix = real


@torch.no_grad()
def live_numbers(model, token_ids: list[int], prompt: str, source: str) -> dict:
    """Run `token_ids` through `model` (a loaded K3ForConditionalGeneration or K3ForCausalLM) and collect the
    live numbers. `source` names the checkpoint (shown on the page)."""
    lm = model.language_model if hasattr(model, "language_model") else model
    cfg = lm.config
    loads: dict[int, list[int]] = {}
    decays: dict[int, dict] = {}
    mixes: list[dict] = []
    where: dict = {}
    hooks = []
    layers = list(lm.model.layers)
    for i, layer in enumerate(layers):
        def enter(mod, args, i=i):  # the attention mix (if any) comes first, the FFN mix after attention
            where["layer"], where["next"] = i, "attention"

        def after_attention(mod, args, out):
            where["next"] = "ffn"

        def leave(mod, args, out):
            where["layer"], where["next"] = None, "output"

        hooks.append(layer.register_forward_pre_hook(enter))
        hooks.append(layer.self_attn.register_forward_hook(after_attention))
        hooks.append(layer.register_forward_hook(leave))
        if hasattr(layer, "block_sparse_moe"):
            def on_router(mod, args, out, i=i):
                idx = out[0].flatten()
                loads[i] = torch.bincount(idx, minlength=cfg.moe.num_experts).tolist()
            hooks.append(layer.block_sparse_moe.gate.register_forward_hook(on_router))
        if isinstance(layer.self_attn, KimiDeltaAttention):
            attn = layer.self_attn

            def on_gate(mod, args, out, i=i, attn=attn):
                H, K = attn.num_heads, attn.head_dim
                g = out.float().reshape(-1, H, K)[None]  # [1, N, H, K]
                dummy = torch.zeros(1, g.shape[1], H, K)
                _, _, g_act, _ = gate_inputs(dummy, dummy, g, torch.zeros(1, g.shape[1], H), attn.A_log,
                                             attn.dt_bias, attn.lower_bound)
                decay = g_act.exp()[0]  # [N, H, K] in (e^lower_bound, 1)
                lo = float(torch.tensor(attn.lower_bound).exp())
                hist = torch.histc(decay, bins=DECAY_BINS, min=lo, max=1.0)
                decays[i] = {"per_head_mean": decay.mean((0, 2)).tolist(),
                             "histogram": hist.tolist(), "range": [lo, 1.0],
                             "A": attn.A_log[:H].float().exp().tolist()}
            hooks.append(attn.f_b_proj.register_forward_hook(on_gate))
    ids = torch.tensor([token_ids], device=lm.lm_head.weight.device)
    try:
        with _recording_mixes(mixes, where):
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {"source": source, "prompt": prompt, "tokens": len(token_ids),
            "top_k": cfg.moe.num_experts_per_token, "num_experts": cfg.moe.num_experts,
            "expert_load": {str(k): v for k, v in sorted(loads.items())},
            "depth_mixes": mixes, "kda_decay": {str(k): v for k, v in sorted(decays.items())}}


def load_and_run(path: str | Path, prompt: str) -> dict:
    """Load a checkpoint folder (fp32, CPU, text only) and its tokenizer, and run `prompt` through it."""
    from kimik3.checkpoint import load
    from kimik3.tokenizer import Tokenizer

    path = Path(path)
    model = load(path, dtype=torch.float32, device="cpu", text_only=True, quiet=True).eval()
    tok = Tokenizer.from_file(path)
    ids = tok.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty after tokenization")
    return live_numbers(model, ids, prompt, path.name)
