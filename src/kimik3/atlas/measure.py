"""Numbers measured on real forwards: which instances a forward reads, matmul FLOPs per token, cache bytes.

"Used" is measured, not assumed: a small copy of the config (same layer count, attention pattern, dense/MoE
pattern and AttnRes block size; small widths and few experts) runs a real CPU forward under a
TorchFunctionMode that records every parameter and buffer an op receives. A stored tensor that no op reads
(layer 0's attention mix: there are no stored sums yet) shows up as stored-but-unused. The per-token FLOP
formulas (2 x the weights of every matmul a token passes through) are checked against torch's FlopCounterMode
on the same kind of small copy (`check_flops`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from kimik3.atlas.catalog import Component, leaf_of
from kimik3.checkpoint.keys import checkpoint_prefix
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.cache import state_bytes
from kimik3.model.moe import Experts, MXFP4Experts, Router
from kimik3.model.vision import encode_images
from kimik3.ops.rows import ROWS


def small_like(cfg: K3Config) -> K3Config:
    """The same layer structure (and vision block count) at small widths: cheap to run on a CPU."""
    t = cfg.text
    kda = dataclasses.replace(t.kda, num_heads=2, head_dim=8, a_log_size=8 if t.kda.a_log_size > t.kda.num_heads else 2)
    mla = dataclasses.replace(t.mla, num_heads=2, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                              qk_rope_head_dim=4, v_head_dim=5)
    E = min(t.moe.num_experts, 6)
    moe = dataclasses.replace(t.moe, num_experts=E, num_experts_per_token=min(t.moe.num_experts_per_token, 2),
                              expert_dim=14, latent_dim=9)
    text = dataclasses.replace(t, vocab_size=64, hidden_size=16, intermediate_size=20, pad_token_id=None,
                               kda=kda, mla=mla, moe=moe)
    vision = None if cfg.vision is None else dataclasses.replace(
        cfg.vision, hidden_size=16, intermediate_size=20, num_heads=2, qkv_hidden_size=16, mm_hidden_size=16,
        text_hidden_size=text.hidden_size)
    return dataclasses.replace(cfg, text=text, vision=vision)


class _ReadRecorder(TorchFunctionMode):
    """Records the ids of the watched tensors that any torch function or tensor method receives."""

    def __init__(self, watched: dict[int, str]):
        super().__init__()
        self.watched, self.read = watched, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stack = list(args) + list(kwargs.values())
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, torch.Tensor) and id(a) in self.watched:
                self.read.add(self.watched[id(a)])
        return func(*args, **kwargs)


def _small_model(cfg: K3Config, seed: int = 0) -> K3ForConditionalGeneration:
    small = small_like(cfg)
    model = K3ForConditionalGeneration(small, torch.float32)
    model.language_model.init_weights(seed)
    return model


def used_instances(cfg: K3Config, comps: list[Component], tokens: int = 6) -> tuple[dict[str, list[int]], set[str]]:
    """(leaf id -> the instances (layer or block indices; [0] for single ones) whose tensors a forward reads,
    the names of the modules whose forward ran). A text forward, then one 4 x 4-patch image through the vision
    tower and projector (the path `embed` takes for images)."""
    model = _small_model(cfg)
    prefix = checkpoint_prefix(model)
    named = dict(model.state_dict(keep_vars=True))
    rec = _ReadRecorder({id(t): n for n, t in named.items()})
    called: set[str] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: called.add(n)) for n, m in model.named_modules()]
    ids = torch.randint(0, model.config.text.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), rec:
            model(ids)
            if model.has_vision:
                gen = torch.Generator().manual_seed(1)
                encode_images(model.vision_tower, model.mm_projector, torch.randn(16, 3, 14, 14, generator=gen),
                              torch.tensor([[1, 4, 4]]))
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, set] = defaultdict(set)
    for name in rec.read:
        cid, inst = leaf_of(prefix + name, comps, cfg.text.layer_types)
        out[cid].add(0 if inst is None else inst)
    return {cid: sorted(v) for cid, v in out.items()}, called


def _leaf_flops(model: nn.Module, comps: list[Component], top_k: int,
                called: set[str] | None = None) -> dict[str, dict[int, dict[str, int]]]:
    """leaf -> instance -> {module name: matmul FLOPs per token}, from the live modules: 2 x in x out for every
    nn.Linear, 2 x E x D for a router, 2 x top_k x (one expert's weights) for the routed experts. With
    `called` (module names whose forward ran), a module never called is no matmul (the AttnRes projections
    are nn.Linear modules whose weight the mix reads as a vector)."""
    prefix = checkpoint_prefix(model)
    layer_types = (model.language_model if hasattr(model, "language_model") else model).config.layer_types
    out: dict[str, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            flops = 2 * mod.weight.numel()
            tensor = mod_name + ".weight"
        elif isinstance(mod, Router):
            flops, tensor = 2 * mod.weight.numel(), mod_name + ".weight"
        elif isinstance(mod, (Experts, MXFP4Experts)):
            _, F, L = mod.w1.shape if isinstance(mod, Experts) else (*mod.w1_packed.shape[:2],
                                                                      mod.w1_packed.shape[2] * 2)
            flops, tensor = 2 * top_k * 3 * F * L, mod_name + (".w1" if isinstance(mod, Experts) else ".w1_packed")
        else:
            continue
        if called is not None and mod_name not in called:
            continue
        try:
            cid, inst = leaf_of(prefix + tensor, comps, layer_types)
        except ValueError:
            continue
        if cid.startswith("vision") or cid == "projector":
            continue  # per image patch, not per text token
        out[cid][0 if inst is None else inst][mod_name] = flops
    return out


def flops_per_token(model: nn.Module, comps: list[Component], cfg: K3Config, context: int,
                    called: set[str] | None = None) -> dict[str, dict]:
    """leaf -> {"weights": matmul FLOPs per token and instance, "core": attention-core FLOPs per token at
    `context` keys, "instances": n, "total": all instances}. The embedding lookup and the elementwise work
    (norms, mixes, activations) are not matmuls and count 0."""
    t = cfg.text
    per = _leaf_flops(model, comps, t.moe.num_experts_per_token, called)
    ml, kd = t.mla, t.kda
    core = {"mla": 2 * ml.num_heads * (ml.qk_head_dim + ml.v_head_dim) * context,
            # recurrent form per token: the two state products S^T k and S^T q (the rank-1 update k u^T and the
            # decay are elementwise, not matmuls)
            "kda": 4 * kd.num_heads * kd.head_dim * kd.head_dim}
    out = {}
    for cid, insts in per.items():
        one = next(iter(insts.values()))
        weights = sum(one.values())
        c = core.get(cid, 0)
        out[cid] = {"weights": weights, "core": c, "instances": len(insts), "total": (weights + c) * len(insts)}
    return out


def check_flops(cfg: K3Config, comps: list[Component], tokens: int = ROWS) -> list[dict]:
    """Formula vs FlopCounterMode on a small copy of `cfg`: one row per leaf (summed over its instances). `tokens`
    is a multiple of `kimik3.ops.rows.ROWS`: the reference router's fp32 product runs in groups of that many rows,
    the last padded with zeros (batch invariance), and at other counts the padding's FLOPs would be counted too.

    Weights: the counted aten.mm of the leaf's matmul modules == tokens x formula. MLA core: the reference
    computes the full [T, T] score matrix (masked), so its counted bmm == tokens x core(T keys)."""
    _, called = used_instances(cfg, comps)
    model = _small_model(cfg)
    small = model.config
    formula = _leaf_flops(model, comps, small.text.moe.num_experts_per_token, called)
    ids = torch.randint(0, small.text.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(ids)
    counts = {k.split(".", 1)[1] if "." in k else k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    bmm = {k.split(".", 1)[1] if "." in k else k: sum(n for op, n in v.items() if "bmm" in str(op))
           for k, v in counter.get_flop_counts().items()}
    rows = []
    ml = small.text.mla
    for cid, insts in sorted(formula.items()):
        expected = sum(tokens * f for mods in insts.values() for f in mods.values())
        counted = sum(counts.get(m, 0) for mods in insts.values() for m in mods)
        rows.append({"leaf": cid, "what": "weights", "formula": expected, "counted": counted})
    mla_layers = [i for i, k in enumerate(small.text.layer_types) if k == "mla"]
    if mla_layers:
        expected = len(mla_layers) * tokens * 2 * ml.num_heads * (ml.qk_head_dim + ml.v_head_dim) * tokens
        counted = sum(bmm.get(f"language_model.model.layers.{i}.self_attn", 0) for i in mla_layers)
        rows.append({"leaf": "mla", "what": "core", "formula": expected, "counted": counted})
    kda_layers = [i for i, k in enumerate(small.text.layer_types) if k == "kda"]
    if kda_layers:  # one decoded token against a cache: the recurrent form the formula counts
        lm = model.language_model
        cache = lm.new_cache(1, tokens + 1)
        decode = FlopCounterMode(display=False)
        with torch.no_grad():
            lm(ids, cache=cache)
            with decode:
                lm(ids[:, :1], cache=cache)
        kd = small.text.kda
        counted = sum(n for k, v in decode.get_flop_counts().items() for op, n in v.items()
                      if "bmm" in str(op) and any(k.endswith(f"model.layers.{i}.self_attn") for i in kda_layers))
        rows.append({"leaf": "kda", "what": "core (decode)", "formula": len(kda_layers) * 4 * kd.num_heads
                     * kd.head_dim * kd.head_dim, "counted": counted})
    return rows


def cache_bytes(cfg: K3Config, dtype: torch.dtype) -> dict[str, int]:
    """Per sequence: KDA recurrent state and conv tails (all KDA layers); per token: MLA latent rows (all MLA
    layers). From the layers' declared state, as the engine allocates it."""
    return state_bytes(cfg.text, dtype)
