"""Agent frameworks, unchanged, against the own engine's service (a tiny random Llama): the OpenAI Agents
SDK on chat completions and on its default Responses path, pydantic-ai (allowed tools, NativeOutput),
litellm (tools, streaming, ``stream_chunk_builder``, json_schema) and LangChain (``bind_tools``,
``with_structured_output``). Each executes a tool call and parses a structured output; the checks are
shared with vLLM's tests (tests/testkit/frameworks.py). With a random model a call only comes out when
the grammar forces it, so each loop forces the calls it needs and shapes the answer with a schema."""

from __future__ import annotations

import pytest
from testkit import frameworks
from testkit.service import start_service

from grpc_api.client import AdminClient

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("agents") / "home", **{"model.max_len": "12000"})  # smolagents: 4k-byte prompts
    with AdminClient(r.target, r.admin_key) as admin:
        _, r.key = admin.create_tenant("agents")  # type: ignore[attr-defined]
    yield r
    r.stop()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk(service, api) -> None:
    frameworks.check_agents_sdk(service.http + "/v1", service.key, MODEL, api=api)


def test_pydantic_ai_allowed_tools_and_native_output(service) -> None:
    frameworks.check_pydantic_ai(service.http + "/v1", service.key, MODEL)


def test_litellm_tools_stream_chunk_builder_and_json_schema(service) -> None:
    frameworks.check_litellm(service.http + "/v1", service.key, MODEL)


def test_langchain_bind_tools_loop_and_structured_output(service) -> None:
    frameworks.check_langchain(service.http + "/v1", service.key, MODEL)


def test_example_agents_sdk_loop_runs(service, capsys) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "openai_agents_loop.py"
    spec = importlib.util.spec_from_file_location("openai_agents_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(["--base-url", service.http + "/v1", "--api-key", service.key, "--admin-key",
                        service.admin_key, "--grpc-server", service.target, "--tasks", "2", "--max-tokens", "120",
                        "--api", "chat"])  # a random model answers until max_tokens: "incomplete" on Responses
    out = capsys.readouterr().out
    assert code == 0 and "model tiny-llama" in out and "task 2:" in out and '"city"' in out and "hit rate" in out


def test_openai_client_parse_helpers(service) -> None:
    frameworks.check_openai_parse(service.http + "/v1", service.key, MODEL)


def test_smolagents_tool_calling_agent(service) -> None:
    frameworks.check_smolagents(service.http + "/v1", service.key, MODEL)
