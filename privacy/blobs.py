"""Sealed blobs of a tenant: index snapshots, corpora (named token sequences, added in parts),
hidden-state vectors and stored responses (the OpenAI Responses API's, with an expiry). ``HistoryStore``
inherits these methods.

A blob is a sealed head (JSON: name, sizes, chunk count) and its body sealed in chunks of
``chunk_bytes``. Each chunk's record id binds the blob's tag, its random blob id, the chunk's index and
the chunk count from the authenticated head, so chunks cannot be reordered, dropped, duplicated or
mixed between blobs or versions without an IntegrityError.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from privacy.config import StoreConfig
from privacy.errors import IntegrityError
from privacy.integrity import BLOB_PARSE_ERRORS, blob_bad_record
from privacy.records import (
    BLOB_KINDS,
    KIND_CORPUS,
    KIND_HIDDEN,
    KIND_RESPONSE,
    KIND_SNAPSHOT,
    BadRecordCallback,
    CorpusInfo,
    IndexSnapshot,
    as_token_ids,
    decode_documents,
    decode_hidden_states,
    encode_documents,
    encode_hidden_states,
)
from privacy.storage import Storage, StoredBlob
from privacy.tenants import TenantId

if TYPE_CHECKING:
    from privacy.keychain import Keychain, TenantKeys

__all__ = ["BLOB_KINDS", "KIND_CORPUS", "KIND_HIDDEN", "KIND_RESPONSE", "KIND_SNAPSHOT", "BlobRecords", "blob_record_id"]


def _check_name(value: object, what: str) -> str:
    """A snapshot/corpus name or hidden-state key: a string of at most 4096 UTF-8 bytes."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    if len(value.encode()) > 4096:
        raise ValueError(f"{what} is {len(value.encode())} bytes, at most 4096")
    return value


