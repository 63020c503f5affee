"""The engine's runtime knobs, frozen and validated once (the CLI builds it from `add_engine_args`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kimik3.ops.kda.reference import CHUNK_SIZE

GRID = CHUNK_SIZE  # snapshots and prefill chunks sit on the KDA chunk grid: a restore chunks as a cold run


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md): each running sequence's proposer offers up to
    `num_speculative_tokens` tokens per step, and one forward verifies them. The one place its rules live: every
    message starts with the field it is about (the CLI names the flag instead).

    Attributes:
        method: "suffix" (suffix decoding, model-free), "draft" (the DSpark-style drafter at `model`), or a
            `kimik3.inference.spec.Proposer` object (tests and benchmarks: an oracle).
        model: the drafter's folder (config.json + model.safetensors), for method "draft" only.
        num_speculative_tokens: k, the most draft tokens verified per sequence and step.
        adaptive: the engine picks each step's k up to `num_speculative_tokens` (0: the step decodes) from the
            measured acceptance and step costs (`draft_length.py`); False: every step drafts the full k.
    """

    method: object = "suffix"
    model: str | None = None
    num_speculative_tokens: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {self.adaptive!r}")
        if not isinstance(self.method, str):
            if not all(hasattr(self.method, a) for a in ("needs_taps", "propose", "observe", "finish")):
                raise ValueError(f"method must be 'suffix', 'draft' or a Proposer, got {self.method!r}")
            return
        if self.method not in ("suffix", "draft"):
            raise ValueError(f"method must be 'suffix' or 'draft', got {self.method!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("model is required with method 'draft' (the drafter's folder)")
        if self.method == "suffix" and self.model:
            raise ValueError(f"model is for method 'draft' (suffix decoding has none), got {self.model!r}")
        if self.model is not None and not Path(self.model).is_dir():
            raise FileNotFoundError(f"model {self.model}: no such folder (the drafter's config.json and weights)")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches.

    Attributes:
        max_num_seqs: running sequences at most (KDA slots).
        max_num_batched_tokens: tokens per step (prefill chunks + decodes); at least 64.
        max_model_len: prompt + output tokens per sequence (None: the model's max_position_embeddings).
        enable_prefix_cache: reuse computed prefixes.
        prefix_cache_bytes: the budget over KDA snapshots and the MLA blocks the cache holds (None: 16 snapshots
            plus a quarter of the block pool).
        block_size: MLA block size in tokens (a divisor of 64, the snapshot grid).
        num_blocks: MLA pool blocks (None: every running sequence at max_model_len; on CUDA at most half the
            free memory, and at least one sequence's worth).
        snapshot_interval: grid positions (multiples of 64) that get a prefix snapshot besides each prompt's
            last grid point and each finished request's end.
        use_cuda_graphs: replay captured decode-only steps (None: on CUDA in bf16/fp16). On the CPU, True runs
            the graphs' static steps (bucket padding, span buckets) eagerly: what the tests check their form on.
        warmup: capture every batch bucket's CUDA graphs and run every step shape the engine will meet (prefill
            chunks, each graph) once at start, so the first requests meet no kernel compile, autotuning or
            capture. Without it each graph is captured at the first step that needs it (a single prompt's first
            token does not wait for the decode graphs).
        poison: fill freed slots, freed blocks and evicted snapshots with NaN (tests: a stale read fails).
        speculative: speculative decoding (`SpeculativeConfig`), or None.
        cpu_offload_gb: GiB of routed experts per device kept in host memory only, the device caching the rest
            (`kimik3.placement`; "auto": what does not fit); None: every expert on the device. Read when the model
            loads (`load_engine`): a tiered model's steps run eagerly (each MoE layer reads its routing on the host).
        expert_trace: a JSON file of the tiered layers' counted routing, read at load when it exists (the cache
            starts warm) and written when the process exits.
        expert_misses: how a tiered layer serves the experts it misses: "auto" (per step, the cheaper by measured
            cost), "host" (computed on the host's cores) or "copy" (copied to the device and computed there: every
            row bit for bit the all-resident model's, so greedy tokens equal it in bf16 too).
        deterministic: run every step batch-invariantly (`kimik3.ops.matmul.batch_invariant`): a sequence's
            logits are bitwise the same whatever else its steps carry, so greedy tokens with speculative decoding
            equal those without it, and a request's tokens do not depend on the batch it ran in. On the CPU the
            default kernels already are but for MKL's 16-bit GEMM at some shapes, which it runs in fixed row
            groups (`kimik3.ops.rows`).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    prefix_cache_bytes: int | None = None
    block_size: int = 64
    num_blocks: int | None = None
    snapshot_interval: int = 256
    use_cuda_graphs: bool | None = None
    warmup: bool = False
    poison: bool = False
    speculative: SpeculativeConfig | None = None
    cpu_offload_gb: float | str | None = None
    expert_trace: str | None = None
    expert_misses: str = "auto"
    deterministic: bool = False

    def __post_init__(self) -> None:
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = (
            ("max_num_seqs", whole(self.max_num_seqs) and self.max_num_seqs >= 1, "an integer >= 1"),
            ("max_num_batched_tokens", whole(self.max_num_batched_tokens) and self.max_num_batched_tokens >= GRID,
             f"an integer >= {GRID} (one KDA chunk)"),
            ("max_model_len", self.max_model_len is None or (whole(self.max_model_len) and self.max_model_len >= 2),
             "an integer >= 2 (a prompt token and an output token)"),
            ("prefix_cache_bytes", self.prefix_cache_bytes is None or (whole(self.prefix_cache_bytes)
                                                                       and self.prefix_cache_bytes >= 0),
             "an integer >= 0"),
            ("block_size", whole(self.block_size) and self.block_size >= 1 and GRID % self.block_size == 0,
             f"a divisor of {GRID} (the snapshot grid)"),
            ("num_blocks", self.num_blocks is None or (whole(self.num_blocks) and self.num_blocks >= 1),
             "an integer >= 1"),
            ("snapshot_interval", whole(self.snapshot_interval) and self.snapshot_interval >= GRID
             and self.snapshot_interval % GRID == 0, f"a positive multiple of {GRID}"),
            ("cpu_offload_gb", self.cpu_offload_gb in (None, "auto") or (
                isinstance(self.cpu_offload_gb, (int, float)) and not isinstance(self.cpu_offload_gb, bool)
                and math.isfinite(self.cpu_offload_gb) and self.cpu_offload_gb >= 0), "a number of GiB >= 0 or 'auto'"),
            ("expert_misses", self.expert_misses in ("auto", "host", "copy"), "'auto', 'host' or 'copy'"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
