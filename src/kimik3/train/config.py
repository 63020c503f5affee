"""The training run's TOML file, read into frozen dataclasses and validated once.

Every key is checked: an unknown key, a wrong type or a value outside its choices raises ValueError naming
the file and the `section.key`. Relative paths are taken from the current directory; a path that starts with
`{kimik3}/` is inside the installed package (PACKAGE_PATH_KEYS: how a shipped preset finds its data and tokenizer
from a wheel as from a clone). `overrides` are `section.key=value` strings with TOML values (`train.steps=10`,
`out_dir="runs/x"`), applied before the checks. The shipped presets (`kimik3 train tiny`: kimik3/configs/train/,
linked from the repository's configs/train/) are complete examples; docs/training.md documents every key.

A `[draft]` table makes the run train a speculative drafter (docs/speculative.md) for the frozen checkpoint
`draft.target` instead of the model: `[model]` must then be absent, and configs/train/demo-draft.toml shows the keys.
"""

from __future__ import annotations

import difflib
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kimik3.inference.spec.drafter import DraftConfig
from kimik3.lora.config import LoraConfig
from kimik3.presets import PACKAGE_DIR, resolve_train_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project runs on 3.11+; tomli is the same parser for 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class ModelSection:
    config: str | None = None  # preset name (tiny, k3) or a config.json / checkpoint folder: fresh init
    checkpoint: str | None = None  # a released-layout checkpoint folder (kimik3.load): start from its weights
    init_seed: int = 0


@dataclass(frozen=True)
class DataSection:
    train: list[str] = field(default_factory=list)  # a shard folder, .bin files, or text files/globs
    valid: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # tiktoken.model file or a folder with one (text files only)
    eos_id: int | None = None  # the document separator (default: meta.json's, or the tokenizer's [EOS])
    seq_len: int = 512
    shuffle: bool = True
    seed: int = 0


@dataclass(frozen=True)
class TrainSection:
    steps: int | None = None  # required: the number of optimizer steps (the schedule's length)
    micro_batch_rows: int = 1  # rows of seq_len tokens packed into one micro-batch (one [1, R*T] row)
    grad_accum: int = 1
    precision: str = "fp32"  # "fp32" or "bf16" (autocast; fp32 master weights)
    activation_checkpointing: bool = False
    expert_parallel: bool = False  # under torchrun: routed experts sharded over the ranks (EP size = DP size)
    loss_chunk_tokens: int = 1024
    clip_grad_norm: float = 1.0  # 0 disables clipping (the norm is still logged)
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda"
    seed: int = 0


@dataclass(frozen=True)
class OptimSection:
    name: str = "adamw"  # "adamw" or "muon" (Muon for hidden matrices, AdamW for the rest)
    lr: float = 3e-4
    schedule: str = "cosine"  # "cosine", "wsd" or "constant", after linear warmup
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    muon_momentum: float = 0.95


@dataclass(frozen=True)
class BalancingSection:
    method: str = "qb"  # "qb", "qb_exact", "sign", "frozen"
    bins: int = 1000
    ema: float = 0.0
    sign_gamma: float = 1e-3


@dataclass(frozen=True)
class EvalSection:
    every: int = 0  # steps between evaluations (0: only at the end, when data.valid is set)
    rows: int = 16


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0  # steps between saves (0: only at the end and on Ctrl-C / SIGTERM)
    keep: int = 3
    resume: str = "auto"  # "auto" (latest in out_dir if any), "never", or a step folder


@dataclass(frozen=True)
class LogSection:
    every: int = 1
    progress: bool = True
    peak_tflops: float | None = None  # per-GPU peak for MFU (default: looked up for H100/H200/A100)


# the drafter's shape keys of a [draft] table: DraftConfig's own names and defaults (the target's sizes come from the
# target checkpoint; DraftConfig checks the values once they are known)
DRAFT_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "head_dim", "intermediate_size", "block_size",
                    "markov_rank", "enable_confidence_head")
_DRAFT = {f.name: f.default for f in fields(DraftConfig)}


