"""The LoRA peer: NeMo AutoModel 0.7.0's own Kimi K3 with its PEFT (MXFP4-resident expert LoRA) on the real-dims
4-layer slice, one training step timed as `bench_lora.py` times ours. Run on the device before ours (the GPU to
itself), e.g. through `bench_lora.py --peer 'python3 bench/peer_automodel_lora.py'`, with nemo-automodel 0.7.0 and
fla-core 0.6.0 installed (`pip install --no-deps --target /tmp/site` their wheels; `.whl/` carries fla's).

The slice is the one `../shared/peers/automodel_slice.py` measures for full training and `configs/slice-train-4.json`
is for ours: layer 0 KDA + dense MLP, two KDA + MoE layers, one MLA + MoE layer, 128 routed experts top-16, the
released vocabulary; bf16; B=1, T=8192. The adapter: rank 16, alpha 32 on every attention projection, the dense MLP,
the shared experts and the routed experts, the rest frozen. NeMo's MXFP4-resident expert LoRA
(`PeftConfig(expert_weight_format="mxfp4")`) is tried first; 0.7.0 refuses K3's experts (NotImplementedError: they
apply the router weight after the down projection), and the script then runs NeMo's LoRA over bf16 experts
("unquantized"), the only expert LoRA NeMo runs on its K3, and says so in its line. The step: forward,
cross-entropy over the full logits (fp32), backward, AdamW (fused) over the adapter. Prints one line that
`bench_lora.py` reads:

    peer lora step: <ms> ms at T=<T>, peak <GiB> GiB, <n> adapter parameters, experts <mxfp4|unquantized>

    python3 bench/peer_automodel_lora.py [CONFIG.json]      # default: configs/k3.json (the released config)
    python3 bench/peer_automodel_lora.py --tiny              # CPU: the wiring only, on configs/tiny.json
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXPERTS, T, RANK = 128, 8192, 16
# bench_lora's targets (`kimik3.lora.memory.BENCH_TARGETS`) in NeMo's module names: its MoE block is `mlp` (ours
# `block_sparse_moe`), so the dense MLP's three projections are named one by one (`*.mlp.*_proj` would also take
# the MoE's latent projections, which ours leave out)
TARGETS = ["*.self_attn.*_proj", "*.self_attn.kv_a_proj_with_mqa", "*.mlp.gate_proj", "*.mlp.up_proj",
           "*.mlp.down_proj", "*.shared_experts.*_proj", "*.mlp.experts"]


def slice_config(path: Path, tiny: bool):
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config

    raw = copy.deepcopy(json.loads(path.read_text()))
    tc = raw["text_config"]
    if not tiny:  # the 4-layer slice (configs/slice-train-4.json has the same layers)
        tc["num_hidden_layers"] = 4
        tc["linear_attn_config"]["kda_layers"] = [1, 2, 3]
        tc["linear_attn_config"]["full_attn_layers"] = [4]
        tc["num_experts"] = EXPERTS
    tc.pop("quantization_config", None)
    raw.pop("quantization_config", None)
    cfg = KimiK3Config(**raw)
    cfg.text_config.dtype = torch.bfloat16
    return cfg


def build(cfg, device: str, tiny: bool):
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.kimi_k3 import model as k3

    # torch_mm experts: what NeMo's MXFP4 expert LoRA requires
    backend = BackendConfig(attn="sdpa", linear="torch", experts="torch_mm", dispatcher="torch", rms_norm="torch_fp32")
    with torch.device(device):
        model = k3.KimiK3ForCausalLM(cfg, backend=backend)
    _bf16(model)
    # factors in the base dtype (NeMo's default). Its MXFP4-resident expert LoRA refuses K3's experts (they apply
    # the router weight after the down projection: NotImplementedError in 0.7.0), so the experts then stay bf16
    for storage in ("mxfp4", "unquantized"):
        peft = PeftConfig(target_modules=TARGETS, dim=RANK if not tiny else 4, alpha=32, expert_weight_format=storage)
        try:
            return model, apply_lora_to_linear_modules(model, peft), storage
        except NotImplementedError as e:
            print(f"NeMo PEFT with expert_weight_format={storage!r}: {e}", flush=True)
            with torch.device(device):  # the refused patching may have replaced modules: start again
                model = k3.KimiK3ForCausalLM(cfg, backend=backend)
            _bf16(model)
    raise RuntimeError("NeMo's PEFT applies to none of the expert storages")


def _bf16(model) -> None:
    for p in model.parameters():  # bf16 throughout, as our slice's frozen base
        if p.dtype == torch.float32 and p.numel() > 1_000_000:
            p.data = p.data.to(torch.bfloat16)


def main() -> int:
    tiny = "--tiny" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = Path(args[0]) if args else ROOT / ("configs/tiny.json" if tiny else "configs/k3.json")
    device = "cpu" if tiny else "cuda"
    tokens = 64 if tiny else T
    torch.manual_seed(0)
    t0 = time.time()
    model, matched, storage = build(slice_config(path, tiny), device, tiny)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    kinds = sorted({type(m).__name__ for m in model.modules() if "LoRA" in type(m).__name__})
    print(f"built in {time.time() - t0:.1f} s: {matched} modules with LoRA ({', '.join(kinds)}), {n:,} adapter "
          f"parameters, experts {storage}", flush=True)
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=device == "cuda")
    V = model.config.text_config.vocab_size if hasattr(model.config, "text_config") else model.config.vocab_size
    ids = torch.randint(0, V, (1, tokens), device=device)
    labels = torch.randint(0, V, (1, tokens), device=device)
    model.train()

    def step():
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(2 + (5 if not tiny else 1)):  # two warm-up steps, then the timed ones
        sync()
        a = time.perf_counter()
        loss = step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - a)
    ms = sorted(times)[len(times) // 2] * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    print(f"loss {float(loss):.3f}", flush=True)
    print(f"peer lora step: {ms:.1f} ms at T={tokens}, peak {peak:.1f} GiB, {n} adapter parameters, experts "
          f"{storage}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
