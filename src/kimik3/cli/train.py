"""`kimik3 train CONFIG.toml` (or a shipped preset: `kimik3 train tiny`): train or resume a run;
`kimik3 train --prepare OUT --tokenizer TOK FILES...`.

Data parallel: `torchrun --nproc_per_node N -m kimik3 train CONFIG.toml` (FSDP2; gloo on CPU, NCCL on CUDA).
Ctrl-C or SIGTERM saves after the current step and exits with status 130; running the same command again
resumes from the newest checkpoint in out_dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from kimik3.presets import train_preset_names

    p = sub.add_parser("train", help="train from a TOML run config or preset (docs/training.md), or --prepare "
                                     "token shards")
    p.add_argument("inputs", nargs="*", help="the run's TOML file or a shipped preset "
                                             f"({', '.join(train_preset_names())}); with --prepare: the text files "
                                             "to tokenize")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key with a TOML value, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="save and stop after this step, keeping the schedule of train.steps")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: torch's, or OMP_NUM_THREADS when exported)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: a log line (step, loss, tokens/s) every log.every steps instead")
    p.add_argument("--prepare", metavar="OUT_DIR",
                   help="tokenize the input files (text; .jsonl: {\"text\"} or chat {\"messages\"} lines) into a "
                        "uint32 shard folder (chat lines add a loss mask: only assistant turns train)")
    p.add_argument("--tokenizer", help="with --prepare: a tiktoken.model file or a checkpoint folder holding one")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="with --prepare: tokens per .bin file")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.prepare:
        return _prepare(args)
    if len(args.inputs) != 1:
        raise ValueError("give exactly one run config: kimik3 train CONFIG.toml (or a preset: kimik3 train tiny)")
    if args.stop_at is not None and args.stop_at < 1:
        raise ValueError(f"--stop-at must be a step >= 1, got {args.stop_at}")
    if args.threads is not None:
        import torch

        from kimik3.inference.threads import check_threads

        check_threads(args.threads, "--threads")
        torch.set_num_threads(args.threads)
    from kimik3.distributed import shutdown
    from kimik3.train import Trainer, load_train_config

    cfg = load_train_config(args.inputs[0], args.set)
    check_out_dir(cfg)
    if cfg.draft is not None:  # a [draft] table: train a speculative drafter for the frozen draft.target
        from kimik3.train.draft import DraftTrainer

        trainer = DraftTrainer(cfg, progress=not args.no_progress)
    else:
        trainer = Trainer(cfg, progress=not args.no_progress)
    try:
        status = trainer.run(stop_at=args.stop_at)
    finally:
        shutdown()
    if trainer.env.is_main:
        what = "drafter" if cfg.draft is not None else "checkpoints"
        print(f"kimik3 train: {status} at step {trainer.step}/{cfg.train.steps}; {what} in {trainer.root}")
    return 130 if status == "interrupted" else 0


def check_out_dir(cfg) -> None:
    """out_dir apart from every checkpoint the run reads (its checkpoint rotation deletes step folders there)."""
    from kimik3.cli.outputs import check_output

    config = cfg.model.config
    check_output(cfg.out_dir, "out_dir", {
        "model.checkpoint": cfg.model.checkpoint,
        "model.config": config if config is not None and Path(config).exists() else None,  # else a preset name
        "draft.target": cfg.draft.target if cfg.draft is not None else None})


def _prepare(args) -> int:
    from kimik3.train.data import prepare_shards

    if not args.inputs or not args.tokenizer:
        raise ValueError("--prepare needs --tokenizer and at least one text file")
    out = prepare_shards(args.inputs, args.tokenizer, args.prepare, args.shard_tokens)
    meta = json.loads((out / "meta.json").read_text())
    masked = ", with the assistant mask of its chat documents" if meta.get("mask_files") else ""
    print(f"kimik3 train --prepare: wrote {out}: {meta['num_tokens']:,} tokens, documents ended by id "
          f"{meta['eos_id']}{masked}", file=sys.stderr)
    return 0
