"""The K3 text model, its causal-LM head, and the multimodal wrapper (`language_model.` prefix).

Legend: B batch, T tokens, D hidden, Vocab vocabulary.

    h = embed(ids); blocks = [] (a stack [M, B, T, D])
    for each layer: h, blocks = layer(h, blocks)
    logits = lm_head( norm( MIX(h, blocks; output_attn_res_*) ) )      untied head, no fp32 upcast
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.config import K3Config, TextConfig
from kimik3.model.cache import Cache, cached_hidden
from kimik3.model.decoder import DecoderLayer, depth_mix
from kimik3.model.init import init_weights
from kimik3.model.norm import RMSNorm
from kimik3.model.state import StatePool
from kimik3.model.step import KDAStepIO, Step
from kimik3.model.vision import MMProjector, VisionTower, encode_images, tokens_per_image


def _dtype(dtype: torch.dtype | None) -> torch.dtype:
    # K3 computes in bf16; a checkpoint's stored dtype is the loader's to pass (K3Config.storage)
    return dtype if dtype is not None else torch.bfloat16


class K3TextModel(nn.Module):
    """`model.*`: embeddings, the 93 decoder layers, the output AttnRes mix and the final norm."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = cfg
        D = cfg.hidden_size
        # `_weight` skips nn.Embedding's own normal_ init, which on the meta device imports torch._dynamo (~1.5 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_token_id,
                                         _weight=torch.empty(cfg.vocab_size, D, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: Tensor, *, cu_seqlens: Tensor | None = None, inputs_embeds: Tensor | None = None
                ) -> Tensor:
        """input_ids [B, T] -> final hidden state [B, T, D] (see K3ForCausalLM.forward)."""
        return self._run(input_ids, cu_seqlens, None, None, inputs_embeds)[0]

    def cached(self, input_ids: Tensor, state: StatePool, step: Step, inputs_embeds: Tensor | None = None
               ) -> tuple[Tensor, list[KDAStepIO]]:
        """A step's packed chunks [1, T] over `state` -> (final hidden state [1, T, D], what each KDA layer gave
        back, in layer order, where it gave anything: `KDAStepIO`). Writes the state in place; no autograd graph."""
        if input_ids.shape[0] != 1:
            raise ValueError("a step packs its sequences in one row [1, T] (its own boundaries)")
        with torch.no_grad():
            return self._run(input_ids, None, state, step, inputs_embeds)

    def _run(self, input_ids: Tensor, cu_seqlens: Tensor | None, state: StatePool | None, step: Step | None,
             inputs_embeds: Tensor | None) -> tuple[Tensor, list[KDAStepIO]]:
        h_BTD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        blocks = h_BTD.new_empty(0, *h_BTD.shape)
        ios = []
        for i, layer in enumerate(self.layers):
            h_BTD, blocks, io = layer(h_BTD, blocks, cu_seqlens, state.layers[i] if state is not None else None, step)
            if io is not None:
                ios.append(io)
        return self.norm(depth_mix(blocks, h_BTD, self.output_attn_res_norm, self.output_attn_res_proj)), ios


