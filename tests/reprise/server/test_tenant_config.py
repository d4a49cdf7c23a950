"""Per-tenant drafting settings on disk."""

from __future__ import annotations

import json

import pytest

from reprise.server.tenant_config import drafting_config_path, load_drafting_config, save_drafting_config
from retrieval.config import DraftingConfig


def test_round_trip(tmp_path):
    config = DraftingConfig(max_draft_tokens=16, max_spec_factor=4.0, min_token_prob=0.01)
    path = save_drafting_config("acme", config, tmp_path, meta={"by": "test"})
    assert path == tmp_path / "tenants" / "acme" / "drafting.json"
    assert load_drafting_config("acme", tmp_path) == config
    assert json.loads(path.read_text())["meta"] == {"by": "test"}
    assert [p.name for p in path.parent.iterdir()] == ["drafting.json"]  # no temporary file left
    save_drafting_config("acme", DraftingConfig(), tmp_path)
    assert load_drafting_config("acme", tmp_path) == DraftingConfig()


def test_absent_is_none(tmp_path):
    assert load_drafting_config("nobody", tmp_path) is None


def test_data_dir_defaults_to_reprise_home(tmp_path, monkeypatch):
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path / "home"))
    save_drafting_config("acme", DraftingConfig(max_draft_tokens=8))
    assert (tmp_path / "home" / "tenants" / "acme" / "drafting.json").is_file()
    assert load_drafting_config("acme").max_draft_tokens == 8
    monkeypatch.delenv("REPRISE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert drafting_config_path("acme") == tmp_path / "user" / ".reprise" / "tenants" / "acme" / "drafting.json"


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".hidden", "x" * 64, "sp ace", "é"])
def test_invalid_tenant_names_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="tenant name"):
        save_drafting_config(name, DraftingConfig(), tmp_path)
    with pytest.raises(ValueError, match="tenant name"):
        load_drafting_config(name, tmp_path)


def test_fields_missing_from_the_file_take_defaults(tmp_path):
    path = drafting_config_path("acme", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"drafting": {"max_draft_tokens": 12}}))
    assert load_drafting_config("acme", tmp_path) == DraftingConfig(max_draft_tokens=12)


@pytest.mark.parametrize(
    ("content", "what"),
    [("{", "invalid drafting settings"), ("[]", "'drafting' object"), ('{"drafting": {"bogus": 1}}', "bogus"),
     ('{"drafting": {"max_draft_tokens": 0}}', "max_draft_tokens")],
)
def test_a_bad_file_names_itself(tmp_path, content, what):
    path = drafting_config_path("acme", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ValueError, match=what) as info:
        load_drafting_config("acme", tmp_path)
    assert str(path) in str(info.value)


def test_only_drafting_configs_are_saved(tmp_path):
    with pytest.raises(TypeError):
        save_drafting_config("acme", {"max_draft_tokens": 8}, tmp_path)