@dataclass(frozen=True)
class DraftSection:
    """[draft]: train a DSpark drafter (`DraftConfig`, whose field names the shape keys are) for a frozen target."""

    target: str | None = None  # required: the frozen target checkpoint folder (kimik3.load)
    target_layer_ids: list[int] = field(default_factory=list)  # required: 0-based target layers tapped
    num_hidden_layers: int = _DRAFT["num_hidden_layers"]
    num_attention_heads: int = _DRAFT["num_attention_heads"]
    head_dim: int = _DRAFT["head_dim"]
    intermediate_size: int = _DRAFT["intermediate_size"]
    block_size: int = _DRAFT["block_size"]  # slots per block: the anchor + block_size - 1 drafts
    markov_rank: int = _DRAFT["markov_rank"]  # 0: no Markov head
    enable_confidence_head: bool = _DRAFT["enable_confidence_head"]
    mask_token_id: int | None = None  # default: vocab_size - 3 (K3's reserved mask id sits there)
    anchors: int = 16  # draft blocks trained per row
    labels: str = "target"  # "target": the target's argmax at each position; "data": the data's next tokens
    confidence_weight: float = 0.1  # weight of the confidence head's loss beside the draft CE


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    optim: OptimSection = OptimSection()
    balancing: BalancingSection = BalancingSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    lora: LoraConfig | None = None  # [lora]: train an adapter on the frozen base (absent: full training)
    draft: DraftSection | None = None  # present: train a speculative drafter for the frozen `target`
    source: str = field(default="<dict>", compare=False)

    def to_dict(self) -> dict:
        def plain(value):
            return value if value is None or isinstance(value, str) else vars(value)

        return {f.name: plain(getattr(self, f.name)) for f in fields(self) if f.name != "source"}


CHOICES = {"train.precision": ("fp32", "bf16"), "train.device": ("auto", "cpu", "cuda"),
           "optim.name": ("adamw", "muon"), "optim.schedule": ("cosine", "wsd", "constant"),
           "balancing.method": ("qb", "qb_exact", "sign", "frozen"), "draft.labels": ("target", "data")}
POSITIVE = ("data.seq_len", "train.steps", "train.micro_batch_rows", "train.grad_accum", "train.loss_chunk_tokens",
            "balancing.bins", "eval.rows", "checkpoint.keep", "log.every")
NON_NEGATIVE = ("optim.lr", "optim.warmup_steps", "optim.weight_decay", "train.clip_grad_norm", "eval.every",
                "checkpoint.every", "balancing.sign_gamma")


PACKAGE_PREFIX = "{kimik3}/"
PACKAGE_PATH_KEYS = ("model.config", "model.checkpoint", "data.train", "data.valid", "data.tokenizer", "draft.target")


def _package_paths(raw: dict) -> None:
    """Replace a leading `{kimik3}/` in the path keys of the raw document with the package's folder."""
    def expand(v: Any) -> Any:
        return str(PACKAGE_DIR / v[len(PACKAGE_PREFIX):]) if isinstance(v, str) and v.startswith(PACKAGE_PREFIX) else v

    for dotted in PACKAGE_PATH_KEYS:
        section, key = dotted.split(".")
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            value = node[key]
            node[key] = [expand(v) for v in value] if isinstance(value, list) else expand(value)


def _typed(value: Any, hint: Any, key: str, where: str) -> Any:
    """`value` checked against a field's type hint (int, float, bool, str, X | None, list[str|float])."""
    def bad(want: str) -> ValueError:
        return ValueError(f"{where}: '{key}' must be {want}, got {type(value).__name__} {value!r}")

    args = typing.get_args(hint)
    if type(None) in args:  # X | None: TOML has no null, so a present key is always an X
        return _typed(value, next(a for a in args if a is not type(None)), key, where)
    if typing.get_origin(hint) is list:
        item = args[0]
        if isinstance(value, str) and item is str:
            return [value]
        if not isinstance(value, list):
            raise bad(f"a list of {item.__name__}")
        return [_typed(v, item, key, where) for v in value]
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad("a number")
        return float(value)
    if not isinstance(value, str):
        raise bad("a string")
    return value


