from __future__ import annotations

import pytest
from testkit.grpc_fakes import FakeAdmin, FakeAuth, FakeDecode, ServerThread, Settings


@pytest.fixture
def fakes():
    auth = FakeAuth()
    return FakeDecode(), FakeAdmin(auth), auth


@pytest.fixture
def server(fakes):
    decode, admin, auth = fakes
    st = ServerThread(decode, admin, auth, Settings())
    yield st
    st.stop(0)
