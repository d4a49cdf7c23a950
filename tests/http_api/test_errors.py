"""OpenAI error objects for the service's errors (http_api/errors.py)."""

from __future__ import annotations

import pytest

from http_api.errors import error_body
from serving import errors


@pytest.mark.parametrize("what, code", [("model", "model_not_found"), ("response", "response_not_found"),
                                        ("", None)])
def test_not_found_says_what_was_not_found(what, code) -> None:
    status, doc, _ = error_body(errors.NotFound("no such thing", "x", what=what))
    assert status == 404 and doc["error"] == {"message": "no such thing", "type": "not_found_error", "param": "x",
                                              "code": code}
