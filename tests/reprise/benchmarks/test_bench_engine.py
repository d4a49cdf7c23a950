"""`reprise bench engine`: its arguments and how it turns the methods' outputs into figures.

The engines themselves are exercised by tests/reprise/backends/test_vllm_engine.py (real vLLM); here
the summary is checked on outputs made up for the purpose, so the ratios and the identity verdicts are
known exactly.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest

from reprise.arguments import CliError
from reprise.backends.vllm.attach import MAX_SPECULATIVE_TOKENS
from reprise.benchmarks import engine as bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_the_service() -> None:
    args = _args()
    assert args.speculative_tokens == MAX_SPECULATIVE_TOKENS  # what `reprise serve --engine vllm` runs with
    assert (args.tasks, args.trials, args.max_new_tokens) == (3, 4, 128)
    assert bench.in_flight_levels(args.in_flight) == (1, 8, 16)


def test_in_flight_levels_are_sorted_and_distinct() -> None:
    assert bench.in_flight_levels("16, 1,8,8") == (1, 8, 16)
    assert bench.in_flight_levels("4") == (4,)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "0"], "--tasks must be >= 1"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--call-index", "-1"], "--call-index must be >= 0"),
    (["--in-flight", "1,eight"], "--in-flight must be comma-separated whole numbers"),
    (["--in-flight", "0,8"], "--in-flight must name levels >= 1"),
    (["--in-flight", ","], "--in-flight must name levels >= 1"),
    (["--speculative-tokens", "0"], "--speculative-tokens must be >= 1"),
    (["--methods", "vllm_reprise"], "--methods must include vllm_plain"),
    (["--methods", "vllm_plain,bogus"], "--methods must include vllm_plain"),
])
def test_bad_arguments_are_one_clear_error(argv, message) -> None:
    with pytest.raises(CliError, match=message):
        bench.run(_args(*argv))


def _result(seconds: float, outputs: list[list[int]]) -> dict:
    return {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs}


def test_summary_ratios_and_identity() -> None:
    plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    differs = [[1, 2, 3, 4], [5, 6, 9, 9]]  # the second call differs from its third token on
    outputs = {
        "vllm_plain": {"t.jsonl": {"1": _result(4.0, plain), "8": _result(1.0, plain)}},
        "vllm_ngram": {"t.jsonl": {"1": _result(2.0, plain), "8": _result(1.0, differs)}},
        "vllm_reprise": {"t.jsonl": {"1": _result(1.0, plain), "8": _result(0.5, plain)}},
        "vllm_suffix": {"unavailable": "no arctic-inference"},
    }
    traces = bench._summarise(outputs, {"t.jsonl": []}, (1, 8), "bfloat16")
    one, eight = traces["t.jsonl"]["1"], traces["t.jsonl"]["8"]
    assert one["tokens_per_s"] == {"vllm_plain": 2.0, "vllm_ngram": 4.0, "vllm_reprise": 8.0,
                                   "vllm_suffix": "unavailable"}
    assert one["reprise_vs_plain"] == 4.0 and one["reprise_vs_ngram"] == 2.0
    assert all(one["outputs_identical"].values()) and "differing_calls" not in one
    assert eight["reprise_vs_plain"] == 2.0 and eight["reprise_vs_ngram"] == 2.0
    assert eight["outputs_identical"] == {"vllm_plain": True, "vllm_ngram": False, "vllm_reprise": True}
    assert eight["differing_calls"] == {"vllm_ngram": {"calls": "1/2", "first_difference_at_token": [2]}}


def test_summary_says_what_the_proposers_steps_verified() -> None:
    plain = [[1, 2, 3, 4]]
    reprise = _result(1.0, plain)
    # (tenant, draft tokens sent, accepted, drafter): 3 steps, 6 tokens sent, 3 accepted
    reprise["steps"] = [("bench", 4, 3, "reprise", 4, 0.0, 0.0), ("bench", 0, 0, "", 1, 0.0, 0.0),
                        ("bench", 2, 0, "reprise", 1, 0.0, 0.0)]
    outputs = {"vllm_plain": {"t": {"1": _result(2.0, plain)}}, "vllm_reprise": {"t": {"1": reprise}}}
    row = bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]
    assert row["drafting"] == {"vllm_reprise": {"steps": 3, "tokens_per_step": 2.0, "draft_tokens_per_step": 2.0,
                                                "acceptance": 0.5}}
    report = {"eager": False, "model": "m", "dtype": "bfloat16", "vllm": "0.32.0", "max_new_tokens": 4,
              "speculative_tokens": 32, "load_before": 0.0, "load_after": 0.0, "traces": {"t": {"1": row}}}
    assert "vllm_reprise: 2.0 tokens per decoding step, 2.0 draft tokens sent per step, 0.5 accepted" in (
        bench.format_report(report))


def test_own_engine_is_compared_only_in_float32() -> None:
    plain = [[1, 2]]
    outputs = {"vllm_plain": {"t": {"1": _result(1.0, plain)}}, "reprise_engine": {"t": {"1": _result(1.0, plain)}}}
    assert bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]["outputs_identical"]["reprise_engine"] is None
    assert bench._summarise(outputs, {"t": []}, (1,), "float32")["t"]["1"]["outputs_identical"]["reprise_engine"] is True


def test_report_text_names_every_figure() -> None:
    plain = [[1, 2, 3, 4]]
    outputs = {"vllm_plain": {"t": {"1": _result(2.0, plain)}}, "vllm_reprise": {"t": {"1": _result(1.0, plain)}}}
    report = {"model": "m", "vllm": "0.32.0", "dtype": "bfloat16", "max_new_tokens": 4, "eager": True,
              "speculative_tokens": 32,
              "load_before": 1.0, "load_after": 2.0, "traces": bench._summarise(outputs, {"t": []}, (1,), "bfloat16")}
    text = bench.format_report(report)
    assert "vLLM 0.32.0, eager" in text and "32 speculative tokens" in text and "load average 1.00 -> 2.00" in text
    assert "vllm_reprise 4.0" in text and "reprise_vs_plain" in text


def test_headroom_replays_plain_outputs_through_the_proposer() -> None:
    class Chars:  # the bench passes a transformers tokenizer: decode([id]) and len()
        def decode(self, ids):
            return chr(ids[0])

        def __len__(self):
            return 256

    prompt, output = [ord(c) for c in "book a flight"], [ord(c) for c in "I can help you book a flight today."]
    taus = bench._headroom([prompt, prompt], [output, output], Chars(), budget=8)
    assert list(taus) == ["chain", "best_of_2", "best_of_4", "any_root", "tree"]
    assert 1.5 < taus["chain"] <= taus["any_root"] <= taus["tree"]  # the second call repeats the first


def test_suffix_ratio_is_reported_beside_the_others() -> None:
    plain = [[1, 2, 3, 4]]
    outputs = {"vllm_plain": {"t": {"1": _result(4.0, plain)}}, "vllm_suffix": {"t": {"1": _result(2.0, plain)}},
               "vllm_reprise": {"t": {"1": _result(1.0, plain)}}}
    row = bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]
    assert row["reprise_vs_suffix"] == 2.0 and row["reprise_vs_plain"] == 4.0
    report = {"model": "m", "vllm": "0.32.0", "dtype": "bfloat16", "max_new_tokens": 4, "eager": False,
              "speculative_tokens": 32, "load_before": 1.0, "load_after": 2.0, "traces": {"t": {"1": row}}}
    assert "reprise_vs_suffix 2.0, reprise_vs_plain 4.0" in bench.format_report(report)


# ---- which calls a trace gives -----------------------------------------------------------------------

def _trace(path: Path, tasks: int, trials: int, calls_per_session: int = 3) -> Path:
    """A trace in the shared format: ``tasks`` tasks of ``trials`` sessions (``taskN-trialM``) each."""
    with gzip.open(path, "wt") as f:
        for task in range(tasks):
            for trial in range(trials):
                messages = [{"role": "system", "content": f"task {task}"}]
                for k in range(calls_per_session):
                    messages += [{"role": "user", "content": f"step {k}"},
                                 {"role": "assistant", "content": f"answer {task}.{trial}.{k}"}]
                f.write(json.dumps({"tenant": "a", "session": f"task{task}-trial{trial}", "messages": messages}) + "\n")
    return path


def test_calls_are_tasks_times_trials(tmp_path) -> None:
    calls, trials = bench.select_trace_calls(_trace(tmp_path / "t.jsonl.gz", 5, 4), tasks=2, trials=4, call_index=1)
    assert trials == 4
    assert [(c.session, c.response) for c in calls] == [
        (f"task{t}-trial{k}", f"answer {t}.{k}.1") for t in range(2) for k in range(4)]


def test_a_trace_with_fewer_trials_gives_what_it_has(tmp_path) -> None:
    calls, trials = bench.select_trace_calls(_trace(tmp_path / "t.jsonl.gz", 4, 3), tasks=3, trials=4, call_index=1)
    assert trials == 3 and len(calls) == 9  # 3 tasks x the 3 trials each has, not an empty selection
    assert {c.session.split("-")[0] for c in calls} == {"task0", "task1", "task2"}


def test_a_trace_without_the_call_says_why(tmp_path) -> None:
    with pytest.raises(CliError, match="no session has a call 5"):
        bench.select_trace_calls(_trace(tmp_path / "t.jsonl.gz", 2, 4), tasks=3, trials=4, call_index=5)


# ---- every pass starts from nothing ------------------------------------------------------------------

class _FakeRunner:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def reset(self) -> None:
        self.log.append(f"reset {self.name}")

    def run(self, prompts):
        self.log.append(f"run {self.name} {len(prompts)}")
        return [list(p) for p in prompts]

    def drain_steps(self):
        return []


def test_every_pass_resets_every_method_first() -> None:
    log: list[str] = []
    runners = {m: _FakeRunner(log, m) for m in ("vllm_plain", "vllm_suffix")}
    outputs: dict = {}
    for level in (1, 16):
        bench._interleaved_pass(runners, "t", [[1], [2], [3]], level, outputs)
    assert log == ["reset vllm_plain", "reset vllm_suffix",
                   "run vllm_plain 1", "run vllm_suffix 1", "run vllm_suffix 1", "run vllm_plain 1",
                   "run vllm_plain 1", "run vllm_suffix 1",
                   "reset vllm_plain", "reset vllm_suffix", "run vllm_plain 3", "run vllm_suffix 3"]
    assert outputs["vllm_suffix"]["t"]["16"]["outputs"] == [[1], [2], [3]]


class _FakeEngine:
    """What ``_Vllm.reset`` reaches: the worker calls and vLLM's prefix-cache reset."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        class Llm:
            async def reset_prefix_cache(inner_self):
                self.calls.append("reset_prefix_cache")
                return True

        self.llm = Llm()

    def rpc(self, method, *args):
        self.calls.append(method)
        return [[]]

    def call(self, coro):
        import asyncio

        return asyncio.run(coro)


