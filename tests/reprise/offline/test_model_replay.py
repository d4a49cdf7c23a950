"""Model replay: references are the engine's own greedy decoding, and a replayed drafter takes exactly
the steps the engine takes with the same drafter (no cost-model cut)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from testkit.neural import random_head

from neural_drafters.drafting import DraftSettings, HeadDrafter
from neural_drafters.hybrid import NeuralProposer
from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig
from reprise.offline.calls import select_calls
from reprise.offline.model_replay import decode_reference, simulate
from reprise.offline.tiny import byte_level_tokenizer, tiny_llama
from verifier.runner import ModelRunner
from verifier.testing import hf_greedy


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl.gz"
    lines = [{"tenant": "acme", "session": f"task{t}-trial{r}", "messages": [
        {"role": "user", "content": f"order {t} please"},
        {"role": "assistant", "content": "checking"},
        {"role": "user", "content": f"item {r}"},
        {"role": "assistant", "content": "done"}]} for r in range(3) for t in range(2)]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(x) for x in lines))
    return tiny_llama(seed=2), byte_level_tokenizer(), path


def test_calls_follow_trials_and_references_are_greedy(setup, tmp_path) -> None:
    model, tok, path = setup
    calls = select_calls(path, tok, calls=4, trials=2, call_index=1, prompt_tokens=40)
    assert [c.session for c in calls] == ["task0-trial0", "task1-trial0", "task0-trial1", "task1-trial1"]
    assert all(len(c.prompt_ids) == 40 for c in calls)
    refs = decode_reference(model, tok, calls, max_new_tokens=10, cache_dir=tmp_path, model_key="tiny")
    for ref in refs:
        out = list(ref.output_ids)
        assert out == hf_greedy(model, list(ref.call.prompt_ids), len(out), eos=True)
        assert ref.hidden.shape == (len(ref.call.prompt_ids) - 1 + len(out), 64)
    again = decode_reference(model, tok, calls, max_new_tokens=10, cache_dir=tmp_path, model_key="tiny")
    assert [r.output_ids for r in again] == [r.output_ids for r in refs]  # read back from the cache
    assert torch.allclose(again[0].hidden, refs[0].hidden, atol=1e-2)


def test_replay_takes_the_engines_steps(setup) -> None:
    model, tok, path = setup
    calls = select_calls(path, tok, calls=4, trials=2, call_index=1, prompt_tokens=40)
    refs = decode_reference(model, tok, calls, max_new_tokens=16)
    head, parts = random_head(model, "eagle", seed=4, std=0.2)
    drafter = HeadDrafter(head, parts, DraftSettings(top_k=3, depth=3))
    report = simulate(NeuralProposer(drafter), refs, budget=8, max_new_tokens=16)
    engine = Engine(ModelRunner(model, max_len=80, max_draft_nodes=8), NeuralProposer(drafter), tok,
                    EngineConfig(budget=DraftBudget(max_draft_tokens=8, adaptive=False)))
    steps = accepted = 0
    for ref in refs:
        result = engine.generate(list(ref.call.prompt_ids), tenant="acme", max_new_tokens=16)
        assert tuple(result.token_ids) == ref.output_ids
        steps += result.usage.steps
        accepted += result.usage.accepted_tokens
    assert (report.steps, report.accepted) == (steps, accepted)
    assert report.tau == sum(len(r.output_ids) for r in refs) / steps


def test_vocab_prefix_limits_the_draft_tokens(setup) -> None:
    model, _, _ = setup
    head, parts = random_head(model, "eagle", seed=5, std=0.2)
    keep = head.d2t[:16].tolist()
    drafter = HeadDrafter(head, parts, DraftSettings(top_k=4, depth=3, vocab=16))
    request = drafter.start(list(range(10)))
    with torch.inference_mode():
        request.observe_hidden(model.base_model(torch.tensor([list(range(10))])).last_hidden_state[0, :9])
    draft = request.propose(12)
    assert len(draft) and set(draft.token_ids.tolist()) <= set(keep)
    with pytest.raises(ValueError, match="vocab must be >= 0"):
        DraftSettings(vocab=-1)
