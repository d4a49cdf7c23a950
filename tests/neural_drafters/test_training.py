"""Training: losses fall, agreement is measured on held-out data, checkpoints are atomic and resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neural_drafters import checkpoint as ckpt
from neural_drafters.config import HeadConfig
from neural_drafters.heads import TargetParts, build_head
from neural_drafters.training import (
    Example,
    FeatureSet,
    Trainer,
    TrainSettings,
    choose_draft_vocab,
    extract_features,
)
from verifier.testing import hf_greedy


@pytest.fixture(scope="module")
def features(target):
    """The target's own greedy continuations of random prompts (learnable: the head can agree)."""
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(8):
        prompt = rng.integers(0, 128, 6).tolist()
        ids = prompt + hf_greedy(target, prompt, 40)
        mask = np.zeros(len(ids), bool)
        mask[6:] = True
        examples.append(Example(np.array(ids, np.int32), mask))
    return extract_features(target, examples[:6]), extract_features(target, examples[6:])


def make_trainer(target, train, kind: str, steps: int = 40, num_heads: int = 1) -> Trainer:
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, kind, draft_vocab_size=96, num_heads=num_heads)
    head = build_head(config)
    head.d2t.copy_(choose_draft_vocab(train, 96, 128))
    settings = TrainSettings(steps=steps, batch_size=4, seq_len=24, lr=3e-3, warmup=4)
    return Trainer(head, TargetParts.from_model(target, head.d2t), train, settings)


def test_features_hold_states_and_greedy_tokens(target, features) -> None:
    train, _ = features
    assert len(train) == 6 and train.num_tokens == 6 * 46 and train.num_masked == 6 * 40
    with torch.inference_mode():
        hidden = target.base_model(torch.tensor([train.tokens[0].tolist()])).last_hidden_state[0]
    assert torch.allclose(train.hidden[0].float(), hidden, atol=2e-2)  # stored as fp16
    # the prompt's greedy continuation: the greedy token at position i is token i+1 after the prompt
    assert np.array_equal(train.greedy[0][5:-1], train.tokens[0][6:])


def test_draft_vocab_keeps_the_frequent_greedy_tokens(features) -> None:
    train, _ = features
    d2t = choose_draft_vocab(train, 20, 128)
    assert len(d2t) == 20 and len(set(d2t.tolist())) == 20
    counts = np.bincount(np.concatenate([g[m] for g, m in zip(train.greedy, train.masks)]), minlength=128)
    assert np.all(np.diff(counts[d2t.numpy()]) <= 0)  # most frequent first: a prefix is a smaller vocabulary
    assert set(np.argsort(-counts, kind="stable")[:10].tolist()) == set(d2t[:10].tolist())
    with pytest.raises(ValueError, match="draft vocabulary size"):
        choose_draft_vocab(train, 0, 128)


@pytest.mark.parametrize("kind,num_heads", [("eagle", 1), ("medusa", 2), ("mtp", 2)])
def test_loss_falls_and_agreement_rises(target, features, kind, num_heads) -> None:
    train, _ = features
    trainer = make_trainer(target, train, kind, num_heads=num_heads)
    before = trainer.evaluate(train)["agreement"]
    losses = [trainer.train_step()["loss"] for _ in range(40)]
    after = trainer.evaluate(train)["agreement"]
    assert len(after) == num_heads
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert after[0] > before[0] + 0.05


def test_checkpoint_round_trip_and_resume_equals_one_run(target, features, tmp_path) -> None:
    train, held_out = features
    straight = make_trainer(target, train, "eagle", steps=6)
    for _ in range(6):
        straight.train_step()
    first = make_trainer(target, train, "eagle", steps=6)
    for _ in range(3):
        first.train_step()
    ckpt.save_checkpoint(tmp_path, first.head, step=3, summary={"x": 1}, trainer_state=first.state_dict())
    head, info = ckpt.load_head(tmp_path)
    assert info["step"] == 3 and info["summary"] == {"x": 1}
    resumed = Trainer(head, TargetParts.from_model(target, head.d2t), train, first.settings)
    resumed.load_state_dict(ckpt.load_trainer_state(tmp_path))
    for _ in range(3):
        resumed.train_step()
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert resumed.evaluate(held_out) == straight.evaluate(held_out)


def test_a_failed_save_keeps_the_previous_checkpoint(target, features, tmp_path, monkeypatch) -> None:
    train, _ = features
    trainer = make_trainer(target, train, "eagle")
    ckpt.save_checkpoint(tmp_path, trainer.head, step=1)
    trainer.train_step()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, trainer.head, step=2)
    assert ckpt.checkpoint_dir(tmp_path).name == "step-000001"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step")]  # no temporary left behind
    _, info = ckpt.load_head(tmp_path)
    assert info["step"] == 1


def test_checkpoint_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_head(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no LATEST file"):
        ckpt.load_head(tmp_path)
    (tmp_path / "LATEST").write_text("step-000009\n")
    with pytest.raises(FileNotFoundError, match="step-000009"):
        ckpt.load_head(tmp_path)


def test_settings_and_config_validate() -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainSettings(steps=0)
    with pytest.raises(ValueError, match="unknown head kind 'lstm'"):
        HeadConfig("lstm", 64, 4, 2, 16, 128, 128, 128)
    with pytest.raises(ValueError, match="draft_vocab_size 200 exceeds vocab_size 128"):
        HeadConfig("eagle", 64, 4, 2, 16, 128, 128, 200)
    with pytest.raises(ValueError, match="unknown head config keys: color"):
        HeadConfig.from_dict({"color": 1})
    with pytest.raises(ValueError, match="no training examples"):
        Trainer(build_head(HeadConfig("eagle", 64, 4, 2, 16, 128, 128, 128)), None, FeatureSet(), TrainSettings())
