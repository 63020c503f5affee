"""The training loop: build everything from a TrainConfig, resume, run steps, evaluate, log, checkpoint.

    trainer = Trainer(load_train_config("tiny"))   # a shipped preset, or a TOML file
    trainer.run()            # "done", "interrupted" (Ctrl-C / SIGTERM: saved after the current step), "stopped"

A run lives in `out_dir`: `checkpoints/step-*/` (see checkpointing.py) and `metrics.jsonl`. Starting again
with the same config resumes from the newest checkpoint (`checkpoint.resume = "auto"`), bit for bit: weights
and biases, optimizer state, RNG and the data position are restored, and the learning rate is a function of
the step. Under torchrun every rank runs this same loop (FSDP2 data parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from kimik3 import lora
from kimik3.distributed import all_reduce, barrier, init_distributed, parallelize
from kimik3.distributed.expert_checkpoint import gather_experts, shard_expert_optimizer_state
from kimik3.model import K3ForCausalLM
from kimik3.train import checkpointing as ckpt
from kimik3.train.balancing import Balancer
from kimik3.train.build import build_model
from kimik3.train.config import TrainConfig
from kimik3.train.data import RowSampler, eval_batches, open_stream, step_batches
from kimik3.train.loss import CausalLMLoss
from kimik3.train.metrics import MetricsLog, Progress, flops_per_token, peak_flops
from kimik3.train.optim import build_optimizer, lr_factor
from kimik3.train.step import evaluate, keep_routers_fp32, train_step

# a resumed run must read the same rows in the same order: these keys (and the rows per step) must not change
RESUME_KEYS = ("data.train", "data.seq_len", "data.shuffle", "data.seed", "optim.name")
# keys that only shape how a run begins: a resumed run's weights and random state come from its checkpoint
START_KEYS = ("model.init_seed", "train.seed")


def _dotted(d: dict, key: str):
    section, name = key.split(".")
    return (d.get(section) or {}).get(name)


def _fresh_out_dir(out_dir: str) -> str:
    """A sibling of `out_dir` that does not exist yet (`runs/x-2`, `runs/x-3`, ...), to name in advice."""
    base = str(out_dir).rstrip("/\\") or "."
    n = 2
    while Path(f"{base}-{n}").exists():
        n += 1
    return f"{base}-{n}"


class Trainer:
    """Everything one training run needs, built from `cfg` (on every rank under torchrun)."""

    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        self.cfg, t = cfg, cfg.train
        self.env = init_distributed(t.device)
        self.root = Path(cfg.out_dir) / "checkpoints"
        resume = self._resume_path()
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        np.random.seed(t.seed)
        self.k3cfg, self.lm = build_model(cfg.model, resume, self.env.device, frozen_base=cfg.lora is not None)
        if cfg.lora is not None:
            self._apply_lora()
        # a LoRA run keeps the router's correction bias frozen with the rest of the base: statistics only
        method = "frozen" if cfg.lora is not None else cfg.balancing.method
        self.balancer = Balancer(self.lm, method, cfg.balancing.bins, cfg.balancing.ema, cfg.balancing.sign_gamma)
        self.model = CausalLMLoss(self.lm, t.loss_chunk_tokens)
        if t.precision == "bf16":
            keep_routers_fp32(self.model)
        self.expert_parallel = t.expert_parallel and self.env.world_size > 1
        parallelize(self.model, activation_checkpointing=t.activation_checkpointing,
                    data_parallel=self.env.world_size > 1, expert_parallel=self.expert_parallel)
        o = cfg.optim
        self.optim = build_optimizer(self.model, o.name, o.lr, o.weight_decay, tuple(o.betas), o.eps, o.muon_momentum)
        vocab = self.lm.config.vocab_size
        d = cfg.data
        self.train_rows = RowSampler(open_stream(d.train, "data.train", d.tokenizer, d.eos_id), d.seq_len, vocab,
                                     d.shuffle, d.seed)
        self.valid_rows = (RowSampler(open_stream(d.valid, "data.valid", d.tokenizer, d.eos_id), d.seq_len, vocab,
                                      shuffle=False) if d.valid else None)
        self.rows_per_step = self.env.world_size * t.grad_accum * t.micro_batch_rows
        self.step = 0
        if resume is not None:
            self._restore(resume)
            if self.env.is_main:  # said with or without a progress bar: the run did not start over
                print(f"kimik3 train: resumed from step {self.step} ({resume})", file=sys.stderr, flush=True)
        self.metrics = MetricsLog(Path(cfg.out_dir) / "metrics.jsonl", self.env.is_main,
                                  self.step if resume is not None else None)
        self.progress_mode = ("off" if not self.env.is_main else "bar" if progress and cfg.log.progress
                              else "lines")
        self.flops = flops_per_token(self.lm.config, d.seq_len)
        self.peak = peak_flops(self.env.device, cfg.log.peak_tflops)
        self._stop = False

    def _apply_lora(self) -> None:
        """Freeze the base and put the [lora] adapter on it; print its size (before step 1)."""
        if self.env.world_size > 1:
            raise ValueError("[lora]: adapter training runs in one process for now (launch without torchrun)")
        lora.apply(self.lm, self.cfg.lora)
        if self.env.is_main:
            print(lora.format_adapter_size(self.lm), flush=True)

    def _resume_path(self) -> Path | None:
        mode = self.cfg.checkpoint.resume
        if self.env.is_main:
            ckpt.remove_partials(self.root)
        barrier()
        found = ckpt.list_checkpoints(self.root)
        if mode == "never":
            if found:  # new step folders would interleave with the old run's, and "auto" would mix them up
                fresh = _fresh_out_dir(self.cfg.out_dir)
                raise ValueError(f"checkpoint.resume = 'never', but {self.root} already holds {found[-1].name}; "
                                 f"start the new run in another folder (--set out_dir={fresh}) or move the old "
                                 "checkpoints away")
            return None
        if mode == "auto":
            return found[-1] if found else None
        path = Path(mode)
        if not (path / ckpt.TRAINER_STATE).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a training checkpoint (no trainer.pt)")
        return path

    def _restore(self, path: Path) -> None:
        state = ckpt.load_trainer_state(path)
        old, new = state["config"], self.cfg.to_dict()
        changed = [key for key in RESUME_KEYS if _dotted(old, key) != _dotted(new, key)]
        if old.get("lora") != new.get("lora"):
            changed.append("[lora] settings")
        if state["rows_per_step"] != self.rows_per_step:
            changed.append(f"rows per step (ranks x grad_accum x micro_batch_rows: {state['rows_per_step']} -> "
                           f"{self.rows_per_step})")
        if changed:  # the advice names a folder that does not exist, so following it starts a run
            fresh = _fresh_out_dir(self.cfg.out_dir)
            raise ValueError(f"{path} was written by a run with different {', '.join(changed)}; resuming would not "
                             f"continue that run. To start over, run in another folder: --set out_dir={fresh}. To "
                             "start from its weights instead, also replace model.config in the run config with "
                             f"model.checkpoint = \"{path / 'model'}\"")
        ignored = [key for key in START_KEYS if _dotted(old, key) not in (None, _dotted(new, key))]
        if ignored and self.env.is_main:
            said = ", ".join(f"{key} {_dotted(old, key)!r} -> {_dotted(new, key)!r}" for key in ignored)
            warnings.warn(f"resuming {path}: {said} has no effect (it sets how a run begins; a resumed run's weights "
                          "and random state come from its checkpoint); to apply it, start in another folder: "
                          f"--set out_dir={_fresh_out_dir(self.cfg.out_dir)}", stacklevel=2)
        for key in ignored:  # the run's later checkpoints record the values it began with
            section, name = key.split(".")
            part = dataclasses.replace(getattr(self.cfg, section), **{name: _dotted(old, key)})
            self.cfg = dataclasses.replace(self.cfg, **{section: part})
        if self.cfg.lora is not None:
            lora.load_weights(self.lm, path / ckpt.ADAPTER)
        if self.env.world_size == 1:
            ckpt.load_named_optimizer_state(self.model, self.optim.optimizers, state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            optim_state = state["optimizer"]
            if self.expert_parallel:
                optim_state = shard_expert_optimizer_state(self.model, optim_state)
            # strict=False: a parameter that never had a gradient (layer 0's attention pseudo-query) has no state
            set_optimizer_state_dict(self.model, self.optim.optimizers, optim_state,
                                     options=StateDictOptions(full_state_dict=True, strict=False))
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]

    def _save(self) -> Path | None:
        """Collect full weights and optimizer state (collective under FSDP); rank 0 writes the step folder."""
        if self.env.world_size == 1:
            model_to_save, optim_state = self.lm, ckpt.named_optimizer_state(self.model, self.optim.optimizers)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_model_state_dict(self.model, options=opts)
            optim_state = get_optimizer_state_dict(self.model, self.optim.optimizers, options=opts)
            if self.expert_parallel:  # FSDP leaves the sharded experts out: every rank's rows joined here
                weights, states = gather_experts(self.model, self.optim.optimizers)
                if self.env.is_main:
                    full.update(weights)
                    optim_state["state"].update(states)
            model_to_save = None
            if self.env.is_main:
                with torch.device("meta"):
                    model_to_save = K3ForCausalLM(self.lm.config, torch.float32)
                model_to_save.load_state_dict({k.removeprefix("lm."): v for k, v in full.items()}, assign=True)
        path = None
        if self.env.is_main:
            state = {"step": self.step, "optimizer": optim_state, "rng": ckpt.rng_state(), "version": 1,
                     "config": self.cfg.to_dict(), "rows_per_step": self.rows_per_step,
                     "world_size": self.env.world_size}
            path = ckpt.save_checkpoint(self.root, self.step, model_to_save, self.k3cfg, state,
                                        self.cfg.checkpoint.keep, self.cfg.to_dict(),
                                        adapter_only=self.cfg.lora is not None,
                                        eos_id=self.train_rows.stream.eos_id)
        barrier()
        return path

    @contextlib.contextmanager
    def _signals(self):
        """Ctrl-C / SIGTERM: finish the current step, save, stop. A second Ctrl-C interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            if self._stop and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop = True

        old = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _stop_requested(self) -> bool:
        """Every rank stops at the same step (a signal may reach the ranks at different times)."""
        return bool(all_reduce(torch.tensor([float(self._stop)], device=self.env.device), op="max").item())

    def _evaluate(self, progress: Progress) -> None:
        t = self.cfg.train
        batches = eval_batches(self.valid_rows, self.cfg.eval.rows, self.env.rank, self.env.world_size,
                               t.micro_batch_rows)
        result = evaluate(self.model, batches, device=self.env.device, precision=t.precision)
        self.metrics.write({"step": self.step, **result})
        progress.print(f"step {self.step}: eval loss {result['eval_loss']:.4f} (ppl {result['eval_ppl']:.2f})")

    def _log(self, res, seconds: float, elapsed: float) -> dict:
        tps = res.tokens / max(seconds, 1e-9)
        record = {"step": self.step, "loss": res.loss, "lr": self.optim.param_groups[0]["lr"],
                  "grad_norm": res.grad_norm, "tokens": res.tokens, "tokens_per_s": tps, "elapsed_s": elapsed}
        if self.peak:
            record["mfu"] = self.flops * tps / (self.env.world_size * self.peak)
        if res.balance:
            layers = {re.sub(r".*layers\.(\d+)\..*", r"\1", k): {n: round(v, 6) for n, v in m.items()}
                      for k, m in res.balance["layers"].items()}
            record["balance"] = {**{k: v for k, v in res.balance.items() if k != "layers"}, "layers": layers}
        if self.step % self.cfg.log.every == 0 or self.step == self.cfg.train.steps:
            self.metrics.write(record)
        return record

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _train_one_step(self, start: float) -> dict:
        t, o = self.cfg.train, self.cfg.optim
        batches = step_batches(self.train_rows, self.step, self.env.rank, self.env.world_size, t.grad_accum,
                               t.micro_batch_rows)
        self.optim.set_lr(lr_factor(self.step + 1, t.steps, o.warmup_steps, o.schedule, o.min_lr_ratio,
                                    o.decay_fraction))
        t0 = time.perf_counter()
        res = train_step(self.model, batches, self.optim, self.balancer, device=self.env.device,
                         precision=t.precision, clip_grad_norm=t.clip_grad_norm, world_size=self.env.world_size)
        self.step += 1
        return self._log(res, time.perf_counter() - t0, time.perf_counter() - start)

    def run(self, stop_at: int | None = None) -> str:
        """Train to `train.steps` (or `stop_at`, saving there). Returns "done", "stopped" or "interrupted"."""
        c = self.cfg
        end = c.train.steps if stop_at is None else min(stop_at, c.train.steps)
        progress = Progress(self.progress_mode, c.train.steps, self.step, c.log.every)
        status, saved_at, start, first = "done", None, time.perf_counter(), self.step
        try:
            with self._signals():
                while self.step < end:
                    record = self._train_one_step(start)
                    progress.update(self.step, record["loss"], record["tokens_per_s"])
                    if self.valid_rows is not None and self._due(c.eval.every):
                        self._evaluate(progress)
                    if self._due(c.checkpoint.every):
                        self._save()
                        saved_at = self.step
                    self._stop = self._stop or progress.closed  # nobody reads the run's output: as Ctrl-C
                    if self._stop_requested():
                        status = "interrupted"
                        break
                if status == "done" and self.step < c.train.steps:
                    status = "stopped"
                if self.step == first:  # nothing to do (a finished run started again, or stop_at reached)
                    return status
                if self.valid_rows is not None and status == "done" and not self._due(c.eval.every):
                    self._evaluate(progress)
                if saved_at != self.step:
                    self._save()
        finally:
            progress.close()
        return status

    def close(self) -> None:
        """Detach the balancing hooks (the process group, if any, is left to the caller)."""
        self.balancer.remove()
