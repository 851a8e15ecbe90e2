"""Smoke tests for the CPU training path: corpus, composed forward, steps, checkpoint/resume."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec
from tinyloop.model.presets import init_model
from tinyloop.tokenizer import default_tokenizer
from tinyloop.train.corpus import (
    CorpusSpec,
    build_corpus,
    format_problems,
    held_out_problems,
    sample_batch,
    source_files,
    split_files,
    training_problems,
    validation_text,
)
from tinyloop.train.steps import lm_loss, sample_loops, train_forward
from tinyloop.train.trainer import CHECKPOINT_NAME, TrainConfig, Trainer, demo_model_config

TINY = demo_model_config(hidden=32, heads=2, kv_heads=2, head_dim=16, intermediate=64,
                         max_position=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def source_dir(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for rel in ["a.py", "b.py", "pkg/c.py", "pkg/d.py", "pkg/sub/e.py", "z.py", "notes.txt",
                "test/t.py", "pkg/tests/t.py", "idlelib/idle_test/t.py", "site-packages/s.py"]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {rel}\n" + "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(30)))
    return root


def _spec(root: Path) -> CorpusSpec:
    return CorpusSpec(source_dir=str(root), val_fraction=0.2, n_held_out=50, n_train_problems=500)


def test_corpus_files_and_splits_are_deterministic(source_dir: Path, tmp_path: Path) -> None:
    files = source_files(source_dir)
    assert files == ["a.py", "b.py", "pkg/c.py", "pkg/d.py", "pkg/sub/e.py", "z.py"]
    train, val = split_files(files, 0.2)
    assert len(val) == 2 and set(train) | set(val) == set(files) and not set(train) & set(val)
    assert split_files(list(reversed(files)), 0.2)[1] == sorted(val, key=files.index)[::-1]
    tok = default_tokenizer()
    fresh = build_corpus(_spec(source_dir), tok, tmp_path / "cache")
    cached = build_corpus(_spec(source_dir), tok, tmp_path / "cache")
    uncached = build_corpus(_spec(source_dir), tok, None)
    for name in ("text_train", "text_val", "arith_train", "held_out"):
        assert np.array_equal(getattr(fresh, name), getattr(cached, name))
        assert np.array_equal(getattr(fresh, name), getattr(uncached, name))
    assert fresh.val_files == tuple(val)
    assert np.array_equal(validation_text(_spec(source_dir), tok), fresh.text_val)
    b1 = sample_batch(fresh, 0, 7, 4, 16, 0.25)
    assert b1.shape == (4, 17) and torch.equal(b1, sample_batch(cached, 0, 7, 4, 16, 0.25))
    assert tok.decode(b1[3].tolist()).count("=") >= 1  # the last row is an addition window


def test_addition_never_leaks_held_out_pairs() -> None:
    held = held_out_problems(0, 1000)
    assert len({tuple(p) for p in held.tolist()}) == 1000
    train = training_problems(0, 20000, held)
    banned = {tuple(p) for p in held.tolist()} | {(b, a) for a, b in held.tolist()}
    assert not banned & {tuple(p) for p in train.tolist()}
    assert train.min() >= 0 and train.max() < 100000
    assert set(np.char.str_len(train.astype(str)).ravel().tolist()) == {1, 2, 3, 4, 5}
    assert format_problems(np.array([[417, 386], [0, 5]])) == "417+386=803\n0+5=5\n"
    assert np.array_equal(held, held_out_problems(0, 1000))
    long_held = held_out_problems(0, 500, max_digits=8)
    long_train = training_problems(0, 20000, long_held, max_digits=8)
    assert set(np.char.str_len(long_train.astype(str)).ravel().tolist()) == set(range(1, 9))
    banned = {tuple(p) for p in long_held.tolist()} | {(b, a) for a, b in long_held.tolist()}
    assert not banned & {tuple(p) for p in long_train.tolist()}
    with pytest.raises(ValueError, match="max_digits"):
        CorpusSpec(max_digits=10)


def test_loop_draw_is_heavy_tailed_around_the_mean() -> None:
    draws = [sample_loops(0, s, 4.0, 16) for s in range(2000)]
    assert min(draws) == 1 and max(draws) <= 16 and 3.6 < np.mean(draws) < 4.4
    assert draws == [sample_loops(0, s, 4.0, 16) for s in range(2000)]


@pytest.mark.parametrize("state_init", ["zeros", "embed"])
def test_composed_forward_matches_looped_lm(state_init: str) -> None:
    config = TINY.replace(state_init=state_init)
    model = init_model(config, seed=1).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for loops in (1, 3, 5):
            ours = train_forward(model, tokens, loops, backprop=3)
            ctx = FullContext(model.rope, 2, 12)
            ref = model(tokens, ctx, [RowSpec(loops=loops, window=loops)] * 2, last_only=False).logits
            torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_two_steps_reduce_loss_on_a_repeated_batch() -> None:
    model = init_model(TINY, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = lm_loss(train_forward(model, batch[:, :-1], 4, backprop=2), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert model.prelude[0].attn.qkv.weight.grad is not None  # reached through injection
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[2] < losses[0]


def _trainer(source_dir: Path, out: Path) -> Trainer:
    tok = default_tokenizer()
    corpus = build_corpus(_spec(source_dir), tok, None)
    config = TrainConfig(steps=10, batch=2, seq_len=16, warmup=2, bf16=False, eval_windows=2)
    return Trainer(TINY, config, corpus, _spec(source_dir), tok, out)


def test_checkpoint_resume_is_bit_exact(source_dir: Path, tmp_path: Path) -> None:
    first = _trainer(source_dir, tmp_path)
    first.train_step()
    first.train_step()
    first.save_checkpoint()
    resumed = _trainer(source_dir, tmp_path)
    resumed.load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert (resumed.step, resumed.tokens_seen) == (2, first.tokens_seen)
    for (name, a), b in zip(first.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert first.train_step() == resumed.train_step()
    for a, b in zip(first.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_export_writes_a_loadable_artifact(source_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tinyloop.model.artifact import load_artifact

    trainer = _trainer(source_dir, tmp_path)
    trainer.train_step()
    trainer.save_checkpoint()
    script = Path(__file__).parents[2] / "scripts" / "train_demo.py"
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "ACTIVE"))  # script sets it
    spec = importlib.util.spec_from_file_location("train_demo", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "demo.tinyloop"
    threads = torch.get_num_threads()
    try:
        module.main(["--out", str(tmp_path), "--export", str(out), "--export-default-loops", "8",
                     "--threads", str(threads)])
    finally:
        torch.set_num_threads(threads)
    artifact = load_artifact(out)
    assert artifact.config == TINY.replace(default_loops=8)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(artifact.model.state_dict()[name], tensor), name


def test_addition_accuracy_generates_enough_tokens_for_the_longest_sum() -> None:
    """A stand-in model that always writes the right answer scores 100% on 8-digit operands:
    the generation budget follows the sums' length (it once stopped at 7 tokens)."""
    from types import SimpleNamespace

    from tinyloop.model.layers import Rope
    from tinyloop.train.evaluate import addition_accuracy

    tok = default_tokenizer()

    class Oracle:
        rope = Rope(16, 64, 10000.0, "half")

        def __call__(self, tokens: torch.Tensor, ctx: object, specs: object, last_only: bool) -> SimpleNamespace:
            logits = torch.full((len(tokens), 1, tok.vocab_size), -1e9)
            for i, row in enumerate(tokens.tolist()):
                line = [x for x in tok.decode(row).split("\n") if "=" in x][-1]
                question, _, written = line.partition("=")
                a, b = map(int, question.split("+"))
                answer = f"{a + b}\n\n"  # then newlines, once the answer is out
                logits[i, 0, tok.encode(answer[min(len(written), len(answer) - 1)])[0]] = 0.0
            return SimpleNamespace(logits=logits)

    pairs = np.array([[99_999_999, 99_999_999], [12_345_678, 1], [7, 5]])
    assert addition_accuracy(Oracle(), tok, pairs, loops=1) == 1.0  # type: ignore[arg-type]