@pytest.mark.parametrize("method, expected", [
    ("vllm_suffix", ["reprise_reset_suffix_tree", "reset_prefix_cache"]),
    ("vllm_reprise", ["reprise_evict", "reprise_drain_steps", "reset_prefix_cache"]),
    ("vllm_plain", ["reset_prefix_cache"]),
])
def test_vllm_reset_empties_the_methods_history(method, expected) -> None:
    runner = object.__new__(bench._Vllm)
    runner.engine, runner.method, runner.drafting = _FakeEngine(), method, method == "vllm_reprise"
    runner.reset()
    assert runner.engine.calls == expected


def test_the_worker_replaces_the_suffix_tree_with_an_empty_one() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")
    cache_module = pytest.importorskip("arctic_inference.suffix_decoding",
                                       reason="arctic-inference's suffix module is not installed (make install-arctic)")
    import numpy as np
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    from reprise.benchmarks.vllm_worker import BenchWorkerExtension

    cache = cache_module.SuffixDecodingCache(max_tree_depth=24, max_cached_requests=100)
    cache.start_request("r1", np.array([1, 2, 3], dtype=np.int32))
    cache.add_active_response("r1", [4, 5, 6, 7, 8])
    cache.stop_request("r1")
    context = np.array([9, 4, 5], dtype=np.int32)

    def drafts(suffix_cache, req_id: str) -> list[int]:
        suffix_cache.start_request(req_id, np.array([9], dtype=np.int32))
        ids = list(suffix_cache.speculate(req_id, context, max_spec_tokens=8).token_ids)
        suffix_cache.stop_request(req_id)
        return ids

    assert drafts(cache, "r2") == [6, 7]  # from r1's response (2 matched tokens x max_spec_factor 1)
    drafter = object.__new__(SuffixDecodingProposer)
    drafter.suffix_cache = cache

    class Runner:
        pass

    worker = BenchWorkerExtension()
    worker.model_runner = Runner()
    worker.model_runner.drafter = drafter
    assert worker.reprise_reset_suffix_tree() == 2  # r1 and r2
    fresh = drafter.suffix_cache
    assert len(fresh.cached_requests) == 0 and (fresh.max_tree_depth, fresh.max_cached_requests) == (24, 100)
    assert drafts(fresh, "r3") == []  # nothing of the earlier pass drafts


