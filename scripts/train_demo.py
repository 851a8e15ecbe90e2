"""Train the small Huginn-style demo model on CPU, resume it, or export it as a ``.tinyloop``.

    python3 scripts/train_demo.py --out /root/tinyloop-train --max-minutes 90
    python3 scripts/train_demo.py --out /root/tinyloop-train --resume --max-minutes 90
    python3 scripts/train_demo.py --out /root/tinyloop-train --resume --steps 5700 --mean-loops 6
    python3 scripts/train_demo.py --out /root/tinyloop-train --export demo.tinyloop
    python3 scripts/train_demo.py --out /root/tinyloop-train --report

The corpus (stdlib sources + synthetic addition, see ``tinyloop.train.corpus``) is tokenised once
and cached under ``--out``. The log goes to ``--out/train.log``, evaluations also to
``--out/evals.jsonl``, the checkpoint to ``--out/checkpoint.pt`` (every ``--ckpt-every-min``
minutes, at the end, and on SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

# Before torch loads OpenMP: spinning workers at barriers cost 3-4x throughput whenever another
# process wants a core (measured: 400 vs 1500 tok/s with two threads on a busy 2-core machine),
# and a sleeping worker costs almost nothing on an idle one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tinyloop.model.artifact import save_artifact  # noqa: E402
from tinyloop.model.config import ModelConfig
from tinyloop.model.presets import empty_model, param_count
from tinyloop.tokenizer import default_tokenizer
from tinyloop.train.corpus import CorpusSpec, build_corpus
from tinyloop.train.trainer import CHECKPOINT_NAME, TrainConfig, Trainer, demo_model_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint, log and corpus cache folder")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--export", type=Path, help="write the checkpoint's model as an artifact and exit")
    p.add_argument("--export-default-loops", type=int, help="default_loops stored in the artifact")
    p.add_argument("--report", action="store_true", help="print --out/evals.jsonl as tables and exit")
    p.add_argument("--max-minutes", type=float, default=90.0, help="wall-clock budget of this process")
    p.add_argument("--threads", type=int, default=2)
    t = TrainConfig()
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--steps", type=int, help=f"total steps, the cosine's length (default {t.steps}); "
                   "with --resume, a new length re-shapes the schedule from the current step on")
    p.add_argument("--batch", type=int, default=t.batch)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--warmup", type=int, default=t.warmup)
    # these three also retune a resumed run when given (the rest of a resumed run's config is fixed)
    p.add_argument("--mean-loops", type=float, help=f"mean of the loop draw (default {t.mean_loops})")
    p.add_argument("--backprop-loops", type=int, help=f"loops with gradients (default {t.backprop_loops})")
    p.add_argument("--arith-fraction", type=float,
                   help=f"share of addition rows (default {t.arith_fraction})")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=t.bf16)
    p.add_argument("--log-every", type=int, default=t.log_every)
    p.add_argument("--eval-every-min", type=float, default=t.eval_every_min)
    p.add_argument("--ckpt-every-min", type=float, default=t.ckpt_every_min)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--n-core", type=int, default=2)
    p.add_argument("--source-dir", default="", help="text source folder (default: the stdlib)")
    p.add_argument("--train-problems", type=int, default=CorpusSpec().n_train_problems)
    p.add_argument("--arith-max-digits", type=int,
                   help=f"digits of the longest addition operand (default {CorpusSpec().max_digits}); "
                   "with --resume, a new value rebuilds the addition problems and their held-out set")
    return p.parse_args(argv)


def export(args: argparse.Namespace) -> None:
    state = torch.load(args.out / CHECKPOINT_NAME, map_location="cpu", weights_only=False)
    config = ModelConfig.from_json(state["model_config"])
    if args.export_default_loops is not None:
        config = config.replace(default_loops=args.export_default_loops)
    model = empty_model(config)
    model.load_state_dict(state["model"], assign=True)
    meta = {"tinyloop.train": json.dumps({"step": state["step"], "tokens_seen": state["tokens_seen"],
                                          "train_config": state["train_config"],
                                          "corpus_spec": state["corpus_spec"]})}
    save_artifact(args.export, model.eval(), default_tokenizer(), extra_metadata=meta)
    print(f"wrote {args.export} from step {state['step']} ({param_count(config)} parameters)")


def report(args: argparse.Namespace) -> None:
    records = [json.loads(line) for line in (args.out / "evals.jsonl").read_text().splitlines()]
    for key, fmt in (("val_loss", "{:.3f}"), ("add_acc", "{:.3f}")):
        loops = list(records[-1][key])
        print(f"\n{key}\n| step | tokens | " + " | ".join(f"loops={r}" for r in loops) + " |")
        print("|---|---|" + "---|" * len(loops))
        for rec in records:
            cells = " | ".join(fmt.format(rec[key][r]) for r in loops)
            print(f"| {rec['step']} | {rec['tokens'] / 1e6:.2f}M | {cells} |")


RETUNABLE = ("mean_loops", "backprop_loops", "arith_fraction")


def configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, CorpusSpec]:
    ckpt = args.out / CHECKPOINT_NAME
    if args.resume:  # the run's own configs win, except the budget, cadences, --steps, RETUNABLE
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        train = TrainConfig.from_dict(state["train_config"])
        overrides = {k: getattr(args, k) for k in ("log_every", "eval_every_min", "ckpt_every_min")}
        for k in ("steps", *RETUNABLE):
            if getattr(args, k) is not None:
                overrides[k] = getattr(args, k)
        spec = CorpusSpec(**state["corpus_spec"])
        if args.arith_max_digits is not None:
            spec = dataclasses.replace(spec, max_digits=args.arith_max_digits)
        return ModelConfig.from_json(state["model_config"]), dataclasses.replace(train, **overrides), spec
    if ckpt.exists():
        sys.exit(f"{ckpt} exists: pass --resume to continue it, or choose another --out")
    model = demo_model_config(hidden=args.hidden, intermediate=args.intermediate, n_core=args.n_core)
    retuned = {k: getattr(args, k) for k in RETUNABLE if getattr(args, k) is not None}
    train = TrainConfig(seed=args.seed, steps=args.steps or TrainConfig().steps, batch=args.batch,
                        lr=args.lr, warmup=args.warmup, **retuned, bf16=args.bf16,
                        log_every=args.log_every, eval_every_min=args.eval_every_min,
                        ckpt_every_min=args.ckpt_every_min)
    return model, train, CorpusSpec(source_dir=args.source_dir, seed=args.seed,
                                    n_train_problems=args.train_problems,
                                    max_digits=args.arith_max_digits or CorpusSpec().max_digits)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.export is not None:
        export(args)
        return
    if args.report:
        report(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model_config, train_config, corpus_spec = configs(args)
    tokenizer = default_tokenizer()
    t0 = time.monotonic()
    corpus = build_corpus(corpus_spec, tokenizer, args.out)
    with open(args.out / "train.log", "a") as log:
        trainer = Trainer(model_config, train_config, corpus, corpus_spec, tokenizer, args.out, log)
        if args.resume:
            trainer.load_checkpoint(args.out / CHECKPOINT_NAME)
        trainer.log(f"{'resume' if args.resume else 'start'} step={trainer.step} {corpus!r} "
                    f"(corpus {time.monotonic() - t0:.1f}s) params={param_count(model_config)} "
                    f"threads={torch.get_num_threads()}")
        trainer.log(f"model {model_config.to_json()}")
        trainer.log(f"train {json.dumps(dataclasses.asdict(train_config))}")

        def request_stop(signum: int, frame: FrameType | None) -> None:
            trainer.log(f"signal {signum}: checkpointing after this step")
            trainer.stop_requested = True
            signal.signal(signum, signal.SIG_DFL)  # a second signal kills at once

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        trainer.run(args.max_minutes)


if __name__ == "__main__":
    main()
