"""`KimiK3ForConditionalGeneration`: transformers' PreTrainedModel + GenerationMixin over kimik3's own modules.

Legend: B batch, T tokens (new ones, with a cache), S past + new tokens, Vocab vocabulary.

One model, not a port: the submodules are those `kimik3.load` builds (`language_model` = K3ForCausalLM, and
`vision_tower` / `mm_projector` with vision), so parameter names are the released checkpoint's, logits are
kimik3's bit for bit, `from_pretrained` is kimik3's streaming loader and `save_pretrained` kimik3's writer.
What this class adds is transformers' contract: `labels` -> the shifted loss, `cache` (a KimiK3Cache) in and
out for `generate()`, gradient checkpointing, input/output embedding accessors (PEFT, TRL).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

import kimik3
from kimik3.checkpoint.folder import GENERATION_CONFIG, LOADED_FROM
from kimik3.checkpoint.hub import resolve
from kimik3.hf.cache import KimiK3Cache
from kimik3.hf.config import KimiK3Config
from kimik3.inference.generate import check_positions
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.cache import cached_hidden
from kimik3.model.decoder import DecoderLayer

# from_pretrained keywords transformers' auto classes pass along, which a kimik3 load has no use for
_IGNORED = ("_from_auto", "trust_remote_code", "adapter_kwargs", "low_cpu_mem_usage", "attn_implementation",
            "use_safetensors", "local_files_only", "cache_dir", "force_download", "proxies", "token", "subfolder",
            "_commit_hash", "code_revision")


def _device(device_map) -> str:
    """One device from a transformers `device_map`: None/"auto" (cuda when available), a device, or a map that
    places everything on one device ({"": d}). kimik3's HF class is single-device; spreading layers over devices
    is `kimik3.distributed`'s job."""
    if device_map is None or device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, dict):
        devices = {str(d) for d in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"device_map places modules on {sorted(devices)}: kimik3's transformers class runs on "
                             "one device (use kimik3.distributed for tensor or expert parallelism)")
        device_map = devices.pop()
    if isinstance(device_map, int):
        return f"cuda:{device_map}"
    return str(device_map)