def test_headroom_reranks_the_first_token_by_the_targets_logits() -> None:
    """Two earlier calls continue their first token with "X..." and one with "Y...", so in the last call
    the drafter's best root after its (unseen) first token is X; the target (a fake whose logits always
    favour Y) moves the chain to Y, which is right."""
    import numpy as np

    class Chars:
        def decode(self, ids):
            return chr(ids[0])

        def __len__(self):
            return 256

    class FavoursY:  # what _choice_logits reads: model(ids).logits [1, len, vocab]
        def model(self, ids):
            import torch

            logits = torch.zeros(1, ids.shape[1], 256)
            logits[..., ord("Y")] = 5.0
            return type("Out", (), {"logits": logits})()

    prompt = [ord(c) for c in "q:"]
    outputs = [[ord(c) for c in text] for text in ("1XXXXXXXX", "2XXXXXXXX", "3YYYYYYYY", "4YYYYYYYY")]
    figures = bench._headroom([prompt] * 4, outputs, Chars(), budget=8, target=FavoursY())
    right = figures["first_token_right"]
    assert right["reranked"] > right["drafted"] and right["any_root"] >= right["reranked"]
    assert figures["reranked"] > figures["chain"]
    assert np.isclose(figures["chain"], bench._headroom([prompt] * 4, outputs, Chars(), budget=8)["chain"])


