"""reprise.config: precedence, coercion, validation with errors that name the value and its source."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from reprise import config as cfg


def test_defaults_are_valid_and_home_follows_env(tmp_path: Path) -> None:
    c = cfg.load_config({}, env={"REPRISE_HOME": str(tmp_path)})
    assert c.home == tmp_path
    assert c.server == cfg.ServerConfig()
    assert c.drafting.max_draft_tokens == 32
    assert c.server.num_worker_threads == 4


def test_parts_settings_are_derived_from_the_server_section(tmp_path: Path) -> None:
    """ServingSettings and HttpLimits are read from [server] by name: their defaults are the config's,
    and every value set there reaches them (none is copied by hand)."""
    from http_api.server import HttpLimits
    from serving.prepare import ServingSettings

    assert cfg.ServerConfig().settings_for(ServingSettings) == ServingSettings()
    assert cfg.ServerConfig().settings_for(HttpLimits, "http_") == HttpLimits()
    c = cfg.load_config({"server.default_max_new_tokens": "77", "server.append_burst_calls": "5",
                         "server.http_body_timeout_s": "9.5", "server.http_max_connections_per_client": "3"},
                        env={"REPRISE_HOME": str(tmp_path)})
    serving, http = c.server.settings_for(ServingSettings), c.server.settings_for(HttpLimits, "http_")
    assert (serving.default_max_new_tokens, serving.append_burst_calls) == (77, 5)
    assert (http.body_timeout_s, http.max_connections_per_client) == (9.5, 3)


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    toml = tmp_path / "reprise.toml"
    toml.write_text("[server]\ngrpc_port = 7000\nhttp_port = 7001\ngrace_seconds = 2.5\n"
                    "[drafting]\nmax_draft_tokens = 8\n")
    env = {"REPRISE_HOME": str(tmp_path), "REPRISE_SERVER_GRPC_PORT": "7100"}
    c = cfg.load_config({"server.http_port": "7201"}, env=env)  # file found in $REPRISE_HOME
    assert c.server.grpc_port == 7100  # env beats file
    assert c.server.http_port == 7201  # flag beats file
    assert c.server.grace_seconds == 2.5  # file beats default
    assert c.drafting.max_draft_tokens == 8
    c2 = cfg.load_config({"server.grpc_port": 7300}, env=env)
    assert c2.server.grpc_port == 7300  # flag beats env


def test_roundtrip_through_toml(tmp_path: Path) -> None:
    c = cfg.load_config({"server.max_requests_per_tenant": "3", "drafting.use_tree": "false"},
                        env={"REPRISE_HOME": str(tmp_path)})
    path = tmp_path / "out.toml"
    path.write_text(c.to_toml())
    assert cfg.load_config({}, env={}, config_file=path) == c


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"server.grpc_port": "abc"}, {}, "server.grpc_port from flag --grpc-port: expected an integer, got 'abc'"),
        ({}, {"REPRISE_SERVER_GRPC_PORT": "70000"}, "server.grpc_port must be in [0, 65535], got 70000"),
        ({}, {"REPRISE_SERVER_GRPC_PORT": "70000"}, "environment REPRISE_SERVER_GRPC_PORT"),
        ({"drafting.max_draft_tokens": "0"}, {}, "max_draft_tokens must be in [1, 1024], got 0"),
        ({"drafting.use_tree": "maybe"}, {}, "expected true or false, got 'maybe'"),
        ({"server.tls_cert_file": "/nonexistent.pem"}, {}, "tls_cert_file and server.tls_key_file"),
        ({"server.http_port": "50051"}, {}, "both 50051"),
        ({"server.bogus": "1"}, {}, "unknown settings: server.bogus"),
        ({"model.prefix_cache_bytes": "-1"}, {}, "must be >= 0, got -1 (settings from flag --model-prefix-cache-bytes)"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, flags: dict, env: dict, needle: str) -> None:
    env = {"REPRISE_HOME": str(tmp_path), **env}
    with pytest.raises(ValueError) as exc:
        cfg.load_config(flags, env=env)
    assert needle in str(exc.value)


def test_bad_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\ngrpc_prot = 1\n")
    with pytest.raises(ValueError, match=r"unknown settings: server.grpc_prot"):
        cfg.load_config({}, env={}, config_file=bad)
    bad.write_text("[server\n")
    with pytest.raises(ValueError, match=str(bad)):
        cfg.load_config({}, env={}, config_file=bad)
    with pytest.raises(ValueError, match="config file not found"):
        cfg.load_config({}, env={}, config_file=tmp_path / "missing.toml")
    bad.write_text("[server]\ngrpc_port = 1.5\n")
    with pytest.raises(ValueError, match=r"server.grpc_port from config file .*expected an integer"):
        cfg.load_config({}, env={}, config_file=bad)


def test_argparse_flags_cover_every_setting(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cfg.add_config_arguments(parser)
    text = parser.format_help()
    for key in cfg.settings():
        assert f"--{cfg.flag_name(key)}" in text
        assert cfg.env_name(key) in text
    args = parser.parse_args(["--grpc-port", "6001", "--no-drafting-use-tree", "--home", str(tmp_path)])
    c = cfg.config_from_args(args, env={})
    assert c.server.grpc_port == 6001 and c.drafting.use_tree is False and c.home == tmp_path


def test_store_section_follows_home_and_hides_secrets(tmp_path: Path) -> None:
    env = {"REPRISE_HOME": str(tmp_path), "REPRISE_STORE_BACKEND": "redis",
           "REPRISE_STORE_REDIS_URL": "redis://127.0.0.1:6379/3", "REPRISE_STORE_REDIS_PASSWORD": "s3cret"}
    c = cfg.load_config({}, env=env)
    assert c.store.backend == "redis" and c.store.redis.db == 3 and c.store.redis_password == "s3cret"
    assert c.store.data_dir == tmp_path and c.store.key_file == tmp_path / "master.key"
    assert "s3cret" not in c.to_toml() and "s3cret" not in repr(c)
    with pytest.raises(ValueError, match="store backend must be 'sqlite' or 'redis', got 'mongo'"):
        cfg.load_config({"store.backend": "mongo"}, env={})