def _dtype(dtype) -> torch.dtype | None:
    """`dtype` / `torch_dtype` of from_pretrained: None or "auto" = the checkpoint's, a torch dtype or its name."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be 'auto', a torch dtype or its name (bfloat16, float32), got {dtype!r}")
    return dtype


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    # transformers' `base_model` (the decoder without its LM head) is the `backbone` view below; it holds no
    # parameters, so every name stays the released one
    base_model_prefix = "backbone"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        # weights come from kimik3's loader, or kimik3's init (from_config); transformers must not touch them
        pass


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """Kimi K3 (text, and vision where the checkpoint has it) as a transformers causal LM.

    Args:
        config: a KimiK3Config.
        k3_model: the kimik3 model to wrap (what `from_pretrained` passes); None builds one from the config with
            kimik3's training init (`from_config`), in `config.dtype`.
    """

    def __init__(self, config: KimiK3Config, k3_model: K3ForConditionalGeneration | None = None):
        super().__init__(config)
        if k3_model is None:
            k3_model = K3ForConditionalGeneration(config.to_k3(), _dtype(config.dtype))
            k3_model.language_model.init_weights()
        self.k3_config = k3_model.config
        self.language_model = k3_model.language_model
        if k3_model.has_vision:
            self.vision_tower, self.mm_projector = k3_model.vision_tower, k3_model.mm_projector
        self._checkpoint_fn = None  # set by gradient_checkpointing_enable()
        self.loaded_from = getattr(k3_model, LOADED_FROM, None)
        for layer in self.modules():
            if isinstance(layer, DecoderLayer):
                layer.forward = self._checkpointed(layer.forward)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        config: KimiK3Config | None = None, dtype=None, torch_dtype=None, device_map=None,
                        revision: str | None = None, text_only: bool | None = None, **kwargs):
        """Load a released-layout folder or hub id with kimik3's loader (`kimik3.load`).

        Args:
            dtype: "auto"/None (the checkpoint's, bfloat16), a torch dtype or its name; `torch_dtype` is its old
                spelling.
            device_map: None, "auto" (cuda when available), "cpu", "cuda:0", 0, or a map onto one device.
            revision: a hub id's branch, tag or commit.
            text_only: as kimik3.load (None: the vision tower when the shards hold it).
        """
        if model_args:
            raise ValueError(f"{cls.__name__}.from_pretrained takes no positional model arguments, got {model_args}")
        for key in _IGNORED:
            kwargs.pop(key, None)
        if kwargs:
            raise ValueError(f"{cls.__name__}.from_pretrained: unsupported arguments {sorted(kwargs)}")
        path = resolve(str(pretrained_model_name_or_path), revision)
        inner = kimik3.load(path, dtype=_dtype(dtype if dtype is not None else torch_dtype),
                            device=_device(device_map), text_only=text_only, quiet=True)
        model = cls(config if config is not None else KimiK3Config.from_k3(inner.config), inner)
        model.config.name_or_path = str(pretrained_model_name_or_path)
        if (path / GENERATION_CONFIG).is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                        experts: str = "mxfp4", **kwargs) -> Path:
        """Write the released layout with kimik3's writer (`kimik3.save`): config.json, shards, index, and the
        source folder's tokenizer and card. transformers' own keywords (safe_serialization, ...) are accepted
        and ignored: the format is always the released one."""
        return kimik3.save(self._k3(), save_directory, experts=experts, max_shard_size=max_shard_size, quiet=True)

    def _k3(self) -> K3ForConditionalGeneration:
        """A kimik3 model sharing this one's modules (for the writer), built without allocating."""
        with torch.device("meta"):
            k3 = K3ForConditionalGeneration(self.k3_config, text_only=True)
        k3.language_model = self.language_model
        if self.has_vision:
            k3.vision_tower, k3.mm_projector = self.vision_tower, self.mm_projector
        if self.loaded_from is not None:  # where the writer copies the tokenizer and model card from
            setattr(k3, LOADED_FROM, self.loaded_from)
        return k3

    @property
    def backbone(self) -> _Backbone:
        """The decoder without the LM head: (input_ids, ...) -> BaseModelOutputWithPast(last_hidden_state [B, T, D]).
        Trainers that apply the LM head themselves (TRL's fused cross entropy) call it as `model.base_model`."""
        return _Backbone(self)

    @property
    def has_vision(self) -> bool:
        return hasattr(self, "vision_tower")

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.lm_head

    def new_cache(self, batch_size: int, max_length: int):
        """kimik3's explicit cache (what KimiK3Cache allocates)."""
        return self.language_model.new_cache(batch_size, max_length)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: KimiK3Cache | None = None, labels: Tensor | None = None, inputs_embeds: Tensor | None = None,
                pixel_values: Tensor | None = None, grid_thws: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T] -> logits [B, T, Vocab] (kimik3's, in the compute dtype).

        Args:
            attention_mask: [B, S] over past + new tokens, 1 for real tokens. Right padding needs nothing (a
                causal model never lets a real token see a later pad); left padding runs through a kimik3 cache
                (one made for this call when none is given), which keeps pads out of every row's state.
            cache: a KimiK3Cache (generate() makes one); the new tokens are appended to it.
            labels: [B, T] token ids, -100 ignored: the loss is the mean cross entropy of logits[:, t] against
                labels[:, t+1] (transformers' ForCausalLMLoss, `num_items_in_batch` honoured).
            pixel_values, grid_thws: images spliced into the media pads (kimik3.vision.process_images).
            logits_to_keep: > 0 projects only the last that many positions.
        """
        h_BTD = self.hidden_states(input_ids, attention_mask, cache, inputs_embeds, pixel_values, grid_thws)
        # the LM head as K3ForCausalLM.forward applies it (the same op on the same rows: the same bits)
        logits = self.language_model.lm_head(h_BTD if not logits_to_keep else h_BTD[:, -logits_to_keep:])
        loss = None
        if labels is not None:
            loss_kw = {k: kwargs[k] for k in ("num_items_in_batch", "shift_labels", "ignore_index") if k in kwargs}
            loss = self.loss_function(logits, labels, vocab_size=logits.shape[-1], **loss_kw)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def hidden_states(self, input_ids: Tensor | None, attention_mask: Tensor | None = None,
                      cache: KimiK3Cache | None = None, inputs_embeds: Tensor | None = None,
                      pixel_values: Tensor | None = None, grid_thws: Tensor | None = None) -> Tensor:
        """The final hidden state [B, T, D] (after the output norm) of the new tokens; arguments as `forward`."""
        if input_ids is None:
            raise ValueError("input_ids is required (inputs_embeds alone is not supported: pass the ids; images "
                             "go in through pixel_values)")
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported; pass input_ids (and pixel_values for images)")
        B, T = input_ids.shape
        new_mask = attention_mask[:, -T:].bool() if attention_mask is not None else None
        state = None
        if cache is not None:
            state = cache.bind(B, T)
        elif new_mask is not None and not _right_padded(new_mask):
            state = self.new_cache(B, T)
        if state is None:
            new_mask = None
        embeds = (K3ForConditionalGeneration.embed(self, input_ids, pixel_values, grid_thws)
                  if pixel_values is not None else None)
        if state is None:
            return self.language_model.model(input_ids, inputs_embeds=embeds)
        return cached_hidden(self.language_model, input_ids, state, new_mask, embeds)

    def _validate_generated_length(self, generation_config, input_ids_length: int, has_default_max_length: bool):
        """transformers' checks, then kimik3.generate's: a prompt that fills max_position_embeddings, or
        prompt + new tokens past it, is a ValueError (transformers checks only its own max_length, which a
        max_new_tokens overrides)."""
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        check_positions(input_ids_length, generation_config.max_length - input_ids_length,
                        self.k3_config.text.max_position_embeddings, "generate: the prompt",
                        "pass max_length={positions} instead of max_new_tokens")

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                                      max_cache_length: int) -> None:
        """generate()'s cache: a KimiK3Cache of `max_cache_length` tokens per row, unless one was passed."""
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return
        if generation_config.num_beams > 1:
            raise ValueError("num_beams > 1: beam search would reorder kimik3's recurrent state, which it cannot; "
                             "use greedy or sampling")
        model_kwargs["cache"] = KimiK3Cache(self.new_cache, max_cache_length)

    def _checkpointed(self, forward):
        """A decoder layer's forward that runs under transformers' checkpoint function once it is enabled."""
        def run(*args, **kwargs):
            if self._checkpoint_fn is not None and torch.is_grad_enabled() and self.training:
                return self._checkpoint_fn(forward, *args, **kwargs)
            return forward(*args, **kwargs)
        return run

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, **kwargs) -> None:
        # transformers hands over its checkpoint function (non-reentrant by default); the layers' forwards consult
        # it, so parameter names stay the released ones (no wrapper modules)
        self._checkpoint_fn = gradient_checkpointing_func if enable else None

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self._checkpoint_fn is not None


class _Backbone:
    """`model.backbone`: the decoder of a KimiK3ForConditionalGeneration, called as transformers calls a base
    model. A view (no parameters of its own), made on each access."""

    def __init__(self, owner: KimiK3ForConditionalGeneration):
        self.owner = owner

    def __call__(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 cache: KimiK3Cache | None = None, pixel_values: Tensor | None = None,
                 grid_thws: Tensor | None = None, **kwargs) -> BaseModelOutputWithPast:
        h = self.owner.hidden_states(input_ids, attention_mask, cache, kwargs.get("inputs_embeds"), pixel_values,
                                     grid_thws)
        return BaseModelOutputWithPast(last_hidden_state=h, cache=cache)


def _right_padded(mask_BT: Tensor) -> bool:
    """Every row is real tokens then pads (or all real): causal attention alone keeps the pads unseen."""
    return bool((mask_BT[:, 1:] <= mask_BT[:, :-1]).all())