def test_headroom_reranks_by_a_head_for_the_token_after_next() -> None:
    """The target's own logits favour X (the drafter's choice too, wrongly); a re-rank head that reads
    the same hidden states and predicts Y moves the chain to Y: ``reranked_head`` beats ``reranked``."""
    import torch

    class Chars:
        def decode(self, ids):
            return chr(ids[0])

        def __len__(self):
            return 256

    class Model:  # what _choice_logits reads: model(ids, output_hidden_states=True), the output embedding
        out = torch.nn.Linear(256, 256, bias=False)
        out.weight.data = torch.eye(256)

        def __call__(self, ids, output_hidden_states=False):
            hidden = torch.zeros(1, ids.shape[1], 256)  # the top state after the final norm: favours X
            hidden[..., ord("X")] = 5.0
            return type("Out", (), {"logits": self.out(hidden), "hidden_states": (hidden,)})()

        def get_output_embeddings(self):
            return self.out

    target = type("Target", (), {"model": Model()})()
    swap = [ord("Y") if i == ord("X") else ord("X") if i == ord("Y") else i for i in range(256)]

    def to_y(hidden):  # a head whose feature for the token after next is Y's
        return hidden[..., swap]

    prompt = [ord(c) for c in "q:"]
    outputs = [[ord(c) for c in text] for text in ("1XXXXXXXX", "2XXXXXXXX", "3YYYYYYYY", "4YYYYYYYY")]
    figures = bench._headroom([prompt] * 4, outputs, Chars(), budget=8, target=target, rerank_head=to_y)
    right = figures["first_token_right"]
    assert right["reranked_head"] > right["reranked"]
    assert figures["reranked_head"] > figures["reranked"]
    assert "reranked_head" not in bench._headroom([prompt] * 4, outputs, Chars(), budget=8, target=target)


def test_the_rerank_head_is_a_medusa_checkpoints_first_block(tmp_path) -> None:
    import torch

    from neural_drafters.checkpoint import save_checkpoint
    from neural_drafters.config import HeadConfig
    from neural_drafters.heads import build_head
    from reprise.backends.vllm.first_token import load_rerank_head

    def config(kind: str) -> HeadConfig:
        return HeadConfig(kind=kind, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          intermediate_size=16, vocab_size=32, draft_vocab_size=32, num_heads=2 if kind == "medusa" else 1)

    medusa = build_head(config("medusa"))
    with torch.no_grad():
        medusa.blocks[0].linear.weight.fill_(0.5)
    save_checkpoint(tmp_path / "medusa", medusa, step=1)
    block = load_rerank_head(tmp_path / "medusa")
    h = torch.randn(3, 8)
    assert torch.allclose(block(h), h + torch.nn.functional.silu(h @ torch.full((8, 8), 0.5).T))
    save_checkpoint(tmp_path / "eagle", build_head(config("eagle")), step=1)
    with pytest.raises(ValueError, match="needs a Medusa head"):
        load_rerank_head(tmp_path / "eagle")