def _unoptional(hint: Any) -> Any:
    """X for `X | None` (an optional section such as [lora]), else the hint itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _section(cls: type, raw: Any, name: str, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: '{name}' must be a table ([{name}]), got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{name}.{near[0]}'?" if near else f" (known: {', '.join(known)})"
            raise ValueError(f"{where}: unknown key '{name}.{key}'{hint}")
        values[key] = _typed(value, hints[key], f"{name}.{key}", where)
    try:
        return cls(**values)
    except ValueError as e:  # a section that checks itself (LoraConfig): its message names the key
        raise ValueError(f"{where}: {e}") from None


def _check_values(cfg: TrainConfig, where: str) -> None:
    if cfg.train.steps is None:
        raise ValueError(f"{where}: 'train.steps' is required (the number of optimizer steps)")
    for dotted, allowed in CHOICES.items():
        if dotted.startswith("draft.") and cfg.draft is None:
            continue
        value = getattr(getattr(cfg, dotted.split(".")[0]), dotted.split(".")[1])
        if value not in allowed:
            raise ValueError(f"{where}: '{dotted}' must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    for dotted, minimum in [(k, 1) for k in POSITIVE] + [(k, 0) for k in NON_NEGATIVE]:
        value = getattr(getattr(cfg, dotted.split(".")[0]), dotted.split(".")[1])
        if value < minimum:
            raise ValueError(f"{where}: '{dotted}' must be >= {minimum}, got {value}")
    if cfg.draft is not None:
        _check_draft(cfg.draft, cfg.model, where)
    elif (cfg.model.config is None) == (cfg.model.checkpoint is None):
        raise ValueError(f"{where}: set exactly one of 'model.config' (fresh init) and 'model.checkpoint'")
    if not cfg.data.train:
        raise ValueError(f"{where}: 'data.train' is required (shard folder, .bin files or text files)")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ValueError(f"{where}: 'optim.betas' must be two numbers in [0, 1), got {cfg.optim.betas}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1 or not 0 < cfg.optim.decay_fraction <= 1:
        raise ValueError(f"{where}: 'optim.min_lr_ratio' must be in [0, 1] and 'optim.decay_fraction' in (0, 1]")
    if cfg.lora is not None:
        if cfg.model.checkpoint is None:
            raise ValueError(f"{where}: [lora] trains an adapter on a frozen base: set 'model.checkpoint' (not "
                             "'model.config')")
        if cfg.train.expert_parallel:
            raise ValueError(f"{where}: [lora] does not run with 'train.expert_parallel' yet")
    if not 0 <= cfg.balancing.ema < 1:
        raise ValueError(f"{where}: 'balancing.ema' must be in [0, 1), got {cfg.balancing.ema}")


def _check_draft(d: DraftSection, model: ModelSection, where: str) -> None:
    if model != ModelSection():
        raise ValueError(f"{where}: a [draft] run trains a drafter for 'draft.target'; remove the [model] table")
    if d.target is None:
        raise ValueError(f"{where}: 'draft.target' is required (the frozen target checkpoint folder)")
    ids = d.target_layer_ids
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{where}: 'draft.target_layer_ids' must be distinct 0-based target layer indices, got {ids}")
    if d.anchors < 1 or d.confidence_weight < 0:
        raise ValueError(f"{where}: 'draft.anchors' must be >= 1 and 'draft.confidence_weight' >= 0")
    config = Path(d.target) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{where}: 'draft.target': no checkpoint folder (config.json) at '{d.target}'")
    from kimik3.config import K3Config

    try:  # the drafter's own checks, against the target's sizes
        shape_of(d, K3Config.from_file(config).text)
    except ValueError as e:  # DraftConfig names a field 'name'; here it is the key 'draft.name'
        message = str(e).replace("draft config '", "'draft.")
        raise ValueError(f"{where}: {message}") from None


def shape_of(d: DraftSection, target) -> DraftConfig:
    """The DraftConfig a [draft] section asks for, for a target of config `target` (its TextConfig)."""
    V = target.vocab_size
    return DraftConfig(target_layer_ids=tuple(d.target_layer_ids), target_hidden_size=target.hidden_size,
                       target_num_hidden_layers=target.num_layers, vocab_size=V, hidden_size=target.hidden_size,
                       mask_token_id=V - 3 if d.mask_token_id is None else d.mask_token_id,
                       rms_norm_eps=target.rms_norm_eps, situ_beta=target.situ_beta,
                       situ_linear_beta=target.situ_linear_beta, **{k: getattr(d, k) for k in DRAFT_SHAPE_KEYS})


def from_dict(raw: dict, where: str = "<dict>") -> TrainConfig:
    """Validate a parsed TOML document (see the module docstring)."""
    sections = {f.name: f for f in fields(TrainConfig) if f.name not in ("out_dir", "source")}
    unknown = [k for k in raw if k not in sections and k != "out_dir"]
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*sections, "out_dir"], n=1)
        hint = f"; did you mean '{near[0]}'?" if near else f" (known: out_dir, {', '.join(sections)})"
        raise ValueError(f"{where}: unknown key '{unknown[0]}'{hint}")
    if "out_dir" not in raw:
        raise ValueError(f"{where}: 'out_dir' is required (the run's folder: checkpoints, metrics.jsonl)")
    out_dir = _typed(raw["out_dir"], str, "out_dir", where)
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # the caller's document is untouched
    _package_paths(raw)
    hints = typing.get_type_hints(TrainConfig)
    parts = {name: _section(_unoptional(hints[name]), raw[name], name, where) for name in sections if name in raw}
    cfg = TrainConfig(out_dir=out_dir, source=where, **parts)
    _check_values(cfg, where)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """`section.key=value` (TOML value; a bare word is taken as a string) set into the raw document."""
    if "=" not in item:
        raise ValueError(f"--set expects section.key=value, got {item!r}")
    dotted, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    *parents, key = dotted.strip().split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[key] = value


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read, override and validate a training TOML file, or a shipped preset by name (`tiny`, `demo`, ...)."""
    path = resolve_train_config(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(raw, str(path))
