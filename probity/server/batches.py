"""Batch jobs in OpenAI's Batch API shape (docs/api.md, Batch jobs): `/v1/files` holds uploaded
JSONL files of requests, `/v1/batches` runs one through the server's own routes at the
engine's full concurrency and writes an output file and an error file.

Everything a batch is lives on disk under `--batch-dir`, so a job survives an engine restart
(a line the dead engine was running is run again: its answer was never given) and a server
restart (the next server resumes every unfinished batch from what its output and error
files already hold). Each result line is named `batch_req_<batch>_<line>`: what a file holds
says which lines are done, so none is run twice and none is lost. A line runs exactly as the
same request sent directly (the same route, validation and engine path), so its response
is the same, bit for bit, but for the response's own id and time."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .errors import APIError

log = logging.getLogger("probity.server")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
COMPLETION_WINDOW = "24h"
LINE_KEYS = {"custom_id", "method", "url", "body"}
MAX_CUSTOM_ID = 512
MAX_METADATA = 16
# a line whose request met one of these (the engine restarting, a full queue) is run again
RETRIED = {"engine_unavailable": 120, "engine_timeout": 10, "queue_full": 600, "queue_timeout": 600,
           "engine_error": 3}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class BatchLimits:
    """Where batch jobs live and what they may hold (CLI flags; docs/api.md)."""
    root: Path
    disk_bytes: int = 10 << 30       # every stored file together: inputs, outputs, errors, running results
    max_file_bytes: int = 200 << 20  # one uploaded file


def _now() -> int:
    return int(time.time())


def _write_json(path: Path, obj: dict) -> None:
    """Replace `path` with obj's JSON whole (a crash leaves the old one or the new one)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Store:
    """Files and batch records on disk: `files/<id>.json` (the file object) beside
    `files/<id>.jsonl` (its bytes); `batches/<id>.json` (the batch object). A batch's output
    and error files get their ids when it is created and are written in place from its first
    result on; their file objects appear when it ends, so no step of its end can lose them."""

    def __init__(self, limits: BatchLimits):
        self.limits = limits
        self.files = limits.root / "files"
        self.batches = limits.root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)
        self.used_bytes()

    # -------------------------------------------------------------- files
    def used_bytes(self) -> int:
        """Every stored byte, counted from the folders (and kept in `used` for room(recount=False))."""
        self.used = sum(p.stat().st_size for d in (self.files, self.batches) for p in d.iterdir() if p.is_file())
        return self.used

    def wrote(self, more: int) -> None:
        self.used += more

    def room(self, more: int, recount: bool = True) -> None:
        """Refuse `more` bytes past the bound. A running batch checks each result against the
        count it keeps (recount=False: no folder scan a line), recounted at each save."""
        used = self.used_bytes() if recount else self.used
        if used + more > self.limits.disk_bytes:
            raise APIError("storage_full", f"storing {more} more bytes would pass the batch store's bound of "
                           f"{self.limits.disk_bytes} bytes ({used} used; --batch-disk-mib): delete files first")

    def data(self, file_id: str) -> Path:
        return self.files / f"{file_id}.jsonl"

    def file(self, file_id: str) -> dict:
        p = self.files / f"{file_id}.json"
        if "/" in file_id or not file_id.startswith("file-") or not p.exists():
            raise APIError("not_found", f"no file {file_id!r}", "file_id")
        return json.loads(p.read_text())

    def list_files(self, purpose: str | None = None) -> list[dict]:
        out = [json.loads(p.read_text()) for p in self.files.glob("file-*.json")]
        return sorted((f for f in out if purpose is None or f["purpose"] == purpose),
                      key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def add_file(self, src: Path, filename: str, purpose: str) -> dict:
        """Take `src` (already written, counted against the bound) as a new file."""
        fid = f"file-{uuid.uuid4().hex[:24]}"
        os.replace(src, self.data(fid))
        return self.publish(fid, filename, purpose)

    def publish(self, fid: str, filename: str, purpose: str) -> dict:
        """The file object of bytes already at data(fid) (again: the same object)."""
        p = self.files / f"{fid}.json"
        if p.exists():
            return json.loads(p.read_text())
        meta = {"id": fid, "object": "file", "bytes": self.data(fid).stat().st_size, "created_at": _now(),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None}
        _write_json(p, meta)
        return meta

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        (self.files / f"{file_id}.json").unlink()
        self.data(file_id).unlink(missing_ok=True)

    def scratch(self) -> Path:
        return self.files / f".upload-{uuid.uuid4().hex}"

    # -------------------------------------------------------------- batches
    def batch(self, batch_id: str) -> dict:
        p = self.batches / f"{batch_id}.json"
        if "/" in batch_id or not batch_id.startswith("batch_") or not p.exists():
            raise APIError("not_found", f"no batch {batch_id!r}", "batch_id")
        return json.loads(p.read_text())

    def save(self, b: dict) -> None:
        _write_json(self.batches / f"{b['id']}.json", b)

    def list_batches(self) -> list[dict]:
        out = [json.loads(p.read_text()) for p in self.batches.glob("batch_*.json")]
        return sorted(out, key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def results(self, b: dict, kind: str) -> Path:
        return self.data(b["_files"][kind])


def public(b: dict) -> dict:
    """The batch object as the API shows it (without the store's own keys)."""
    return {k: v for k, v in b.items() if not k.startswith("_")}


def line_id(batch_id: str, n: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{n}"


def line_of(record_id: str) -> int:
    return int(record_id.rsplit("_", 1)[1])


def _usage() -> dict:
    """OpenAI's batch `usage`: the tokens of every answered line together."""
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def _add_usage(total: dict, rec: dict) -> None:
    u = ((rec.get("response") or {}).get("body") or {}).get("usage") or {}
    total["input_tokens"] += u.get("prompt_tokens", 0)
    total["input_tokens_details"]["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    total["output_tokens"] += u.get("completion_tokens", 0)
    total["total_tokens"] += u.get("total_tokens", 0)


def recover(path: Path) -> Iterator[dict]:
    """The whole records of a results file, one at a time (a 100k-line output is not held in
    memory), after cutting off a last line a crash left half-written."""
    if not path.exists():
        return
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:   # back to just after the last newline
            f.seek(max(0, end - 65536))
            chunk = f.read(end - max(0, end - 65536))
            i = chunk.rfind(b"\n")
            if i >= 0:
                end = max(0, end - 65536) + i + 1
                break
            end = max(0, end - 65536)
        if end < size:
            f.truncate(end)
        f.seek(0)
        for line in f:
            if line.strip():
                yield json.loads(line)


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 0, bytes) of every non-blank line."""
    with open(path, "rb") as f:
        n = 0
        for raw in f:
            if raw.strip():
                yield n, raw
                n += 1


class LineError(Exception):
    """A line that is not a request (named in the error file; the other lines still run)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


def parse_line(raw: bytes, n: int) -> tuple[str, str, dict]:
    """A line's (custom_id, url, body), or LineError naming what is wrong with it. A line may
    name any supported endpoint, not only its batch's (as vLLM's run-batch allows)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise LineError("invalid_json_line", f"line {n + 1} is not JSON: {e}") from None
    if type(obj) is not dict:
        raise LineError("invalid_line", f"line {n + 1} is not a JSON object")
    cid = obj.get("custom_id")
    cid = cid if type(cid) is str and 1 <= len(cid) <= MAX_CUSTOM_ID else None
    if cid is None:
        raise LineError("invalid_line", f"line {n + 1}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    extra = set(obj) - LINE_KEYS
    if extra:
        raise LineError("invalid_line", f"line {n + 1}: unknown key {sorted(extra)[0]!r}", cid)
    if obj.get("method") != "POST":
        raise LineError("invalid_method", f"line {n + 1}: method must be POST", cid)
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError("invalid_url", f"line {n + 1}: url {str(url)[:200]!r} is not an endpoint a batch runs "
                        f"({', '.join(ENDPOINTS)})", cid)
    body = obj.get("body")
    if type(body) is not dict:
        raise LineError("invalid_line", f"line {n + 1}: body must be a JSON object", cid)
    if body.get("stream") not in (None, False):
        raise LineError("invalid_line", f"line {n + 1}: a batch line cannot stream", cid)
    return cid, url, body


async def call_route(app, path: str, body: bytes, request_id: str) -> tuple[int, bytes]:
    """POST `body` to one of the app's routes in-process, below the HTTP middleware (the batch's
    creator was already admitted): the same endpoint, validation and engine path as a direct
    request. Returns (status, response body)."""
    finished = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the "client" stays until the answer is whole
        return {"type": "http.disconnect"}

    status, chunks = [0], []

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                finished.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "app": app,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"host", b"batch")],
             "client": ("batch", 0), "server": ("batch", 0), "state": {"request_id": request_id}}
    try:
        async with contextlib.AsyncExitStack() as stack:
            scope["fastapi_middleware_astack"] = stack   # what FastAPI's outermost middleware would give
            await app.router(scope, receive, send)
    finally:
        finished.set()
    return status[0], b"".join(chunks)


class Batches:
    """The batch jobs of one server: their routes' logic and one runner task per unfinished batch."""

    def __init__(self, store: Store, app, concurrency: Callable[[], int], served: Callable[[], str],
                 engine_up: Callable[[], asyncio.Future] | None = None):
        self.store = store
        self.app = app
        self.concurrency = concurrency
        self.served = served
        self.engine_up = engine_up
        self.tasks: dict[str, asyncio.Task] = {}
        self.live: dict[str, dict] = {}   # the running batches' objects (their counts move)

    # -------------------------------------------------------------- lifecycle
    def resume(self) -> None:
        """Start every batch a previous server left unfinished."""
        for b in self.store.list_batches():
            if b["status"] in UNFINISHED:
                log.info("batch %s: resumed (%s)", b["id"], b["status"])
                self._start(b["id"])

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _start(self, batch_id: str) -> None:
        self.live[batch_id] = self.store.batch(batch_id)
        t = asyncio.ensure_future(self.run(batch_id))
        self.tasks[batch_id] = t

        def ended(_):
            self.tasks.pop(batch_id, None)
            self.live.pop(batch_id, None)
        t.add_done_callback(ended)

    def get(self, batch_id: str) -> dict:
        return public(self.live.get(batch_id) or self.store.batch(batch_id))

    def list(self) -> list[dict]:
        return [public(self.live.get(b["id"], b)) for b in self.store.list_batches()]

    # -------------------------------------------------------------- routes
    def create(self, body: dict) -> dict:
        extra = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if extra:
            raise APIError("unknown_parameter", f"unknown parameter '{sorted(extra)[0]}'", sorted(extra)[0])
        fid = body.get("input_file_id")
        if type(fid) is not str:
            raise APIError("missing_required_parameter", "'input_file_id' is required", "input_file_id")
        f = self.store.file(fid)
        if f["purpose"] != "batch":
            raise APIError("invalid_value", f"file {fid} has purpose {f['purpose']!r}, not 'batch'", "input_file_id")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError("unsupported_value", f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window") != COMPLETION_WINDOW:
            raise APIError("invalid_value", f"'completion_window' must be {COMPLETION_WINDOW!r}", "completion_window")
        meta = body.get("metadata")
        if meta is not None and (type(meta) is not dict or len(meta) > MAX_METADATA or not all(
                type(k) is str and len(k) <= 64 and type(v) is str and len(v) <= 512 for k, v in meta.items())):
            raise APIError("invalid_value", f"'metadata' must be at most {MAX_METADATA} string pairs "
                           "(keys up to 64, values up to 512 characters)", "metadata")
        total = sum(1 for _ in input_lines(self.store.data(fid)))
        now = _now()
        b = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": fid, "completion_window": COMPLETION_WINDOW, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": None, "finalizing_at": None, "completed_at": None, "failed_at": None,
             "expired_at": None, "cancelling_at": None, "cancelled_at": None, "model": self.served(),
             "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": meta, "usage": _usage(),
             "_files": {"output": f"file-{uuid.uuid4().hex[:24]}", "errors": f"file-{uuid.uuid4().hex[:24]}"}}
        self.store.save(b)
        self._start(b["id"])
        return public(b)

    def cancel(self, batch_id: str) -> dict:
        b = self.live.get(batch_id) or self.store.batch(batch_id)
        if b["status"] in ("cancelling", "cancelled"):
            return public(b)
        if b["status"] not in UNFINISHED:
            raise APIError("conflict", f"batch {batch_id} is {b['status']}: only an unfinished batch can be cancelled",
                           "batch_id")
        b.update(status="cancelling", cancelling_at=_now())
        self.store.save(b)
        if batch_id not in self.tasks:
            self._start(batch_id)
        return public(b)

    def in_use(self, file_id: str) -> bool:
        return any(b["input_file_id"] == file_id and b["status"] in UNFINISHED for b in self.store.list_batches())

    # -------------------------------------------------------------- running
    async def run(self, batch_id: str) -> None:
        try:
            await self._run(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or the disk: the batch says so, the server goes on
            log.exception("batch %s failed", batch_id)
            b = self.live.get(batch_id) or self.store.batch(batch_id)
            b.update(status="failed", failed_at=_now(), errors={"object": "list", "data": [
                {"code": "internal_error", "message": f"{type(e).__name__}: {e}", "param": None, "line": None}]})
            self.store.save(b)

    async def _run(self, batch_id: str) -> None:
        store = self.store
        b = self.live[batch_id]
        out_path, err_path = store.results(b, "output"), store.results(b, "errors")
        if b["status"] == "finalizing":   # every line was done: only the end was left
            return self._finish(b, out_path, err_path, [])
        done = self._resume(b, out_path, err_path)
        counts = b["request_counts"]
        outs = {"output": open(out_path, "ab"), "errors": open(err_path, "ab")}
        last_save = [time.monotonic()]
        full: list[APIError] = []

        def record(kind: str, rec: dict) -> None:
            line = (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
            try:
                store.room(len(line), recount=False)
            except APIError as e:
                full.append(e)
                return
            outs[kind].write(line)
            outs[kind].flush()   # in the OS's hands: a server killed now keeps it
            store.wrote(len(line))
            counts["completed" if kind == "output" else "failed"] += 1
            if kind == "output":
                _add_usage(b["usage"], rec)
            if time.monotonic() - last_save[0] > 0.5:
                last_save[0] = time.monotonic()
                store.save(b)
                store.used_bytes()

        seen: set[str] = set()
        slots = asyncio.Semaphore(max(1, self.concurrency()))
        running: set[asyncio.Task] = set()
        try:
            for n, raw in input_lines(store.data(b["input_file_id"])):
                if b["status"] == "cancelling" or full:
                    break
                try:
                    cid, url, body = _unique_line(raw, n, seen)
                except LineError as e:
                    if n not in done:
                        record("errors", {"id": line_id(batch_id, n), "custom_id": e.custom_id, "response": None,
                                          "error": {"code": e.code, "message": e.message}})
                    continue
                if n in done:
                    continue
                await slots.acquire()
                t = asyncio.ensure_future(self._line(batch_id, n, cid, body, url, record))
                running.add(t)
                t.add_done_callback(lambda t: (running.discard(t), slots.release()))
            await _drain(b, running)
        finally:
            for t in running:
                t.cancel()
            for f in outs.values():
                f.flush()
                os.fsync(f.fileno())
                f.close()
        self._finish(b, out_path, err_path, full)

    def _resume(self, b: dict, out_path: Path, err_path: Path) -> set[int]:
        """The lines a batch's results already answer (its counts and usage recounted from them),
        the batch now in progress."""
        done: set[int] = set()
        counts = b["request_counts"]
        counts["completed"] = counts["failed"] = 0
        b["usage"] = _usage()
        for kind, path in (("completed", out_path), ("failed", err_path)):
            for r in recover(path):
                done.add(line_of(r["id"]))
                counts[kind] += 1
                if kind == "completed":
                    _add_usage(b["usage"], r)
        if b["status"] == "validating":
            b.update(status="in_progress", in_progress_at=_now())
        self.store.save(b)
        self.store.used_bytes()
        return done

    async def _line(self, batch_id: str, n: int, cid: str, body: dict, endpoint: str, record) -> None:
        try:
            await self._answer(batch_id, n, cid, body, endpoint, record)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: this line says so, the others go on
            log.exception("batch %s line %d failed", batch_id, n)
            record("errors", {"id": line_id(batch_id, n), "custom_id": cid, "response": None,
                              "error": {"code": "internal_error", "message": f"{type(e).__name__}: {e}"}})

    async def _answer(self, batch_id: str, n: int, cid: str, body: dict, endpoint: str, record) -> None:
        rid = line_id(batch_id, n)
        data = json.dumps(body, ensure_ascii=False).encode()
        tries: dict[str, int] = {}
        while True:
            status, resp = await call_route(self.app, endpoint, data, rid)
            try:
                answer = json.loads(resp)
            except ValueError:
                answer = {"error": {"message": resp.decode("utf-8", "replace")[:1000], "type": "server_error",
                                    "param": None, "code": "internal_error"}}
            code = (answer.get("error") or {}).get("code") if status != 200 else None
            if code in RETRIED and tries.get(code, 0) < RETRIED[code]:
                tries[code] = tries.get(code, 0) + 1
                await asyncio.sleep(min(2.0, 0.2 * tries[code]))  # the engine restarts in seconds; a request waits for it
                continue
            rec = {"id": rid, "custom_id": cid, "response": {"status_code": status, "request_id": rid, "body": answer},
                   "error": None}
            record("output" if status == 200 else "errors", rec)
            return

    def _finish(self, b: dict, out_path: Path, err_path: Path, full: list[APIError]) -> None:
        store = self.store
        cancelled = b["status"] == "cancelling"
        if not cancelled and not full and b["status"] != "finalizing":
            b.update(status="finalizing", finalizing_at=_now())
            store.save(b)
        for kind, path, key in (("output", out_path, "output_file_id"), ("errors", err_path, "error_file_id")):
            if path.exists() and path.stat().st_size:
                b[key] = store.publish(b["_files"][kind], f"{b['id']}_{kind}.jsonl", "batch_output")["id"]
            else:
                path.unlink(missing_ok=True)
        now = _now()
        if full:
            b.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": "storage_full", "message": full[0].message, "param": None, "line": None}]})
        elif cancelled:
            b.update(status="cancelled", cancelled_at=now)
        else:
            b.update(status="completed", completed_at=now)
        store.save(b)
        log.info("batch %s: %s (%d completed, %d failed of %d)", b["id"], b["status"],
                 b["request_counts"]["completed"], b["request_counts"]["failed"], b["request_counts"]["total"])


# ------------------------------------------------------------------ routes

def _unique_line(raw: bytes, n: int, seen: set[str]) -> tuple[str, str, dict]:
    """parse_line, and its custom_id not one an earlier line used."""
    cid, url, body = parse_line(raw, n)
    if cid in seen:
        raise LineError("duplicate_custom_id", f"line {n + 1}: custom_id {cid!r} is used by an earlier line "
                        "(each line's must be unique)", cid)
    seen.add(cid)
    return cid, url, body


async def _drain(b: dict, running: set) -> None:
    """Wait for a batch's running lines; a cancel stops what still runs."""
    while running:
        if b["status"] == "cancelling":
            for t in running:
                t.cancel()
        await asyncio.wait(set(running), timeout=0.2)


def _page(items: list[dict], request, default_limit: int) -> dict:
    """OpenAI's cursor page: `after` an id, `limit` items, newest first."""
    q = request.query_params
    try:
        limit = int(q.get("limit", default_limit))
    except ValueError:
        raise APIError("invalid_type", "'limit' must be an integer", "limit") from None
    if not 1 <= limit <= 10000:
        raise APIError("invalid_value", "'limit' must be in [1, 10000]", "limit")
    after = q.get("after")
    if after is not None:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


# ------------------------------------------------------------------ the HTTP routes

def _upload_bound(request, bound: int) -> None:
    """What the headers say about an upload, before its body is read."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise APIError("invalid_body", "an upload needs a Content-Length header")
    if int(length) > bound + (64 << 10):   # the multipart framing's allowance
        raise _too_large(bound)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError("unsupported_media_type", "upload a file as multipart/form-data")


def _too_large(bound: int) -> APIError:
    return APIError("request_too_large", f"a file may hold at most {bound} bytes (--max-file-mib)", "file")


def _file_part(form, bound: int):
    """The form's `file` part, its `purpose` checked."""
    purpose, up = form.get("purpose"), form.get("file")
    if purpose is None:
        raise APIError("missing_required_parameter", "'purpose' is required", "purpose")
    if purpose != "batch":
        raise APIError("unsupported_value", "'purpose' must be 'batch' (the only files this server uses)", "purpose")
    if up is None or isinstance(up, str):
        raise APIError("missing_required_parameter", "'file' is required (a file part)", "file")
    if (up.size or 0) > bound:
        raise _too_large(bound)
    return up


async def upload_file(batches: "Batches", request):
    """Upload a JSONL file of requests (multipart: `file`, `purpose: batch`)."""
    store = batches.store
    bound = store.limits.max_file_bytes
    _upload_bound(request, bound)
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as e:  # python-multipart's refusal of a malformed body
        raise APIError("invalid_body", f"the upload is not valid multipart/form-data: {e}") from None
    try:
        up = _file_part(form, bound)
        store.room(up.size or 0)
        tmp = store.scratch()
        try:
            with open(tmp, "wb") as f:
                while chunk := await up.read(1 << 20):
                    f.write(chunk)
            return store.add_file(tmp, up.filename or "upload.jsonl", "batch")
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        await form.close()


async def list_files(batches: "Batches", request):
    """The stored files, newest first (`purpose`, `after`, `limit`)."""
    return _page(batches.store.list_files(request.query_params.get("purpose")), request, 10000)


async def get_file(batches: "Batches", request):
    return batches.store.file(request.path_params["file_id"])


async def file_content(batches: "Batches", request):
    """A file's bytes."""
    from starlette.responses import FileResponse

    f = batches.store.file(request.path_params["file_id"])
    return FileResponse(batches.store.data(f["id"]), media_type="application/octet-stream", filename=f["filename"])


async def delete_file(batches: "Batches", request):
    fid = request.path_params["file_id"]
    batches.store.file(fid)
    if batches.in_use(fid):
        raise APIError("conflict", f"file {fid} is the input of an unfinished batch: cancel it first", "file_id")
    batches.store.delete_file(fid)
    return {"id": fid, "object": "file", "deleted": True}


async def list_batches(batches: "Batches", request):
    return _page(batches.list(), request, 20)


async def get_batch(batches: "Batches", request):
    return batches.get(request.path_params["batch_id"])


async def cancel_batch(batches: "Batches", request):
    return batches.cancel(request.path_params["batch_id"])


def add_routes(app, batches: "Batches", max_body: int, body_timeout: float) -> None:
    """The Files and Batches routes; each answers its APIError in OpenAI's envelope."""
    from starlette.responses import JSONResponse

    from .body import read_json

    async def create_batch(batches: "Batches", request):
        """Run an uploaded file's requests as one batch job."""
        return batches.create(await read_json(request, max_body, body_timeout))

    def answered(fn):
        async def endpoint(request):
            try:
                out = await fn(batches, request)
                return out if not isinstance(out, dict) else JSONResponse(out)
            except APIError as e:
                return e.response()
        endpoint.__name__, endpoint.__doc__ = fn.__name__, fn.__doc__
        return endpoint

    for path, fn, method in (
            ("/v1/files", upload_file, "POST"), ("/v1/files", list_files, "GET"),
            ("/v1/files/{file_id}", get_file, "GET"), ("/v1/files/{file_id}", delete_file, "DELETE"),
            ("/v1/files/{file_id}/content", file_content, "GET"),
            ("/v1/batches", create_batch, "POST"), ("/v1/batches", list_batches, "GET"),
            ("/v1/batches/{batch_id}", get_batch, "GET"), ("/v1/batches/{batch_id}/cancel", cancel_batch, "POST")):
        app.add_route(path, answered(fn), methods=[method], name=fn.__name__, include_in_schema=True)