def test_savings_check_sets_the_steps_estimate_beside_the_measured_speedup() -> None:
    plain = [[1, 2, 3, 4, 5, 6, 7, 8]]
    reprise = _result(2.0, plain)
    # wire form: (tenant, draft, accepted, drafter, tokens, seconds, plain-step estimate); a step not priced
    # (before the step cost was measured) has 0 seconds and is left out
    reprise["steps"] = [("bench", 0, 0, "", 1, 0.0, 0.0), ("bench", 4, 3, "reprise", 4, 0.0, 0.0),
                        ("bench", 4, 3, "reprise", 4, 0.4, 1.4), ("bench", 4, 3, "reprise", 4, 0.3, 1.3),
                        ("bench", 2, 1, "reprise", 2, 0.3, 0.3)]
    outputs = {"vllm_plain": {"t": {"1": _result(5.0, plain)}}, "vllm_reprise": {"t": {"1": reprise}}}
    check = bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]["savings_check"]
    assert check["speedup_estimated"] == 3.0  # 3.0 s of plain steps over the 1.0 s those steps took
    assert check["speedup_measured"] == 2.5  # 5.0 s plain / 2.0 s drafted, same tokens
    assert check["error"] == 0.2 and check["timed_share"] == 0.5
    assert check["speedup_estimated_pass"] == 2.0  # (2.0 - 1.0 + 3.0) / 2.0: the unpriced second unchanged
    assert check["error_pass"] == -0.2
    assert (check["timed_steps"], check["steps"]) == (3, 5)
    report = {"eager": False, "model": "m", "dtype": "bfloat16", "vllm": "0.32.0", "max_new_tokens": 8,
              "speculative_tokens": 32, "load_before": 0.0, "load_after": 0.0,
              "traces": {"t": {"1": bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]}}}
    assert "3.00x estimated" in bench.format_report(report) and "error +20.0%" in bench.format_report(report)


def test_savings_check_without_a_timed_step_claims_nothing() -> None:
    plain = [[1, 2]]
    reprise = _result(1.0, plain)
    reprise["steps"] = [("bench", 2, 1, "reprise", 3, 0.0, 0.0)]
    check = bench.savings_check(reprise["steps"], reprise, _result(2.0, plain))
    assert check["speedup_estimated"] is None and "error" not in check and check["speedup_measured"] == 2.0


def test_headroom_counts_a_neural_fallback_where_retrieval_has_little() -> None:
    """Where retrieval drafts nothing (a first call, empty history) a head that predicts the token after
    next right adds what its one-token chains accept: ``neural_fallback`` by threshold, each with the
    share of steps the head drafted and how often it was right."""
    import torch

    class Chars:
        def decode(self, ids):
            return chr(ids[0])

        def __len__(self):
            return 256

    class Model:
        out = torch.nn.Linear(256, 256, bias=False)
        out.weight.data = torch.eye(256)

        def __call__(self, ids, output_hidden_states=False):
            hidden = torch.zeros(1, ids.shape[1], 256)
            hidden[..., ord("Y")] = 5.0  # every feature's best token is Y
            return type("Out", (), {"logits": self.out(hidden), "hidden_states": (hidden,)})()

        def get_output_embeddings(self):
            return self.out

    target = type("Target", (), {"model": Model()})()
    prompt = [ord(c) for c in "q:"]
    outputs = [[ord(c) for c in "aYbYcYdYeY"]]
    figures = bench._headroom([prompt], outputs, Chars(), budget=8, target=target, rerank_head=lambda h: h)
    fallback = figures["neural_fallback"]
    nothing = fallback["below_0.1"]
    assert nothing["head_steps"] > 0 and nothing["head_right"] > 0
    assert nothing["tokens_per_step"] > figures["reranked"]
    assert fallback["below_2"]["head_steps"] >= nothing["head_steps"]


def test_the_own_engines_savings_check_reads_its_observer() -> None:
    from reprise.engine.engine import StepReport
    from serving.savings import RequestCost

    records = bench._StepRecords()
    records.on_step([StepReport("bench", 0, 0, "", 0, None, True, 1, None, RequestCost(0.2, 0.5)),
                     StepReport("bench", 4, 3, "reprise", 0, 0.001, True, 4, RequestCost(0.8, 1.6)),
                     StepReport("bench", 2, 1, "reprise", 0, 0.001, True, 2, RequestCost(0.2, 0.4))])
    plain = [[1, 2, 3, 4, 5]]
    engine = _result(2.0, plain) | {"steps": records.steps}
    outputs = {"vllm_plain": {"t": {"1": _result(4.0, plain)}}, "reprise_engine": {"t": {"1": engine}},
               "reprise_plain": {"t": {"1": _result(3.0, plain)}}}
    row = bench._summarise(outputs, {"t": []}, (1,), "float32")["t"]["1"]
    check = row["savings_check_engine"]
    # 2.0 s of plain steps for the decoding tokens over their 1.0 s; the prefill is no step of the estimate
    assert check["speedup_estimated"] == 2.0 and check["speedup_measured"] == 1.5  # against reprise_plain's 3 s
    assert check["timed_steps"] == 2 and check["timed_share"] == 0.5
    assert "savings_check" not in row  # vLLM's check is vllm_reprise's
