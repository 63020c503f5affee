"""LoRA adapters over the frozen base (routed experts stay MXFP4-packed): apply, merge, save, load.

    from kimik3 import lora
    model = kimik3.load(path, dtype=torch.float32, keep_experts_packed=True)
    lora.apply(model, lora.LoraConfig(rank=8, targets=["*.self_attn.q_proj", "*.block_sparse_moe.experts"]))
    ...train the factors (the only parameters left with requires_grad)...
    lora.save(model, "out/adapter")              # PEFT format: adapter_config.json + adapter_model.safetensors
    lora.load(kimik3.load(path, keep_experts_packed=True), "out/adapter")
    lora.merge(model)                            # in place; lora.merge_checkpoint(base, adapter, out) for files

docs/lora.md describes the layouts and how they map to PEFT, vLLM and SGLang.
"""

from kimik3.lora.apply import adapter_size, apply, format_adapter_size, lora_modules
from kimik3.lora.config import EXPERT_LAYOUTS, LoraConfig
from kimik3.lora.merge import merge, merge_checkpoint
from kimik3.lora.peft import load, load_weights, per_expert_state_dict, read_config, save

__all__ = ["EXPERT_LAYOUTS", "LoraConfig", "adapter_size", "apply", "format_adapter_size", "load", "load_weights",
           "lora_modules", "merge", "merge_checkpoint", "per_expert_state_dict", "read_config", "save"]
