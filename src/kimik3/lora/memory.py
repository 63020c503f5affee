"""What LoRA training of a released checkpoint holds, from its config.json and tensor inventory (tensors.json):
the frozen base (MXFP4 routed experts as stored, bf16 and fp32 tensors as stored), the adapter with its gradients
and AdamW states, activations per token, and what does not fit a node's GPUs and must live in host memory.

    rows = lora_memory(json.load(open("config.json")), json.load(open("tensors.json")), rank=16)

Assumptions (stated again in BENCHMARKS.md): text only (no vision tower); factors, their gradients and AdamW's
two moments in fp32 (16 bytes per adapter parameter); activations in bf16 under autocast, counted as every
projection's output of a layer plus its routed rows (z gathered per expert, w1 and w3 outputs, SiTU, w2 output)
and the four AttnRes/norm inputs of width D; kernel-internal saves (KDA chunk states, attention statistics) and
the chunked loss's logits are not counted. With activation checkpointing per decoder layer the backward keeps
each layer's input (D) and the AttnRes block sums, and recomputes one layer at a time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kimik3.config import K3Config
from kimik3.lora.config import SHARING, LoraConfig

# rank-R targets of the LoRA benchmark (bench/bench_lora.py): attention, the dense MLP, shared and routed experts
BENCH_TARGETS = ["*.self_attn.*_proj", "*.self_attn.kv_a_proj_with_mqa", "*.mlp.*_proj", "*.shared_experts.*_proj",
                 "*.block_sparse_moe.experts"]
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "uint8": 1}
ADAPTER_BYTES = 16  # fp32 factor + fp32 gradient + AdamW's two fp32 moments
EXPERT = re.compile(r"^(.*\.experts)\.\{expert\}\.(w[123])\.weight_packed$")


@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""


def _count(t: dict) -> int:
    return len(t.get("layers", [0])) * len(t.get("experts", [0]))


def _concrete(name: str) -> str:
    """A template name with its first layer and expert, for matching targets against released module names."""
    return name.replace("{layer}", "1").replace("{expert}", "0")


def lora_memory(config: dict, inventory: dict, *, rank: int = 16, targets: list[str] | None = None,
                experts: str = "per_expert", rank_scaling: bool = False, gpus: int = 8,
                gpu_bytes: int = 139 * 2**30, tokens: int = 8192) -> dict:
    """Bytes of a LoRA run on a released checkpoint (see the module docstring).

    Args:
        config: the checkpoint's config.json; inventory: its tensors.json ({"tensors": [name templates]}).
        rank, targets, experts, rank_scaling: the adapter (`kimik3.lora.LoraConfig`; targets default to
            BENCH_TARGETS).
        gpus, gpu_bytes: the node (8 H200s; 139 GiB each is what the device reports usable).
        tokens: tokens of one optimizer step's micro-batch on the node (for the activation rows).

    Returns:
        {"rows": [Row], "adapter_params", "per_token_ac", "per_token_no_ac", "fixed", "node", "host",
         "tokens_fit_ac"}: bytes, the node's free memory for activations, and the least that must live in host
         memory for `tokens` tokens with activation checkpointing (0 if it all fits).
    """
    lcfg = LoraConfig(rank=rank, targets=list(targets or BENCH_TARGETS), experts=experts, rank_scaling=rank_scaling)
    text = K3Config.from_hf(config).text
    m = text.moe
    D, A, L, F = text.hidden_size, m.num_experts_per_token, m.latent_dim, m.expert_dim
    r_e = lcfg.expert_rank(A)
    share = SHARING[experts]
    expert_bytes = base_bytes = fp32_bytes = adapter = 0
    out_features: dict[int, int] = {}  # layer -> the out features of its projections, summed
    for t in inventory["tensors"]:
        name, shape, n = t["name"], t["shape"], _count(t)
        if not name.startswith("language_model."):
            continue
        size = math.prod(shape) * DTYPE_BYTES[t["dtype"]] * n
        hit = EXPERT.match(name)
        if ".experts.{expert}." in name:
            expert_bytes += size
            if hit and any(fnmatchcase(_concrete(hit[1]), p) for p in lcfg.targets):
                out, inp = shape[0], shape[1] * 2  # two FP4 codes a byte
                E = len(t["experts"])
                sa, sb = share[hit[2]]
                adapter += len(t["layers"]) * r_e * ((1 if sa else E) * inp + (1 if sb else E) * out)
            continue
        if t["dtype"] == "float32":
            fp32_bytes += size
        else:
            base_bytes += size
        if name.endswith(".weight") and len(shape) == 2:
            for i in t.get("layers", []):  # a decoder layer's projections (activation estimate)
                out_features[i] = out_features.get(i, 0) + shape[0]
            if any(fnmatchcase(_concrete(name).removesuffix(".weight"), p) for p in lcfg.targets):
                adapter += n * rank * (shape[0] + shape[1])
    routed_rows = A * (L + 3 * F + L)  # per token: z gathered, w1 and w3 outputs, SiTU, w2 output
    # bf16, per layer: its projections' outputs, the routed rows of a MoE layer, four inputs of width D
    layers = [out_features.get(i, 0) + (routed_rows if text.moe_layers[i] else 0) + 4 * D
              for i in range(text.num_layers)]
    layer_no_ac = 2 * max(layers)
    blocks = -(-text.num_layers // text.attn_res_block_size)
    per_token_ac = 2 * D * (text.num_layers + blocks) + layer_no_ac  # inputs kept + one layer recomputed
    per_token_no_ac = 2 * sum(layers) + 2 * D * blocks
    rows = [Row("routed experts, MXFP4 (codes + E8M0 scales, as stored)", expert_bytes, f"{m.num_experts} experts x "
                f"{sum(text.moe_layers)} layers"),
            Row("non-expert weights, bf16 (as stored)", base_bytes, "attention, dense MLP, shared experts, routers, "
                "embeddings, LM head"),
            Row("fp32 tensors (as stored)", fp32_bytes, "A_log, dt_bias, conv weights, o_norm, router bias"),
            Row(f"adapter rank {rank} ({experts}{', rank/top_k on experts' if rank_scaling else ''}), fp32",
                4 * adapter, f"{adapter:,} parameters"),
            Row("adapter gradients, fp32", 4 * adapter),
            Row("AdamW states (2 moments), fp32", 8 * adapter)]
    fixed = sum(r.bytes for r in rows)
    node = gpus * gpu_bytes
    need = fixed + tokens * per_token_ac
    return {"rows": rows, "gpus": gpus, "adapter_params": adapter, "expert_rank": r_e, "per_token_ac": per_token_ac,
            "per_token_no_ac": per_token_no_ac, "fixed": fixed, "node": node, "tokens": tokens,
            "host": max(0, need - node), "tokens_fit_ac": max(0, (node - fixed) // per_token_ac)}


def markdown(report: dict) -> str:
    """The report as a BENCHMARKS.md table (GiB)."""
    g = 2**30
    lines = ["| what | GiB | |", "|---|---:|---|"]
    lines += [f"| {r.name} | {r.bytes / g:,.2f} | {r.note} |" for r in report["rows"]]
    lines.append(f"| **fixed total** | **{report['fixed'] / g:,.1f}** | |")
    lines.append(f"| activations per token, activation checkpointing per layer | "
                 f"{report['per_token_ac'] / 2**20:.2f} MiB | layer inputs + AttnRes blocks + one layer recomputed |")
    lines.append(f"| activations per token, no checkpointing | {report['per_token_no_ac'] / 2**20:.2f} MiB | |")
    lines.append(f"| node: {report['gpus']} GPUs | {report['node'] / g:,.1f} | |")
    lines.append(f"| **must live in host memory** ({report['tokens']:,} tokens a step, checkpointing on) | "
                 f"**{report['host'] / g:,.1f}** | fixed + activations - node |")
    return "\n".join(lines)
