"""If the engine ever dies, health tells the truth at once and the process stops non-zero: a real service
(tiny model) whose engine thread is made to fail mid-request."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from reprise.backends.engine import EngineBackend
from reprise.service import EXIT_ENGINE_FAILED


def healthz(url: str, service: str = "") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/healthz" + (f"?service={service}" if service else ""), timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


def grpc_health(target: str, service: str) -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def both_fronts(running) -> dict[str, tuple[int, str, str]]:
    """Per service name: /healthz?service= (status, text) and gRPC health's answer."""
    return {name: (*healthz(running.http, name), grpc_health(running.target, name))
            for name in ("", "reprise.v1.DecodingService", "reprise.v1.AdminService", "reprise.v1.Nope")}


def test_both_fronts_say_the_same_of_each_plane(tmp_path) -> None:
    running = start_service(tmp_path / "home")
    try:
        seen = both_fronts(running)
        assert seen == {"": (200, "serving", "SERVING"), "reprise.v1.DecodingService": (200, "serving", "SERVING"),
                        "reprise.v1.AdminService": (200, "serving", "SERVING"),
                        "reprise.v1.Nope": (404, "unknown service", "NOT_FOUND")}
        # the engine stops: the data plane (and the service as a whole) cannot decode; the admin plane can
        service = running.service
        backend = service.core.backend
        while not isinstance(backend, EngineBackend):  # the engine's backend, below its wrappers
            backend = backend.inner
        backend._failure = MemoryError("simulated")  # what a dead engine thread leaves (its on_fatal not called)
        running.loop.call(service.grpc.refresh_health())
        seen = both_fronts(running)
        assert seen[""] == (503, "engine stopped", "NOT_SERVING")
        assert seen["reprise.v1.DecodingService"] == (503, "engine stopped", "NOT_SERVING")
        assert seen["reprise.v1.AdminService"] == (200, "serving", "SERVING")
    finally:
        running.stop()


def test_a_dead_engine_turns_health_not_serving_and_stops_the_service(tmp_path) -> None:
    running = start_service(tmp_path / "home")
    try:
        with AdminClient(running.target, running.admin_key) as admin:
            _, key = admin.create_tenant("acme")
        engine = running.service.decoding.engine
        step = engine.step
        armed = threading.Event()

        def failing_step() -> int:
            if armed.is_set():
                raise MemoryError("simulated: the engine thread cannot go on")
            return step()

        engine.step = failing_step  # the engine thread calls it through the instance
        assert healthz(running.http) == (200, "serving")
        with RepriseClient(running.target, key) as client:
            stream = client.generate_stream(tokens=[3, 4, 5], max_new_tokens=400, ignore_eos=True)
            it = iter(stream)
            next(it)
            armed.set()
            with pytest.raises(RepriseError) as exc:
                list(it)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "engine" in exc.value.message
        status, text = healthz(running.http)
        assert status == 503 and text in ("engine stopped", "draining")
        deadline = time.monotonic() + 10
        while running.service.grpc is not None and not running.service.grpc._stopped.is_set():
            assert time.monotonic() < deadline, "the service did not stop after its engine died"
            time.sleep(0.05)
        assert running.service.exit_code == EXIT_ENGINE_FAILED
        # health said NOT_SERVING, then the port closed
        with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    finally:
        running.stop()
