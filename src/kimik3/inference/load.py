"""`load_engine`: a checkpoint folder (or a kimi-k3 GGUF) made ready to serve, the one loader of `serve`, `generate`,
`chat`, batch files and the lm-eval harness.

    engine = load_engine("path/to/ckpt", EngineConfig(max_num_seqs=8))
    for events in engine_stream(engine, [engine.tokenizer.encode("ROMEO:")], SamplingParams()): ...
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from kimik3.checkpoint.source import read_config, read_tokenizer
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.inference.threads import pick_cpu_threads
from kimik3.placement import save_trace, tiered_layers
from kimik3.tokenizer import Tokenizer

# what `load` below calls to build the model: kimik3.load's keywords (a tensor- or expert-parallel loader from
# kimik3.distributed, which this layer may not import, is passed in instead)
Loader = Callable[..., nn.Module]


def load_engine(path: str | Path, config: EngineConfig | None = None, *, device: str | None = None,
                dtype: torch.dtype | str | None = None, vision: bool | None = False, lora: str | Path | None = None,
                adapters: dict[str, str | Path] | None = None, threads: int | None = None,
                sync_tokens: Callable[[Tensor], object] | None = None, loader: Loader | None = None,
                quiet: bool = True) -> Engine:
    """The checkpoint at `path` (a folder, a hub id already resolved to one, or a kimi-k3 .gguf file) loaded for
    inference, with its tokenizer, under an engine of `config`.

    Args:
        device: "cpu" or "cuda" (default: cuda when available).
        dtype: compute dtype (default: the checkpoint's).
        vision: False loads the text model only; None the vision tower when the shards hold one; True requires it.
        lora: a LoRA adapter folder put on the model in place (its routed experts stay MXFP4).
        adapters: LoRA adapters the engine serves, name -> folder (requests pick one; `Engine(adapters=...)`).
        threads: CPU threads (default: `pick_cpu_threads`' choice).
        sync_tokens: as `Engine`'s (ranks generating together).
        loader: builds the model instead of `kimik3.load` (same keywords): a parallel loader.

    The model runs in eval mode. Its MXFP4 routed experts stay packed where Humming's kernels run them, re-laid out
    for them in place (one copy), or for adapters; elsewhere they are decoded to the dtype once (`experts_packed`).
    The engine's `tokenizer` is the folder's `tiktoken.model` (a GGUF's vocabulary), and its end ids are the turn's
    end and the config's eos_token_id.
    """
    import kimik3
    from kimik3.quant import relayout_experts

    path = Path(path)
    tokenizer = read_tokenizer(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # None with images too: a config with a vision_config over shards without its tensors loads as text
    text_only = True if vision is False else None
    packed = experts_packed(path, device, dtype, adapters=lora is not None or bool(adapters))
    cfg = config or EngineConfig()
    tiers = {}
    if cfg.cpu_offload_gb is not None:
        tiers = dict(cpu_offload_gb=cfg.cpu_offload_gb, expert_trace=cfg.expert_trace,
                     expert_misses=cfg.expert_misses, offload_reserve_bytes=offload_reserve(path, cfg))
    model = (loader or kimik3.load)(path, dtype=dtype, device=device, text_only=text_only, quiet=quiet,
                                    keep_experts_packed=packed, **tiers)
    if cfg.expert_trace is not None and tiered_layers(model):
        atexit.register(save_trace, model, cfg.expert_trace)  # the routing this run counted, for the next
    if lora is not None:
        from kimik3.lora import load as load_adapter

        load_adapter(model, lora)
    model = model.eval()
    if not adapters:
        relayout_experts(model)  # Humming's kernels where the MoE backend (auto) picks them: one copy, inference only
    if vision and not getattr(model, "has_vision", False):
        raise ValueError(f"images: the checkpoint at {path} holds no vision tower tensors (vision_tower.*): it "
                         "reads text only")
    pick_cpu_threads(model, device, threads)
    return Engine(model, config, eos_token_ids=end_ids(model, tokenizer), tokenizer=tokenizer, model_id=str(path),
                  adapters=adapters or None, sync_tokens=sync_tokens)


def experts_packed(path: Path, device: str, dtype: torch.dtype | None, adapters: bool) -> bool:
    """Whether the load keeps the routed experts MXFP4-packed rather than decoding them to `dtype`: for adapters
    (they run over the stored codes), and where Humming's kernels will run them (`relayout_experts` re-lays out the
    stored codes: decoded first, they would take 4x the bytes and run on the bf16 grouped GEMM instead). Elsewhere
    (the CPU, fp32, widths Humming cannot take, a checkpoint that stores them dense) they are decoded once."""
    if adapters:
        return True
    cfg = read_config(path)
    if cfg.storage.experts != "mxfp4" or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False  # (no CUDA: the load says so)
    from kimik3.checkpoint.inventory import stored_dtype
    from kimik3.ops.moe import experts_backend

    moe, dtype = cfg.text.moe, dtype or stored_dtype(cfg)
    return experts_backend(torch.device(device), dtype, moe.latent_dim, moe.expert_dim) == "humming"


def offload_reserve(path: Path, config: EngineConfig) -> int:
    """Device bytes "auto" tiering leaves beside the weights: the engine's KDA slots, one sequence's MLA blocks
    at max_model_len (the pool's floor), and a workspace."""
    from kimik3.model.cache import state_bytes
    from kimik3.placement import WORKSPACE

    text = read_config(path).text
    one = state_bytes(text, torch.bfloat16)
    length = config.max_model_len or text.max_position_embeddings
    return (WORKSPACE + config.max_num_seqs * (one["kda_state_per_sequence"] + one["kda_conv_per_sequence"])
            + length * one["mla_latent_per_token"])


def end_ids(model: nn.Module, tok: Tokenizer) -> list[int]:
    """The ids a reply ends on: the turn's end (<|end_of_msg|>) and the model's end of text (config.eos_token_id:
    [EOS] for a model trained on documents, such as the demo model)."""
    return sorted({tok.eos_id, getattr(model.config, "eos_token_id", None)} - {None})
