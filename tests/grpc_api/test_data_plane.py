"""The data plane over real gRPC on loopback, with a deterministic fake backend (unit level).

End-to-end tests with the real pipeline and store are in tests/service/.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from testkit.grpc_fakes import FakeDecode, ServerThread, Settings, fake_text

from grpc_api.client import AsyncRepriseClient, RepriseClient, RepriseError, build_request
from grpc_api.v1 import decoding_pb2, decoding_pb2_grpc
from serving import errors
from serving.records import Principal, PromptInput

TENANT_KEY = "rpk_tenant_a"


@pytest.fixture
def tenant(fakes):
    _, _, auth = fakes
    auth.keys[TENANT_KEY] = Principal("tenant", "a" * 32)
    auth.keys["rpk_tenant_b"] = Principal("tenant", "b" * 32)
    return TENANT_KEY


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("chunk", [1, 4])
def test_stream_equals_backend_output_in_fixed_chunks(server, fakes, tenant, chunk: int) -> None:
    decode = fakes[0]
    prompt = [5, 6, 7, 8]
    with RepriseClient(server.target, tenant) as client:
        stream = client.generate_stream(tokens=prompt, max_new_tokens=10, request_id="r-1", session_id="s",
                                        stream_chunk_tokens=chunk)
        chunks = list(stream)
    expected = decode.expected(prompt, 10)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert all(len(c.token_ids) == chunk for c in chunks[:-1])  # fixed quanta, whatever the steps were
    assert "".join(c.text for c in chunks) == "".join(fake_text(t) for t in expected)
    done = stream.completion
    assert done is not None and done.request_id == "r-1" and stream.request_id == "r-1"
    assert done.finish_reason == "length" and done.token_ids == expected
    assert (done.prompt_tokens, done.completion_tokens) == (4, 10)
    tenant_id, session, request_id, prompt_ids, params = decode.calls[-1]
    assert (tenant_id, session, request_id, prompt_ids) == ("a" * 32, "s", "r-1", prompt)
    assert params.temperature == 0.0 and params.max_new_tokens == 10


def test_unary_generate_text_and_chat(server, fakes, tenant) -> None:
    decode = fakes[0]
    with RepriseClient(server.target, tenant) as client:
        c = client.generate("hello", max_new_tokens=5, temperature=0.0, seed=0, top_k=0)
        assert c.token_ids == decode.expected(decode.tokenize(_text("hello")), 5)
        assert c.text == "".join(fake_text(t) for t in c.token_ids)
        assert len(c.request_id) == 32  # generated
        c2 = client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=3)
        assert c2.completion_tokens == 3
        params = decode.calls[-2][-1]
        assert params.seed == 0 and params.temperature == 0.0  # explicit zeros arrive as given


def _text(t: str):
    return PromptInput(text=t)


def test_defaults_fill_max_new_tokens_and_stop_reason(server, fakes, tenant) -> None:
    decode = fakes[0]
    prompt = [9, 9]
    expected = decode.expected(prompt, 16)
    stop_id = expected[5]
    with RepriseClient(server.target, tenant) as client:
        c = client.generate(tokens=prompt)
        assert c.completion_tokens == Settings().default_max_new_tokens
        c = client.generate(tokens=prompt, stop_token_ids=[stop_id])
    assert c.finish_reason == "stop" and c.matched_stop == stop_id
    assert c.token_ids[-1] == stop_id


def test_do_not_record_and_append_trajectory(server, fakes, tenant) -> None:
    decode = fakes[0]
    with RepriseClient(server.target, tenant) as client:
        client.generate(tokens=[1, 2], max_new_tokens=2, do_not_record=True)
        assert decode.history == {}
        client.generate(tokens=[1, 2], max_new_tokens=2, speculation=False)
        assert decode.calls[-1][-1].speculate is False
        assert client.append_trajectory("s1", tokens=[3, 4, 5]) == 3
        assert client.append_trajectory("s1", text="tool output") == len("tool output")
    assert len(decode.history["a" * 32]) == 3


def test_model_info(server, tenant) -> None:
    with RepriseClient(server.target, tenant) as client:
        info = client.model_info()
    assert (info.model_name, info.vocab_size, info.eos_token_ids, info.server_version) == ("fake", 64, [0], "test")


@pytest.mark.parametrize(
    ("kwargs", "code", "needle"),
    [
        ({'tokens': []}, "INVALID_ARGUMENT", "input.tokens is empty"),
        ({'text': ''}, "INVALID_ARGUMENT", "input.text is empty"),
        ({'tokens': [1, 64]}, "INVALID_ARGUMENT", "input.tokens.ids[1] = 64 is outside the vocabulary [0, 64)"),
        ({'tokens': [-3]}, "INVALID_ARGUMENT", "= -3 is outside"),
        ({'tokens': [1], 'top_p': 0.0}, "INVALID_ARGUMENT", "top_p must be in (0, 1], got 0.0"),
        ({'tokens': [1], 'temperature': -1.0}, "INVALID_ARGUMENT", "temperature must be in [0, 2], got -1.0"),
        ({'tokens': [1], 'temperature': float('nan')}, "INVALID_ARGUMENT", "temperature"),
        ({'tokens': [1], 'top_k': -1}, "INVALID_ARGUMENT", "top_k must be in [0, 64]"),
        ({'tokens': [1], 'seed': 2**63}, "INVALID_ARGUMENT", "seed must be in [0, 2^63)"),
        ({'tokens': [1], 'repetition_penalty': 0.0}, "INVALID_ARGUMENT", "repetition_penalty must be in [0.1, 10]"),
        ({'tokens': [1], 'max_new_tokens': 0}, "INVALID_ARGUMENT", "max_new_tokens must be in [1, 511]"),
        ({'tokens': [1], 'max_new_tokens': 4, 'min_new_tokens': 5}, "INVALID_ARGUMENT", "min_new_tokens (5) exceeds"),
        ({'tokens': [1], 'stop': ['x'] * 17}, "INVALID_ARGUMENT", "at most 16"),
        ({'tokens': [1], 'stop': ['']}, "INVALID_ARGUMENT", "stopping.stop[0]"),
        ({'tokens': [1], 'stop_token_ids': [99]}, "INVALID_ARGUMENT", "stopping.stop_token_ids[0] = 99"),
        ({'tokens': [1], 'request_id': 'x' * 129}, "INVALID_ARGUMENT", "request_id has 129 characters"),
        ({'tokens': [1], 'session_id': 'a\x00b'}, "INVALID_ARGUMENT", "control characters"),
        ({'tokens': [1], 'stream_chunk_tokens': 5000}, "INVALID_ARGUMENT", "stream_chunk_tokens must be in [1, 4096]"),
        ({'messages': [{'role': 'wizard', 'content': 'x'}]}, "INVALID_ARGUMENT", "role is 'wizard'"),
        ({'tokens': [1] * 600}, "OUT_OF_RANGE", "the prompt has 600 tokens; the model's context holds 512"),
        ({'tokens': [1] * 500, 'max_new_tokens': 100}, "OUT_OF_RANGE", "= 600 exceeds the model's context of 512"),
    ],
)
def test_bad_requests_get_precise_status(server, tenant, kwargs, code, needle) -> None:
    request = _raw_request(**kwargs)  # past the client's own checks: the server is the boundary for every client
    with RepriseClient(server.target, tenant) as client, grpc.insecure_channel(server.target) as channel:
        stub = decoding_pb2_grpc.DecodingServiceStub(channel)
        metadata = (("authorization", f"Bearer {tenant}"),)
        for call in (stub.Generate, lambda r, metadata: list(stub.GenerateStream(r, metadata=metadata))):
            with pytest.raises(grpc.RpcError) as exc:
                call(request, metadata=metadata)
            assert exc.value.code().name == code
            assert needle in exc.value.details()
        assert client.generate(tokens=[1], max_new_tokens=1).completion_tokens == 1  # still serving
    assert server.on_loop(lambda: server.server.admission.num_active) == 0


def _raw_request(**kwargs) -> decoding_pb2.GenerateRequest:
    """What build_request makes of ``kwargs``, with the values the client itself refuses set directly."""
    raw = {k: kwargs.pop(k) for k in ("tokens", "top_k", "max_new_tokens") if k in kwargs}
    request = build_request(tokens=[1], **kwargs) if "tokens" in raw else build_request(**kwargs)
    if "tokens" in raw:
        request.tokens.ClearField("ids")
        request.tokens.SetInParent()
        request.tokens.ids.extend(raw["tokens"])
    if "top_k" in raw:
        request.sampling.top_k = raw["top_k"]
    if "max_new_tokens" in raw:
        request.stopping.max_new_tokens = raw["max_new_tokens"]
    return request


def test_credentials(server, tenant) -> None:
    for key, code, needle in [
        (None, "UNAUTHENTICATED", "missing credentials"),
        ("rpk_nope", "UNAUTHENTICATED", "unknown or revoked"),
        ("rpa_admin", "PERMISSION_DENIED", "admin keys cannot decode"),
    ]:
        with RepriseClient(server.target, key) as client:
            with pytest.raises(RepriseError) as exc:
                client.generate(tokens=[1], max_new_tokens=1)
            assert exc.value.code.name == code and needle in exc.value.message
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary("/reprise.v1.DecodingService/GetModelInfo",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=decoding_pb2.ModelInfo.FromString)
        with pytest.raises(grpc.RpcError) as rpc:
            call(decoding_pb2.GetModelInfoRequest(), metadata=(("authorization", "Basic abc"),))
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "malformed" in rpc.value.details()


def test_health_and_reflection_need_no_credentials(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "reprise.v1.DecodingService", "reprise.v1.AdminService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"reprise.v1.DecodingService", "reprise.v1.AdminService", "grpc.health.v1.Health"} <= names
        # grpcurl and other current tools ask reflection v1 (same messages on the wire, another service name)
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="reprise.v1.DecodingService")]
        listed, described = list(v1(iter(requests)))
        assert {"reprise.v1.DecodingService", "grpc.reflection.v1.ServerReflection"} <= {
            s.name for s in listed.list_services_response.service}
        assert described.file_descriptor_response.file_descriptor_proto  # the service's own .proto, serialized


def test_per_tenant_concurrency_limit_has_retry_info(fakes, tenant) -> None:
    decode, admin, auth = fakes
    decode.step_seconds = 0.02
    st = ServerThread(decode, admin, auth, Settings(max_requests_per_tenant=2))
    try:
        with RepriseClient(st.target, tenant) as client, RepriseClient(st.target, "rpk_tenant_b") as other:
            streams = [client.generate_stream(tokens=[1], max_new_tokens=400) for _ in range(2)]
            iters = [iter(s) for s in streams]
            for it in iters:
                next(it)  # both admitted and running
            with pytest.raises(RepriseError) as exc:
                client.generate(tokens=[1], max_new_tokens=1)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 requests in flight (limit 2)" in exc.value.message
            assert exc.value.retry_after_s == pytest.approx(1.0)
            assert other.generate(tokens=[1], max_new_tokens=1).completion_tokens == 1  # B is not starved
            for s in streams:
                s.cancel()
        assert wait_until(lambda: st.on_loop(lambda: st.server.admission.num_active) == 0)
    finally:
        st.stop(0)


def test_a_finished_request_frees_its_slot_before_the_answer(fakes, tenant) -> None:
    # An agent calls again as soon as it has its answer; with one slot per tenant that call must fit.
    decode, admin, auth = fakes
    st = ServerThread(decode, admin, auth, Settings(max_requests_per_tenant=1))
    active = lambda: st.on_loop(lambda: st.server.admission.num_active)
    try:
        with RepriseClient(st.target, tenant) as client:
            for _ in range(20):
                assert client.generate(tokens=[1], max_new_tokens=2).completion_tokens == 2
                assert active() == 0
                stream = client.generate_stream(tokens=[1], max_new_tokens=2)
                assert len([t for chunk in stream for t in chunk.token_ids]) == 2
                assert stream.completion is not None and active() == 0
            with pytest.raises(RepriseError):
                client.generate(tokens=[1] * 600)  # refused in the worker: the slot is freed all the same
            assert active() == 0
    finally:
        st.stop(0)


def test_cancel_and_deadline_free_resources_at_once(fakes, tenant) -> None:
    decode, admin, auth = fakes
    decode.step_seconds = 0.05
    st = ServerThread(decode, admin, auth, Settings())
    active = lambda: st.on_loop(lambda: st.server.admission.num_active)
    try:
        with RepriseClient(st.target, tenant) as client:
            stream = client.generate_stream(tokens=[1], max_new_tokens=500)
            it = iter(stream)
            next(it)
            assert active() == 1 and decode.active == 1
            t0 = time.monotonic()
            stream.cancel()
            assert wait_until(lambda: active() == 0 and decode.active == 0, 2.0)
            assert time.monotonic() - t0 < 1.0  # one step, not the 25 s the request would take
            with pytest.raises(RepriseError) as exc:
                client.generate(tokens=[1], max_new_tokens=500, timeout=0.3)
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_until(lambda: active() == 0 and decode.active == 0, 2.0)
            assert decode.max_active == 1
    finally:
        st.stop(0)


def test_abort_out_of_band(fakes, tenant) -> None:
    decode, admin, auth = fakes
    decode.step_seconds = 0.02
    st = ServerThread(decode, admin, auth, Settings())
    try:
        with RepriseClient(st.target, tenant) as client, RepriseClient(st.target, "rpk_tenant_b") as other:
            stream = client.generate_stream(tokens=[1], max_new_tokens=400, request_id="long-one")
            it = iter(stream)
            next(it)
            with pytest.raises(RepriseError) as exc:  # another tenant cannot see or stop it
                other.abort("long-one")
            assert exc.value.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(RepriseError) as exc:  # the same id cannot run twice
                client.generate(tokens=[1], max_new_tokens=1, request_id="long-one")
            assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(RepriseError) as exc:  # capped like Generate's; never echoed into the status
                client.abort("x" * 100_000)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(exc.value.message) < 200
            assert "at most 128" in exc.value.message
            with pytest.raises(RepriseError) as exc:
                client.abort("")
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
            client.abort("long-one")
            rest = list(it)
            assert stream.completion.finish_reason == "aborted"
            assert stream.completion.completion_tokens < 400 and len(rest) < 399
    finally:
        st.stop(0)


def test_async_client_streams(server, fakes, tenant) -> None:
    decode = fakes[0]

    async def main():
        async with AsyncRepriseClient(server.target, tenant) as client:
            items = [x async for x in client.generate_stream(tokens=[3, 4], max_new_tokens=6)]
            unary = await client.generate(tokens=[3, 4], max_new_tokens=6)
            info = await client.model_info()
            return items, unary, info

    items, unary, info = asyncio.run(main())
    assert items[-1].token_ids == decode.expected([3, 4], 6) == unary.token_ids
    assert info.vocab_size == 64


def test_graceful_shutdown_finishes_streams_then_closes(fakes, tenant) -> None:
    decode, admin, auth = fakes
    decode.step_seconds = 0.02
    st = ServerThread(decode, admin, auth, Settings(grace_seconds=5.0))
    client = RepriseClient(st.target, tenant)
    stream = client.generate_stream(tokens=[1], max_new_tokens=30)
    it = iter(stream)
    next(it)
    stopper = threading.Thread(target=lambda: st.call(st.shutdown()))
    stopper.start()
    assert wait_until(lambda: st.on_loop(lambda: st.server.admission.draining))
    rest = list(it)  # the in-flight stream runs to its end within the grace period
    assert 1 + len(rest) == 30 and stream.completion.finish_reason == "length"
    stopper.join(10)
    assert decode.closed  # history flushed, model released
    with pytest.raises(RepriseError) as exc:
        client.generate(tokens=[1], max_new_tokens=1, timeout=2)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    client.close()
    st.loop.call_soon_threadsafe(st.loop.stop)


def test_grace_period_cancels_stragglers(fakes, tenant) -> None:
    decode, admin, auth = fakes
    decode.step_seconds = 0.05
    st = ServerThread(decode, admin, auth, Settings(grace_seconds=0.3))
    with RepriseClient(st.target, tenant) as client:
        stream = client.generate_stream(tokens=[1], max_new_tokens=500)
        it = iter(stream)
        next(it)
        t0 = time.monotonic()
        st.call(st.shutdown())
        assert time.monotonic() - t0 < 3.0
        assert decode.active == 0 and decode.closed
        with pytest.raises(RepriseError) as exc:
            list(it)
        assert exc.value.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    st.loop.call_soon_threadsafe(st.loop.stop)


def test_backend_errors_map_to_status(fakes, tenant) -> None:
    decode, admin, auth = fakes
    st = ServerThread(decode, admin, auth, Settings())
    try:
        with RepriseClient(st.target, tenant) as client:
            decode.fail_with = errors.DataLoss("record 3 of tenant history failed its integrity check")
            with pytest.raises(RepriseError) as exc:
                client.generate(tokens=[1], max_new_tokens=2)
            assert exc.value.code == grpc.StatusCode.DATA_LOSS and "integrity" in exc.value.message
            decode.fail_with = RuntimeError("secret internal detail")
            with pytest.raises(RepriseError) as exc:
                list(client.generate_stream(tokens=[1], max_new_tokens=2))
            assert exc.value.code == grpc.StatusCode.INTERNAL
            assert "secret" not in exc.value.message and "server log" in exc.value.message
            decode.fail_with = None
            assert client.generate(tokens=[1], max_new_tokens=2).completion_tokens == 2
    finally:
        st.stop(0)


def test_build_request_rejects_ambiguous_prompts() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_request(tokens=[1], text="x")
    with pytest.raises(ValueError, match="not both"):
        build_request("x", tokens=[1])
    assert build_request([{"role": "user", "content": "x"}]).WhichOneof("input") == "messages"
    assert build_request([1, 2]).WhichOneof("input") == "tokens"


def test_fake_backend_sanity() -> None:
    d = FakeDecode(eos_after=2)
    assert d.expected([1], 5)[-1] == 0 and len(d.expected([1], 5)) == 3


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"messages": [{"role": "user"}]}, ValueError, "messages[0] (role 'user') has no 'content'"),
    ({"messages": "Hi"}, TypeError, "messages must be a list of dicts like"),
    ({"messages": ["Hi"]}, TypeError, "messages[0] must be a dict with 'role' and 'content'"),
    ({"messages": [{"content": "Hi"}]}, ValueError, "messages[0] needs a 'role'"),
    ({"messages": []}, ValueError, "messages is empty"),
    ({"text": "Hi", "max_new_tokens": -5}, ValueError, "max_new_tokens must be an integer >= 1, got -5"),
    ({"text": "Hi", "max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an integer >= 1, got float"),
    ({"text": "Hi", "seed": -1}, ValueError, "seed must be an integer >= 0"),
    ({"text": "Hi", "stop": "END"}, TypeError, "stop must be a list of strings"),
    ({"tokens": [1, -2]}, ValueError, "tokens[1] must be an integer >= 0, got -2"),
    ({"tokens": "12"}, TypeError, "tokens must be a non-empty list of token ids"),
    ({"text": b"Hi"}, TypeError, "text must be a string"),
])
def test_the_client_says_which_argument_is_wrong(kwargs, error, says) -> None:
    with pytest.raises(error) as exc:
        build_request(**kwargs)
    assert says in str(exc.value)


def test_the_client_takes_numpy_token_ids() -> None:
    import numpy as np

    req = build_request(tokens=np.array([3, 4], dtype=np.int32), max_new_tokens=np.int64(5))
    assert list(req.tokens.ids) == [3, 4] and req.stopping.max_new_tokens == 5
