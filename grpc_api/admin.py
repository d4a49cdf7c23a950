"""The admin plane: ``reprise.v1.AdminService`` (admin keys only; see ``interceptors``).

Every backend call runs in a worker thread; long operations stream ``Progress`` messages as the backend
reports them and end with their result. An admin operation runs to completion even if its caller goes
away (a half-done compaction or rotation is worse than a finished one nobody reads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from grpc_api.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from serving import errors
from serving.admin import (
    AdminBackend,
    BadRecordInfo,
    CorpusDocument,
    HistoryCheck,
    HistoryExport,
    IndexMemory,
    Progress,
    TenantStats,
)
from serving.admission import Admission

_TENANT_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
KEY_KINDS = {
    admin_pb2.KEY_KIND_API_KEY: "api_key",
    admin_pb2.KEY_KIND_DATA_KEY: "data_key",
    admin_pb2.KEY_KIND_MASTER_KEY: "master_key",
}
_UPLOAD_QUEUE = 64


def check_tenant_id(tenant_id: str, field: str = "tenant_id") -> str:
    if not tenant_id:
        raise errors.InvalidArgument(f"{field} is empty")
    if not _TENANT_ID_RE.match(tenant_id):
        raise errors.InvalidArgument(f"{field} {tenant_id[:80]!r} is not a tenant id")
    return tenant_id


def stats_message(s: TenantStats) -> admin_pb2.TenantIndexStats:
    v = s.savings
    return admin_pb2.TenantIndexStats(
        tenant_id=s.tenant_id, index_tokens=s.index_tokens, index_sequences=s.index_sequences,
        index_memory_bytes=s.index_memory_bytes, corpus_tokens=s.corpus_tokens, num_requests=s.num_requests,
        num_steps=s.num_steps, num_drafted_steps=s.num_drafted_steps, hit_rate=s.hit_rate, tau=s.tau,
        num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
        acceptance_by_position=s.acceptance_by_position, drafter_steps=s.drafter_steps,
        counting_since_unix_ms=s.counting_since_unix_ms,
        prefix_cache_bytes=s.prefix_cache_bytes, prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens, prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        index_resident=s.index_resident, quarantined_records=s.quarantined_records,
        decode_seconds=v.decode_seconds, plain_decode_seconds=v.plain_decode_seconds,
        prefill_seconds=v.prefill_seconds, plain_prefill_seconds=v.plain_prefill_seconds,
        committed_tokens=v.num_tokens, speedup=v.speedup or 0.0, seconds_saved_drafts=v.seconds_saved_drafts,
        seconds_saved_cache=v.seconds_saved_cache, tokens_per_second=v.tokens_per_second or 0.0,
        holdout_requests=s.measured.held_out, drafted_requests=s.measured.drafted,
        measured_speedup=s.measured.speedup or 0.0, measured_speedup_low=s.measured.low or 0.0,
        measured_speedup_high=s.measured.high or 0.0,
    )


def bad_record_message(b: BadRecordInfo) -> admin_pb2.BadRecord:
    return admin_pb2.BadRecord(kind=b.kind, record_id=b.record_id, cursor=b.cursor, reason=b.reason)


def memory_message(m: IndexMemory) -> admin_pb2.IndexMemory:
    return admin_pb2.IndexMemory(budget_bytes=m.budget_bytes, resident_bytes=m.resident_bytes,
                                 resident_tenants=m.resident_tenants, num_evictions=m.num_evictions,
                                 quarantined_records=m.quarantined_records)


def _progress(p: Progress) -> common_pb2.Progress:
    return common_pb2.Progress(phase=p.phase, done=p.done, total=p.total, unit=p.unit)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, backend: AdminBackend, admission: Admission, executor: concurrent.futures.Executor,
                 max_message_bytes: int) -> None:
        self._backend = backend
        self._admission = admission
        self._executor = executor
        self._max_piece = max(1024, max_message_bytes // 2)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _stream(self, fn: Callable[..., Any], *args: Any):
        """Run ``fn(*args, progress)`` on a worker thread (the operation's own work); yield what it
        reports as it reports it (Progress records, export bytes), then ("result", value)."""
        loop = asyncio.get_running_loop()
        reports: asyncio.Queue[Any] = asyncio.Queue()

        def report(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(reports.put_nowait, item)

        done = loop.run_in_executor(self._executor, lambda: fn(*args, report))
        while True:
            getter = asyncio.ensure_future(reports.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not reports.empty():  # reported before it returned
                yield reports.get_nowait()
            yield ("result", done.result())
            return

    async def CreateTenant(self, request, context):
        info, key = await self._call(self._backend.create_tenant, request.name)
        return admin_pb2.CreateTenantResponse(tenant=_tenant(info), api_key=key)

    async def ListTenants(self, request, context):
        tenants = await self._call(self._backend.list_tenants)
        return admin_pb2.ListTenantsResponse(tenants=[_tenant(t) for t in tenants])

    async def DeleteTenant(self, request, context):
        tenant_id = check_tenant_id(request.tenant_id)
        if request.confirm != tenant_id:
            raise errors.FailedPrecondition(
                f"deleting tenant {tenant_id} destroys its history for good: set confirm to the tenant id")
        if not request.dry_run:
            self._admission.cancel_tenant(tenant_id)
        num = await self._call(self._backend.delete_tenant, tenant_id, request.dry_run)
        return admin_pb2.DeleteTenantResponse(deleted=not request.dry_run, num_records=num)

    async def RotateKeys(self, request, context):
        kind = KEY_KINDS.get(request.kind)
        if kind is None:
            raise errors.InvalidArgument(
                f"kind must be KEY_KIND_API_KEY, KEY_KIND_DATA_KEY or KEY_KIND_MASTER_KEY, got {request.kind}")
        if kind == "master_key":
            if request.tenant_id:
                raise errors.InvalidArgument("the master key belongs to no tenant: leave tenant_id empty")
        else:
            check_tenant_id(request.tenant_id)
        async for item in self._stream(self._backend.rotate_keys, kind, request.tenant_id):
            if isinstance(item, Progress):
                yield admin_pb2.RotateKeysResponse(progress=_progress(item))
            else:
                r = item[1]
                yield admin_pb2.RotateKeysResponse(result=admin_pb2.RotateKeysResult(
                    api_key=r.api_key, key_version=r.key_version, num_records=r.num_records))

    async def GetIndexStats(self, request, context):
        tenant_id = check_tenant_id(request.tenant_id) if request.tenant_id else None
        stats = await self._call(self._backend.index_stats, tenant_id)
        memory = await self._call(self._backend.index_memory)
        return admin_pb2.GetIndexStatsResponse(tenants=[stats_message(s) for s in stats],
                                               memory=memory_message(memory))

    async def _index_op(self, fn: Callable[..., Any], request):
        tenant_id = check_tenant_id(request.tenant_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        async for item in self._stream(fn, tenant_id):
            if isinstance(item, Progress):
                yield admin_pb2.IndexOperationResponse(progress=_progress(item))
            else:
                yield admin_pb2.IndexOperationResponse(result=admin_pb2.IndexOperationResult(
                    stats=stats_message(item[1]), seconds=loop.time() - start))

    def BuildIndex(self, request, context):
        return self._index_op(self._backend.build_index, request)

    def CompactIndex(self, request, context):
        return self._index_op(self._backend.compact_index, request)

    async def _history_check(self, fn: Callable[..., Any], request):
        tenant_id = check_tenant_id(request.tenant_id)
        async for item in self._stream(fn, tenant_id):
            if isinstance(item, Progress):
                yield admin_pb2.HistoryCheckResponse(progress=_progress(item))
            else:
                c: HistoryCheck = item[1]
                yield admin_pb2.HistoryCheckResponse(result=admin_pb2.HistoryCheckResult(
                    tenant_id=c.tenant_id, num_records=c.num_records, bad=[bad_record_message(b) for b in c.bad],
                    repaired=c.repaired, num_quarantined=c.num_quarantined))

    def VerifyHistory(self, request, context):
        return self._history_check(self._backend.verify_history, request)

    def RepairHistory(self, request, context):
        return self._history_check(self._backend.repair_history, request)

    async def ImportCorpus(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("item") != "header":
            raise errors.InvalidArgument("ImportCorpus must start with a header message naming the tenant")
        tenant_id = check_tenant_id(first.header.tenant_id, "header.tenant_id")
        docs: queue.Queue[Any] = queue.Queue(maxsize=_UPLOAD_QUEUE)
        done, failed = object(), object()

        def documents() -> Iterator[CorpusDocument]:
            while True:
                item = docs.get()
                if item is done:
                    return
                if item is failed:  # the upload broke off: the backend must not keep a partial corpus
                    raise errors.Aborted("corpus upload broke off before its end")
                yield item

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._backend.import_corpus, tenant_id, documents(),
                                      first.header.replace, lambda p: None)

        async def put(item: Any) -> None:
            while not future.done():  # backpressure without blocking the event loop
                try:
                    docs.put_nowait(item)
                    return
                except queue.Full:
                    await asyncio.sleep(0.005)

        end = failed
        try:
            index = 0
            async for message in request_iterator:
                if future.done():
                    break
                if message.WhichOneof("item") != "document":
                    raise errors.InvalidArgument(f"message {index + 1} repeats the header; send documents only")
                doc = message.document
                which = doc.WhichOneof("content")
                if which is None:
                    raise errors.InvalidArgument(f"document {index} is empty: set text or tokens")
                await put(CorpusDocument(text=doc.text) if which == "text"
                          else CorpusDocument(token_ids=tuple(doc.tokens.ids)))
                index += 1
            end = done
        finally:
            await put(end)
            if end is failed:
                await asyncio.wait([future])  # let the backend unwind before the error reaches the caller
                if not future.cancelled():
                    future.exception()  # retrieved: the caller gets the upload's own error
        result = await future
        return admin_pb2.ImportCorpusResponse(num_documents=result.num_documents, num_tokens=result.num_tokens,
                                              corpus_tokens=result.corpus_tokens)

    async def ExportHistory(self, request, context):
        tenant_id = check_tenant_id(request.tenant_id)
        if not request.password:
            raise errors.InvalidArgument("password is empty: the export file is sealed with it")
        piece = self._max_piece

        def run(tid: str, password: str, emit: Callable[[Any], None]) -> HistoryExport:
            def write(data: bytes) -> None:
                for i in range(0, len(data), piece):
                    emit(bytes(data[i:i + piece]))

            return self._backend.export_history(tid, password, write, emit)

        async for item in self._stream(run, tenant_id, request.password):
            if isinstance(item, Progress):
                yield admin_pb2.ExportHistoryResponse(progress=_progress(item))
            elif isinstance(item, bytes):
                yield admin_pb2.ExportHistoryResponse(data=item)
            else:
                r: HistoryExport = item[1]
                yield admin_pb2.ExportHistoryResponse(summary=admin_pb2.ExportSummary(
                    num_bytes=r.num_bytes, num_trajectories=r.num_trajectories,
                    skipped=[bad_record_message(b) for b in r.skipped]))

    async def ImportHistory(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("item") != "header":
            raise errors.InvalidArgument("ImportHistory must start with a header message")
        header = first.header
        if not header.password:
            raise errors.InvalidArgument("header.password is empty: the export file is sealed with one")
        if header.new_tenant_name and header.into_tenant_id:
            raise errors.InvalidArgument("give header.new_tenant_name or header.into_tenant_id, not both")
        if header.into_tenant_id:
            check_tenant_id(header.into_tenant_id, "header.into_tenant_id")
        # Spool the upload (memory, then disk): the backend authenticates the whole file before it
        # writes anything, which needs a seekable source.
        with tempfile.SpooledTemporaryFile(max_size=self._max_piece * 2) as spool:
            index = 0
            async for message in request_iterator:
                index += 1
                if message.WhichOneof("item") != "data":
                    raise errors.InvalidArgument(f"message {index} repeats the header; send data only")
                spool.write(message.data)
            spool.seek(0)
            result = await self._call(self._backend.import_history, spool, header.password,
                                      header.new_tenant_name, header.into_tenant_id, lambda p: None)
        return admin_pb2.ImportHistoryResponse(
            tenant=_tenant(result.tenant), created=result.created, num_trajectories=result.num_trajectories,
            num_blobs=result.num_blobs, api_key=result.api_key)


def _tenant(info: Any) -> admin_pb2.Tenant:
    return admin_pb2.Tenant(tenant_id=info.tenant_id, name=info.name, created_unix_ms=info.created_unix_ms)