class K3ForCausalLM(nn.Module):
    """The text model with its LM head: `model.*` and `lm_head.weight`.

    Args:
        cfg: the text config (`K3Config.text`).
        dtype: parameter and compute dtype (default bfloat16); the fp32 islands
            (KDA A_log / dt_bias / conv / o_norm, the router correction bias) stay fp32 regardless.
    """

    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = _dtype(dtype)
        self.config = cfg
        self.model = K3TextModel(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(self, input_ids: Tensor, *, cu_seqlens: Tensor | None = None, cache: Cache | None = None,
                attention_mask: Tensor | None = None, inputs_embeds: Tensor | None = None) -> Tensor:
        """input_ids [B, T] int64 -> logits [B, T, Vocab] in the compute dtype.

        Two modes: no state (training, prefill of whole sequences); or an explicit `cache` from `new_cache` (the
        new tokens of each row are appended to it: prefill, chunked prefill or decode, ragged rows with
        `attention_mask`). The serving engine's packed steps run through `run_step`.

        Args:
            cu_seqlens: [N+1] document boundaries packed in one row (B == 1, no state); no token sees another.
            cache: from `new_cache`; `attention_mask` [B, T] marks the tokens to append (0: left padding, say;
                those rows of the logits are zeros).
            inputs_embeds: [B, T, D] used instead of embedding input_ids (images spliced in by the wrapper).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if cache is not None:
            if cu_seqlens is not None:
                raise ValueError("cache= runs alone: cu_seqlens packs documents for forwards without state")
            return self.lm_head(cached_hidden(self, input_ids, cache, attention_mask, inputs_embeds))
        if attention_mask is not None:
            raise ValueError("attention_mask marks the tokens to append to a cache; pack documents with cu_seqlens "
                             "instead")
        return self.lm_head(self.model(input_ids, cu_seqlens=cu_seqlens, inputs_embeds=inputs_embeds))

    def run_step(self, input_ids: Tensor, state: StatePool, step: Step, *, inputs_embeds: Tensor | None = None,
                 logits_at: Tensor | None = None) -> tuple[Tensor, list[KDAStepIO]]:
        """The serving engine's step: `step`'s packed chunks [1, T] over the `state` pool -> (logits [1, M, Vocab]
        at the packed rows `logits_at` [M] (all T when None: the LM head over a whole prefill chunk would be
        wasted), what the KDA layers gave back (`K3TextModel.cached`))."""
        h_1TD, ios = self.model.cached(input_ids, state, step, inputs_embeds)
        return self.lm_head(h_1TD if logits_at is None else h_1TD[:, logits_at]), ios

    def new_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for `batch_size` sequences of up to `max_length` tokens, on the model's device (its
        state declared by the layers: under tensor parallelism, this rank's heads)."""
        return Cache(self, batch_size, max_length)

    def init_weights(self, seed: int | None = None) -> "K3ForCausalLM":
        """Fresh training init (see `kimik3.model.init`), seeding torch's global generator when `seed` is given.
        Returns self."""
        init_weights(self, self.config.initializer_range, seed)
        return self


class K3ForConditionalGeneration(nn.Module):
    """The released top-level module: `language_model.*`, and with vision `vision_tower.*` and `mm_projector.*`.

    Images enter through the prompt: every `<|media_pad|>` position (media_placeholder_token_id) takes one
    projected image token, in order (a prompt carries one pad per image token: `kimik3.vision.expand_media_pads`).

    Args:
        cfg: the whole config.
        dtype: as K3ForCausalLM (the vision tower and projector follow it).
        text_only: build no vision tower even when the config has one.
    """

    def __init__(self, cfg: K3Config, dtype: torch.dtype | None = None, *, text_only: bool = False):
        super().__init__()
        self.config = cfg
        self.language_model = K3ForCausalLM(cfg.text, dtype)
        if cfg.vision is not None and not text_only:
            vdtype = _dtype(dtype)
            self.vision_tower = VisionTower(cfg.vision, vdtype)
            self.mm_projector = MMProjector(cfg.vision, vdtype)

    @property
    def has_vision(self) -> bool:
        return hasattr(self, "vision_tower")

    def embed(self, input_ids: Tensor, pixel_values: Tensor, grid_thws: Tensor) -> Tensor:
        """[B, T, D] token embeddings with the images' projected tokens written over the media pads."""
        if not self.has_vision:
            raise ValueError("images were given but this model has no vision tower (text-only config or load)")
        h_BTD = self.language_model.model.embed_tokens(input_ids)
        feats_ND = torch.cat(encode_images(self.vision_tower, self.mm_projector, pixel_values, grid_thws))
        slots_BT = input_ids == self.config.media_placeholder_token_id
        found = int(slots_BT.sum())
        if found != feats_ND.shape[0]:
            raise ValueError(f"the prompt has {found} <|media_pad|> positions but the images give "
                             f"{feats_ND.shape[0]} tokens (per image: {tokens_per_image(grid_thws)})")
        return h_BTD.masked_scatter(slots_BT[..., None], feats_ND.to(h_BTD.dtype))

    def forward(self, input_ids: Tensor, *, cu_seqlens: Tensor | None = None, cache: Cache | None = None,
                attention_mask: Tensor | None = None, pixel_values: Tensor | None = None,
                grid_thws: Tensor | None = None) -> Tensor:
        """As K3ForCausalLM.forward; `pixel_values` [Npatch, 3, 14, 14] and `grid_thws` [Nimg, 3] (from
        `kimik3.vision.process_images`) splice images into the media-pad positions."""
        embeds = self.embed(input_ids, pixel_values, grid_thws) if pixel_values is not None else None
        return self.language_model(input_ids, cu_seqlens=cu_seqlens, cache=cache, attention_mask=attention_mask,
                                   inputs_embeds=embeds)

    def new_cache(self, batch_size: int, max_length: int) -> Cache:
        return self.language_model.new_cache(batch_size, max_length)
