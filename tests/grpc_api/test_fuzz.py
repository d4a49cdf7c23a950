"""A fuzz loop over the wire: garbage bytes, random field values, oversized messages, bad credentials.

Every call must end in OK or a status that names the problem (never INTERNAL/UNKNOWN), carry a message,
and the server must keep serving and hold no request afterwards.
"""

from __future__ import annotations

import random

import grpc
import pytest
from testkit.grpc_fakes import ServerThread, Settings

from grpc_api.v1 import decoding_pb2
from serving.records import Principal

METHODS = [
    ("/reprise.v1.DecodingService/Generate", False),
    ("/reprise.v1.DecodingService/GenerateStream", True),
    ("/reprise.v1.DecodingService/AppendTrajectory", False),
    ("/reprise.v1.DecodingService/Abort", False),
    ("/reprise.v1.DecodingService/GetModelInfo", False),
    ("/reprise.v1.AdminService/GetIndexStats", False),
    ("/reprise.v1.AdminService/BuildIndex", True),
]
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
}


def random_request(rng: random.Random) -> bytes:
    r = decoding_pb2.GenerateRequest()
    choice = rng.randrange(5)
    if choice == 0:
        r.tokens.ids.extend(rng.randint(-100, 200) for _ in range(rng.randint(0, 40)))
    elif choice == 1:
        r.text = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 30)))
    elif choice == 2:
        for _ in range(rng.randint(0, 3)):
            r.messages.messages.add(role=rng.choice(["user", "assistant", "x", ""]), content="hi")
    elif choice == 3:
        r.tokens.ids.extend([1] * rng.randint(400, 700))
    if rng.random() < 0.5:
        r.sampling.temperature = rng.choice([0.0, -1.0, 0.7, float("inf"), float("nan")])
    if rng.random() < 0.3:
        r.sampling.top_p = rng.choice([0.0, 0.5, 1.0, 1.5])
    if rng.random() < 0.3:
        r.stopping.max_new_tokens = rng.choice([0, 1, 8, 511, 100000])
    if rng.random() < 0.2:
        r.stopping.stop.extend(["", "ab", "x" * 600][: rng.randint(0, 3)])
    if rng.random() < 0.2:
        r.stopping.stop_token_ids.extend([rng.randint(-5, 80)])
    if rng.random() < 0.2:
        r.speculation = rng.randint(0, 7)
    if rng.random() < 0.2:
        r.request_id = "".join(chr(rng.randint(0, 127)) for _ in range(rng.randint(0, 200)))
    if rng.random() < 0.1:
        r.stream_chunk_tokens = rng.choice([0, 1, 5000])
    data = r.SerializeToString()
    if rng.random() < 0.3:  # corrupt the wire bytes
        data = bytes(b ^ rng.randint(0, 255) if rng.random() < 0.2 else b for b in data) or b"\xff\xff"
    if rng.random() < 0.1:
        data = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 64)))
    return data


@pytest.fixture
def fuzz_server(fakes):
    decode, admin, auth = fakes
    auth.keys["rpk_a"] = Principal("tenant", "a" * 32)
    st = ServerThread(decode, admin, auth, Settings(max_message_bytes=64 * 1024))
    yield st, decode
    st.stop(0)


def test_fuzz_loop_keeps_serving(fuzz_server) -> None:
    st, decode = fuzz_server
    rng = random.Random(1234)
    seen: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(st.target) as channel:
        for i in range(400):
            method, streaming = rng.choice(METHODS)
            key = rng.choice(["rpk_a", "rpk_a", "rpk_a", "rpa_admin", "wrong", None, "Bearer", "rpk_a x"])
            metadata = () if key is None else (("authorization", f"Bearer {key}" if key != "Bearer" else key),)
            payload = random_request(rng)
            try:
                if streaming:
                    call = channel.unary_stream(method)
                    for _ in call(payload, metadata=metadata, timeout=10):
                        pass
                else:
                    channel.unary_unary(method)(payload, metadata=metadata, timeout=10)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert exc.details(), (i, method, code)
            assert code in ALLOWED, (i, method, code)
            seen[code] = seen.get(code, 0) + 1
        # oversized message: grpc's own limit answers, the server lives on
        big = decoding_pb2.GenerateRequest(text="x" * 100_000).SerializeToString()
        with pytest.raises(grpc.RpcError) as exc:
            channel.unary_unary("/reprise.v1.DecodingService/Generate")(
                big, metadata=(("authorization", "Bearer rpk_a"),), timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = decoding_pb2.GenerateRequest(text="ok")
        ok.stopping.max_new_tokens = 3
        reply = channel.unary_unary("/reprise.v1.DecodingService/Generate",
                                    response_deserializer=decoding_pb2.GenerateResponse.FromString)(
            ok.SerializeToString(), metadata=(("authorization", "Bearer rpk_a"),), timeout=10)
        assert len(reply.token_ids) == 3
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED} <= set(seen)
    assert st.on_loop(lambda: st.server.admission.num_active) == 0 and decode.active == 0


def test_garbage_bytes_are_invalid_argument(fuzz_server) -> None:
    st, _ = fuzz_server
    with grpc.insecure_channel(st.target) as channel, pytest.raises(grpc.RpcError) as exc:
        channel.unary_unary("/reprise.v1.DecodingService/Generate")(
            b"\xff\xff\xff", metadata=(("authorization", "Bearer rpk_a"),), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in exc.value.details()


def test_unknown_method_is_unimplemented(fuzz_server) -> None:
    st, _ = fuzz_server
    with grpc.insecure_channel(st.target) as channel, pytest.raises(grpc.RpcError) as exc:
        channel.unary_unary("/reprise.v1.DecodingService/Nope")(b"", timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
