"""The training loop: AdamW, warmup + cosine, truncated backprop through the last loops, checkpoints.

A run is reproducible from its ``TrainConfig``: batches and loop counts are pure functions of
``(seed, step)``, the learning rate a function of the step, and a checkpoint holds the model,
the optimizer, the step and the RNG states, so ``--resume`` continues bit-exactly (on the same
machine and thread count). Checkpoints are written to a temp file and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from tinyloop.model.config import ModelConfig
from tinyloop.model.looped import LoopedLM
from tinyloop.model.presets import init_model
from tinyloop.tokenizer import Tokenizer
from tinyloop.train.corpus import Corpus, CorpusSpec, sample_batch, val_windows
from tinyloop.train.evaluate import addition_prefix, evaluate
from tinyloop.train.steps import lm_loss, lr_at, sample_loops, train_forward

__all__ = ["TrainConfig", "demo_model_config", "Trainer", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"


def demo_model_config(**changes: Any) -> ModelConfig:
    """The small Huginn-style model trained on CPU (about 4.6M parameters)."""
    base = ModelConfig(vocab_size=4096, hidden=256, heads=4, kv_heads=4, head_dim=64,
                       intermediate=768, n_prelude=1, n_core=2, n_coda=1, default_loops=4,
                       max_loops=32, max_position=256, block_style="sandwich",
                       injection="concat_linear", state_init="zeros", tie_embeddings=True,
                       embed_scale=16.0)
    return base.replace(**changes)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seed: int = 0  # init, batches and loop draws
    steps: int = 4000  # total optimizer steps (the cosine schedule's length)
    batch: int = 16  # rows per step
    seq_len: int = 256  # tokens per row (the model's context)
    arith_fraction: float = 0.25  # share of rows that are addition windows
    lr: float = 2e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor as a share of the peak
    warmup: int = 200  # linear warmup steps
    weight_decay: float = 0.1  # on matrices only
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # global norm
    mean_loops: float = 4.0  # mean of the per-step loop draw
    max_train_loops: int = 16  # the draw is clipped to 1..this
    backprop_loops: int = 3  # gradients flow through the last k loops
    bf16: bool = True  # torch.autocast("cpu", bfloat16) for the training forward/backward
    log_every: int = 20  # steps between train log lines
    eval_every_min: float = 10.0  # minutes between evaluations
    ckpt_every_min: float = 10.0  # minutes between checkpoints
    eval_loops: tuple[int, ...] = (1, 2, 4, 8)
    eval_problems: int = 200  # held-out addition problems per evaluation
    eval_windows: int = 32  # text validation windows per evaluation

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        data = dict(data)
        data["betas"] = tuple(data["betas"])
        data["eval_loops"] = tuple(data["eval_loops"])
        return cls(**data)


def _param_groups(model: LoopedLM, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class Trainer:
    """Owns the model, optimizer and counters of one run; ``run`` trains until done or stopped."""

    def __init__(self, model_config: ModelConfig, config: TrainConfig, corpus: Corpus,
                 corpus_spec: CorpusSpec, tokenizer: Tokenizer, out_dir: Path,
                 log: TextIO | None = None) -> None:
        self.model_config = model_config
        self.config = config
        self.corpus = corpus
        self.corpus_spec = corpus_spec
        self.tokenizer = tokenizer
        self.out_dir = Path(out_dir)
        self.log_file = log
        self.model = init_model(model_config, seed=config.seed).train()
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, config.weight_decay),
                                           lr=config.lr, betas=config.betas, fused=False)
        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0  # wall time spent in training steps, across resumes
        self.stop_requested = False
        self.last_grad_norm = 0.0  # before clipping
        self._val = val_windows(corpus, config.eval_windows, config.seq_len)
        self._prefix = addition_prefix(corpus.arith_train, tokenizer)

    def __repr__(self) -> str:
        return (f"Trainer(step={self.step}/{self.config.steps}, tokens_seen={self.tokens_seen}, "
                f"out_dir={str(self.out_dir)!r})")

    # -- logging -------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        print(stamped, flush=True)
        if self.log_file is not None:
            self.log_file.write(stamped + "\n")
            self.log_file.flush()

    # -- one step ------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, int]:
        """One optimizer step at ``self.step``; returns (loss, loops).

        A non-finite loss returns before any update and without advancing the step.
        """
        c = self.config
        batch = sample_batch(self.corpus, c.seed, self.step, c.batch, c.seq_len, c.arith_fraction)
        loops = sample_loops(c.seed, self.step, c.mean_loops, c.max_train_loops)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, c.lr, c.warmup, c.steps, c.min_lr_ratio)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
            logits = train_forward(self.model, batch[:, :-1], loops, c.backprop_loops)
            loss = lm_loss(logits, batch[:, 1:])
        if not torch.isfinite(loss):  # leave the weights (and the last checkpoint) intact
            return float(loss.detach()), loops
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip))
        self.optimizer.step()
        self.step += 1
        self.tokens_seen += batch[:, :-1].numel()
        return float(loss.detach()), loops

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        c = self.config
        pairs = self.corpus.held_out[:c.eval_problems]
        t0 = time.monotonic()
        result = evaluate(self.model, self.tokenizer, self._val, pairs, c.eval_loops, self._prefix)
        losses = " ".join(f"L{r}={v:.4f}" for r, v in result["val_loss"].items())
        accs = " ".join(f"L{r}={v:.3f}" for r, v in result["add_acc"].items())
        self.log(f"eval step={self.step} tokens={self.tokens_seen} | val_loss {losses} | "
                 f"add_acc {accs} | {time.monotonic() - t0:.1f}s")
        record = {"step": self.step, "tokens": self.tokens_seen, **{
            k: {str(r): v for r, v in d.items()} for k, d in result.items()}}
        with open(self.out_dir / "evals.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": self.train_seconds,
            "model_config": self.model_config.to_json(),
            "train_config": dataclasses.asdict(self.config),
            "corpus_spec": dataclasses.asdict(self.corpus_spec),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def save_checkpoint(self) -> Path:
        path = self.out_dir / CHECKPOINT_NAME
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(self.checkpoint_state(), tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.log(f"checkpoint step={self.step} -> {path}")
        return path

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        if ModelConfig.from_json(state["model_config"]) != self.model_config:
            raise ValueError(f"{path}: checkpoint model config differs from this run's")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.train_seconds = float(state["train_seconds"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    # -- the loop ------------------------------------------------------------------------------
    def run(self, max_minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Train until ``steps``, the time budget, or ``stop_requested``; always checkpoint at exit."""
        c = self.config
        start = clock()
        last_eval = last_ckpt = start
        if self.step == 0:
            self.evaluate()
        window_loss, window_tokens, window_time, window_loops, window_steps = 0.0, 0, 0.0, 0, 0
        window_gnorm = 0.0
        while self.step < c.steps and not self.stop_requested:
            t0 = clock()
            loss, loops = self.train_step()
            dt = clock() - t0
            self.train_seconds += dt
            if not math.isfinite(loss):
                self.log(f"non-finite loss {loss} at step {self.step}; stopping without a checkpoint")
                return
            window_loss += loss
            window_tokens += c.batch * c.seq_len
            window_time += dt
            window_loops += loops
            window_steps += 1
            window_gnorm += self.last_grad_norm
            if self.step % c.log_every == 0:
                n = window_steps  # fewer than log_every right after a resume
                self.log(f"step={self.step} tokens={self.tokens_seen} "
                         f"tok/s={window_tokens / window_time:.0f} loss={window_loss / n:.4f} "
                         f"mean_loops={window_loops / n:.2f} gnorm={window_gnorm / n:.2f} "
                         f"lr={self.optimizer.param_groups[0]['lr']:.2e}")
                window_loss, window_tokens, window_time, window_loops, window_steps = 0.0, 0, 0.0, 0, 0
                window_gnorm = 0.0
            now = clock()
            if now - last_eval >= c.eval_every_min * 60:
                self.evaluate()
                last_eval = clock()
            if now - last_ckpt >= c.ckpt_every_min * 60:
                self.save_checkpoint()
                last_ckpt = clock()
            if now - start >= max_minutes * 60:
                self.log(f"time budget of {max_minutes} min reached at step {self.step}")
                break
        if self.step >= c.steps:
            self.log(f"finished {c.steps} steps")
            self.evaluate()
        self.save_checkpoint()
