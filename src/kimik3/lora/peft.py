"""Adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors` (+ `kimik3_lora.json`).

Legend: E experts, R rank, I/O in/out features of one expert's projection, L latent width, F expert width.

Keys are PEFT 0.21's for a model whose module tree is kimik3's `K3ForConditionalGeneration` (the released names,
as `kimik3.hf` builds it):

    base_model.model.<module>.lora_A.weight    [R, I]      a Linear target (`target_modules`)
    base_model.model.<module>.lora_B.weight    [O, R]

Routed experts are `target_parameters` ("<experts>.w1", ".w3", ".w2"). PEFT wraps one `ParamWrapper` per
parameter around the module, in the order the module registers them (w1, w3, w2), so w1's wrapper is innermost:

    <experts>.base_layer.base_layer.lora_{A,B}.weight   w1   A [E*R, L], B [F, R*E]
    <experts>.base_layer.lora_{A,B}.weight              w3   A [E*R, L], B [F, R*E]
    <experts>.lora_{A,B}.weight                         w2   A [E*R, F], B [L, R*E]

kimik3's parameters are [E, out, in] (no `is_transposed`), so PEFT reads A as [E, R, in] (row e*R + j) and B as
[out, R, E] (column j*E + e): delta_e = scale * B[:, :, e] @ A[e]. Shared layouts are written expanded (the shared
factor repeated per expert: the same delta), and `kimik3_lora.json` records the layout so `load` shares them again.
With `rank_scaling` the experts' rank goes in `rank_pattern`. Dropout is PEFT's `lora_dropout` only when no
experts are targeted (PEFT refuses dropout on `target_parameters`; it is a training-time setting anyway).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from kimik3.checkpoint.safetensors_header import complete_header, read_tensors
from kimik3.lora.apply import apply, lora_modules
from kimik3.lora.config import SHARING, LoraConfig
from kimik3.lora.layers import PROJECTIONS, LoraExperts

CONFIG, WEIGHTS, OURS = "adapter_config.json", "adapter_model.safetensors", "kimik3_lora.json"
PREFIX = "base_model.model."
NESTING = {"w1": "base_layer.base_layer.", "w3": "base_layer.", "w2": ""}  # PEFT's ParamWrapper nesting


def _to_peft(a: Tensor, b: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """kimik3 A [E', R, I], B [E', O, R] -> PEFT A [E*R, I], B [O, R*E] (shared factors repeated)."""
    a, b = a.expand(E, -1, -1), b.expand(E, -1, -1)
    R = a.shape[1]
    return a.reshape(E * R, -1).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], R * E).contiguous()


def _from_peft(a: Tensor, b: Tensor, E: int, share_a: bool, share_b: bool, key: str) -> tuple[Tensor, Tensor]:
    R = a.shape[0] // E
    a_ERI, b_EOR = a.reshape(E, R, -1), b.reshape(b.shape[0], R, E).permute(2, 0, 1)
    out = []
    for t, shared, what in ((a_ERI, share_a, "lora_A"), (b_EOR, share_b, "lora_B")):
        if shared:
            if not torch.equal(t, t[:1].expand_as(t)):
                raise ValueError(f"{key}: {what} differs between experts, but kimik3_lora.json says it is shared")
            t = t[:1]
        out.append(t.contiguous())
    return out[0], out[1]


def state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors under PEFT's names (fp32, on the CPU)."""
    out = {}
    for name, m in lora_modules(model).items():
        if isinstance(m, LoraExperts):
            for p in PROJECTIONS:
                a, b = _to_peft(getattr(m, f"{p}_lora_A").detach(), getattr(m, f"{p}_lora_B").detach(), m.num_experts)
                out[f"{PREFIX}{name}.{NESTING[p]}lora_A.weight"] = a
                out[f"{PREFIX}{name}.{NESTING[p]}lora_B.weight"] = b
        else:
            out[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A.detach()
            out[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B.detach()
    return {k: v.float().cpu().contiguous() for k, v in out.items()}


def per_expert_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`state_dict` with each routed expert unstacked into its own Linear-convention pair, the view vLLM's and
    SGLang's per-expert MoE LoRA loaders read: `<experts>.{e}.w1.lora_A.weight` [R, L], `.lora_B.weight` [F, R]
    (w3 the same, w2 [R, F] / [L, R]), the checkpoint's per-expert names (`experts.{e}.w1`). Linear targets as in
    `state_dict`. docs/lora.md gives the same mapping from the PEFT tensors."""
    out = {}
    for name, m in lora_modules(model).items():
        if not isinstance(m, LoraExperts):
            out[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A.detach()
            out[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B.detach()
            continue
        for p in PROJECTIONS:
            a = getattr(m, f"{p}_lora_A").detach().expand(m.num_experts, -1, -1)
            b = getattr(m, f"{p}_lora_B").detach().expand(m.num_experts, -1, -1)
            for e in range(m.num_experts):
                out[f"{PREFIX}{name}.{e}.{p}.lora_A.weight"] = a[e]
                out[f"{PREFIX}{name}.{e}.{p}.lora_B.weight"] = b[e]
    return {k: v.float().cpu().contiguous() for k, v in out.items()}


def peft_config(model: nn.Module, base_name_or_path: str | None = None) -> dict:
    """adapter_config.json for `model`'s adapter: explicit module and parameter names (PEFT matches them exactly)."""
    cfg: LoraConfig = model.lora_config
    mods = lora_modules(model)
    experts = [n for n, m in mods.items() if isinstance(m, LoraExperts)]
    linears = [n for n, m in mods.items() if not isinstance(m, LoraExperts)]
    rank_pattern = {}
    if experts:
        r_e = mods[experts[0]].w1_lora_A.shape[1]
        if r_e != cfg.rank:
            rank_pattern = {f"experts.{p}": r_e for p in PROJECTIONS}
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_name_or_path,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": 0.0 if experts else cfg.dropout,
            "target_modules": linears, "target_parameters": [f"{n}.{p}" for n in experts for p in PROJECTIONS],
            "rank_pattern": rank_pattern, "alpha_pattern": {}, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "inference_mode": True}


def save(model: nn.Module, path: str | Path, base_name_or_path: str | None = None) -> Path:
    """Write `model`'s adapter to folder `path` (created) in PEFT's format. Returns `path`."""
    if not lora_modules(model):
        raise ValueError("lora.save: the model has no adapter (lora.apply or lora.load first)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state_dict(model), str(path / WEIGHTS), metadata={"format": "pt"})
    (path / CONFIG).write_text(json.dumps(peft_config(model, base_name_or_path), indent=2) + "\n")
    (path / OURS).write_text(json.dumps(model.lora_config.to_dict(), indent=2) + "\n")
    return path


def read_config(path: str | Path) -> LoraConfig:
    """The LoraConfig of an adapter folder (kimik3_lora.json; for a folder PEFT wrote, from adapter_config.json).
    The weights file's header is checked too (present, safetensors, nothing past its end; no tensor data read),
    so that a wrong folder fails before a long model load."""
    path = Path(path)
    if not (path / CONFIG).is_file() and not (path / OURS).is_file():
        raise FileNotFoundError(f"{path}: not an adapter folder (no {CONFIG})")
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path}: not an adapter folder (no {WEIGHTS})")
    complete_header(path / WEIGHTS)
    if (path / OURS).is_file():
        return LoraConfig.from_dict(_json(path / OURS), str(path / OURS))
    peft = _json(path / CONFIG)
    targets = list(peft.get("target_modules") or [])
    targets += sorted({t.rpartition(".")[0] for t in peft.get("target_parameters") or []})
    ranks = set((peft.get("rank_pattern") or {}).values())
    if len(ranks) > 1 or peft.get("alpha_pattern"):
        raise ValueError(f"{path / CONFIG}: per-module ranks or alphas beyond one expert rank are not supported")
    return LoraConfig(rank=peft["r"], alpha=float(peft["lora_alpha"]), dropout=peft.get("lora_dropout", 0.0),
                      targets=targets, rank_scaling=bool(ranks))


def _json(file: Path) -> dict:
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return d


@torch.no_grad()
def load(model: nn.Module, path: str | Path) -> nn.Module:
    """`apply` the adapter saved at `path` to `model` and fill its factors (exactly). Returns `model`.

    Raises:
        FileNotFoundError: no adapter folder; ValueError: names or shapes that do not fit the model.
    """
    path = Path(path)
    cfg = read_config(path)
    apply(model, cfg)
    return load_weights(model, path)


@torch.no_grad()
def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Fill the factors of `model`'s adapter (already applied, the same LoraConfig) from `path`, exactly."""
    path = Path(path)
    cfg = model.lora_config
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path}: not an adapter folder (no {WEIGHTS})")
    tensors = read_tensors(path / WEIGHTS)
    used = set()

    def take(key: str, like: Tensor | None = None) -> Tensor:
        if key not in tensors:
            raise ValueError(f"{path / WEIGHTS}: missing {key}")
        used.add(key)
        t = tensors[key]
        if like is not None and t.shape != like.shape:
            raise ValueError(f"{path / WEIGHTS}: {key} is {tuple(t.shape)}, the model needs {tuple(like.shape)}")
        return t

    for name, m in lora_modules(model).items():
        if isinstance(m, LoraExperts):
            for p in PROJECTIONS:
                key = f"{PREFIX}{name}.{NESTING[p]}"
                a_like, b_like = _to_peft(getattr(m, f"{p}_lora_A"), getattr(m, f"{p}_lora_B"), m.num_experts)
                a, b = _from_peft(take(key + "lora_A.weight", a_like), take(key + "lora_B.weight", b_like),
                                  m.num_experts, *SHARING[cfg.experts][p], key)
                getattr(m, f"{p}_lora_A").copy_(a)
                getattr(m, f"{p}_lora_B").copy_(b)
        else:
            m.lora_A.copy_(take(f"{PREFIX}{name}.lora_A.weight", m.lora_A))
            m.lora_B.copy_(take(f"{PREFIX}{name}.lora_B.weight", m.lora_B))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{path / WEIGHTS}: {len(extra)} tensors name no module of this model, e.g. {extra[0]}")
    return model