class BlobRecords:
    """Snapshot, corpus and hidden-state methods of ``HistoryStore``."""

    config: StoreConfig
    storage: Storage
    keychain: Keychain

    def _open(self, tk: TenantKeys, kind: str, record_id: bytes, sealed: bytes) -> bytes:
        raise NotImplementedError

    def _put_blob(self, tk: TenantKeys, kind: str, tag: bytes, head: dict[str, Any], body: bytes,
                  blob_id: bytes | None = None) -> None:
        size = self.config.chunk_bytes
        blob_id = blob_id or os.urandom(16)
        n = (len(body) + size - 1) // size
        head = dict(head, body_bytes=len(body), num_chunks=n)
        with tk.gate.shared():
            sealed_head = self.keychain.seal(tk, kind, blob_record_id(tag, blob_id, 0, 0), json.dumps(head).encode())
            chunks = [self.keychain.seal(tk, kind, blob_record_id(tag, blob_id, i + 1, n), body[i * size:(i + 1) * size])
                      for i in range(n)]
            self.storage.blob_put(tk.tenant.value, kind, tag, blob_id, sealed_head, chunks)

    def _blob_head(self, tk: TenantKeys, kind: str, blob: StoredBlob) -> dict[str, Any]:
        return json.loads(self._open(tk, kind, blob_record_id(blob.tag, blob.blob_id, 0, 0), blob.head))

    def _get_blob(self, tk: TenantKeys, kind: str, tag: bytes) -> tuple[dict[str, Any], bytes] | None:
        blob = self.storage.blob_get(tk.tenant.value, kind, tag)
        if blob is None:
            return None
        head = self._blob_head(tk, kind, blob)
        chunks = blob.chunks or []
        n = head["num_chunks"]
        if len(chunks) != n:
            raise IntegrityError(f"tenant {tk.tenant.value}: {kind} blob has {len(chunks)} chunks, its head says {n}")
        body = b"".join(self._open(tk, kind, blob_record_id(tag, blob.blob_id, i + 1, n), c) for i, c in enumerate(chunks))
        if len(body) != head["body_bytes"]:
            raise IntegrityError(f"tenant {tk.tenant.value}: {kind} blob is {len(body)} bytes, its head says {head['body_bytes']}")
        return head, body

    def put_snapshot(self, tenant: TenantId, data: bytes, cursor: str = "", name: str = "default") -> None:
        """Store serialized index bytes (replacing the previous snapshot of this name) and the cursor of
        the last trajectory they include, so a cold start loads the snapshot plus the trajectories after it."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"snapshot data must be bytes, got {type(data).__name__}")
        _check_name(name, "snapshot name")
        _check_name(cursor, "cursor")
        tk = self.keychain.tenant_keys(tenant)
        head = {"name": name, "cursor": cursor, "created_at": time.time()}
        self._put_blob(tk, KIND_SNAPSHOT, tk.tag(KIND_SNAPSHOT, name), head, bytes(data))

    def get_snapshot(self, tenant: TenantId, name: str = "default") -> IndexSnapshot | None:
        """The snapshot called ``name``, or None."""
        _check_name(name, "snapshot name")
        tk = self.keychain.tenant_keys(tenant)
        got = self._get_blob(tk, KIND_SNAPSHOT, tk.tag(KIND_SNAPSHOT, name))
        if got is None:
            return None
        head, body = got
        return IndexSnapshot(head["name"], body, head["cursor"], head["created_at"])

    def delete_snapshot(self, tenant: TenantId, name: str = "default") -> bool:
        """Delete the snapshot called ``name``; True if it existed."""
        _check_name(name, "snapshot name")
        tk = self.keychain.tenant_keys(tenant)
        return self.storage.blob_delete(tenant.value, KIND_SNAPSHOT, tk.tag(KIND_SNAPSHOT, name))

    def add_corpus_documents(self, tenant: TenantId, documents: Sequence[Sequence[int] | np.ndarray],
                             name: str = "default", replace: bool = False) -> CorpusInfo:
        """Add token sequences to the tenant's corpus ``name`` as one new sealed part (``replace``: drop
        the corpus first). Returns the corpus after the addition."""
        docs = [as_token_ids(d, f"document {i}") for i, d in enumerate(documents)]
        _check_name(name, "corpus name")
        tk = self.keychain.tenant_keys(tenant)
        if replace:
            self.delete_corpus(tenant, name)
        parts = self._corpus_parts(tk, name)
        head = {"name": name, "part": max((h["part"] for _, h in parts), default=-1) + 1,
                "num_documents": len(docs), "num_tokens": int(sum(len(d) for d in docs)), "created_at": time.time()}
        self._put_blob(tk, KIND_CORPUS, os.urandom(16), head, encode_documents(docs))
        return next(c for c in self.list_corpora(tenant) if c.name == name)

    def _corpus_parts(self, tk: TenantKeys, name: str | None,
                      on_bad: BadRecordCallback | None = None) -> list[tuple[StoredBlob, dict[str, Any]]]:
        parts = []
        for b in self.storage.blob_list(tk.tenant.value, KIND_CORPUS):
            try:
                head = self._blob_head(tk, KIND_CORPUS, b)
                part, part_name = int(head["part"]), str(head["name"])
            except BLOB_PARSE_ERRORS as exc:
                if on_bad is None:
                    raise
                on_bad(blob_bad_record(KIND_CORPUS, b.tag, exc))
                continue
            if name is None or part_name == name:
                parts.append((part, b, head))
        return [(b, h) for _, b, h in sorted(parts, key=lambda p: p[0])]

    def list_corpora(self, tenant: TenantId) -> list[CorpusInfo]:
        """The tenant's corpora with their document and token counts, by name."""
        tk = self.keychain.tenant_keys(tenant)
        out: dict[str, CorpusInfo] = {}
        for _, h in self._corpus_parts(tk, None):
            c = out.get(h["name"], CorpusInfo(h["name"], 0, 0, 0))
            out[h["name"]] = CorpusInfo(c.name, c.num_documents + h["num_documents"],
                                        c.num_tokens + h["num_tokens"], c.num_parts + 1)
        return sorted(out.values(), key=lambda c: c.name)

    def iter_corpus(self, tenant: TenantId, name: str = "default",
                    on_bad: BadRecordCallback | None = None) -> Iterator[np.ndarray]:
        """The corpus's documents (int32 arrays) in the order they were added. A part that fails
        authentication or parsing raises IntegrityError, or, with ``on_bad``, is skipped and reported."""
        _check_name(name, "corpus name")
        tk = self.keychain.tenant_keys(tenant)
        return self._iter_corpus(tk, name, on_bad)

    def _iter_corpus(self, tk: TenantKeys, name: str, on_bad: BadRecordCallback | None = None) -> Iterator[np.ndarray]:
        for blob, _ in self._corpus_parts(tk, name, on_bad):
            try:
                got = self._get_blob(tk, KIND_CORPUS, blob.tag)
                documents = decode_documents(got[1]) if got is not None else []
            except IntegrityError as exc:
                if on_bad is None:
                    raise
                on_bad(blob_bad_record(KIND_CORPUS, blob.tag, exc))
                continue
            yield from documents

    def delete_corpus(self, tenant: TenantId, name: str = "default") -> int:
        """Delete every part of corpus ``name``; returns the number of parts deleted."""
        _check_name(name, "corpus name")
        tk = self.keychain.tenant_keys(tenant)
        parts = self._corpus_parts(tk, name)
        for blob, _ in parts:
            self.storage.blob_delete(tenant.value, KIND_CORPUS, blob.tag)
        return len(parts)

    def put_hidden_states(self, tenant: TenantId, key: str, positions: Sequence[int] | np.ndarray,
                          states: np.ndarray) -> None:
        """Store fp16 hidden-state vectors (``states[i]`` at token position ``positions[i]``) under ``key``."""
        pos = as_token_ids(positions, "positions")
        arr = np.asarray(states)
        if arr.ndim != 2 or arr.shape[0] != len(pos):
            raise ValueError(f"states must have shape [{len(pos)}, hidden_size], got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"states must be floating point, got dtype {arr.dtype}")
        _check_name(key, "hidden-state key")
        tk = self.keychain.tenant_keys(tenant)
        head = {"key": key, "created_at": time.time()}
        self._put_blob(tk, KIND_HIDDEN, tk.tag(KIND_HIDDEN, key), head, encode_hidden_states(pos, arr.astype(np.float16)))

    def get_hidden_states(self, tenant: TenantId, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions [n] int32, states [n, hidden] float16)`` stored under ``key``, or None."""
        _check_name(key, "hidden-state key")
        tk = self.keychain.tenant_keys(tenant)
        got = self._get_blob(tk, KIND_HIDDEN, tk.tag(KIND_HIDDEN, key))
        return decode_hidden_states(got[1]) if got is not None else None

    def delete_hidden_states(self, tenant: TenantId, key: str) -> bool:
        """Delete the hidden states stored under ``key``; True if they existed."""
        _check_name(key, "hidden-state key")
        tk = self.keychain.tenant_keys(tenant)
        return self.storage.blob_delete(tenant.value, KIND_HIDDEN, tk.tag(KIND_HIDDEN, key))

    def put_response(self, tenant: TenantId, response_id: str, body: bytes, expires_at: float) -> None:
        """Store a response (opaque bytes: the API's JSON) under its id until ``expires_at`` (unix time)."""
        if not isinstance(body, (bytes, bytearray)):
            raise TypeError(f"response body must be bytes, got {type(body).__name__}")
        _check_name(response_id, "response id")
        tk = self.keychain.tenant_keys(tenant)
        head = {"key": response_id, "created_at": time.time(), "expires_at": float(expires_at)}
        self._put_blob(tk, KIND_RESPONSE, tk.tag(KIND_RESPONSE, response_id), head, bytes(body))

    def get_response(self, tenant: TenantId, response_id: str, now: float | None = None) -> bytes | None:
        """The response stored under ``response_id``; None when there is none or it has expired (an
        expired one is deleted here)."""
        _check_name(response_id, "response id")
        tk = self.keychain.tenant_keys(tenant)
        tag = tk.tag(KIND_RESPONSE, response_id)
        got = self._get_blob(tk, KIND_RESPONSE, tag)
        if got is None:
            return None
        head, body = got
        if head["expires_at"] <= (time.time() if now is None else now):
            self.storage.blob_delete(tenant.value, KIND_RESPONSE, tag)
            return None
        return body

    def delete_response(self, tenant: TenantId, response_id: str) -> bool:
        """Delete the response stored under ``response_id``; True if it existed."""
        _check_name(response_id, "response id")
        tk = self.keychain.tenant_keys(tenant)
        return self.storage.blob_delete(tenant.value, KIND_RESPONSE, tk.tag(KIND_RESPONSE, response_id))

    def purge_responses(self, tenant: TenantId, now: float | None = None) -> int:
        """Delete the tenant's expired responses; returns how many."""
        tk = self.keychain.tenant_keys(tenant)
        now = time.time() if now is None else now
        gone = 0
        for blob in self.storage.blob_list(tenant.value, KIND_RESPONSE):
            if self._blob_head(tk, KIND_RESPONSE, blob)["expires_at"] <= now:
                gone += bool(self.storage.blob_delete(tenant.value, KIND_RESPONSE, blob.tag))
        return gone


def blob_record_id(tag: bytes, blob_id: bytes, index: int, num_chunks: int) -> bytes:
    """Record id of a blob's head (index 0) or chunk: binds the blob, its position and chunk count."""
    return tag + blob_id + struct.pack(">II", index, num_chunks)
