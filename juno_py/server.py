"""An OpenAI-compatible HTTP server (`juno-py serve`) on Starlette: `/v1/chat/completions` and `/v1/completions`
(both streamed as server-sent events on request), `/v1/models`.

The request's `model` field picks what plays: `base`, an adapter's name, or LoRAs combined as in `juno-py local --adapter`
(`a+b:0.5`; see `juno_py.playback.Adapters`). Requests wait in an asyncio queue; one worker thread generates one
reply at a time (switch adapters, render the GGUF's chat template in its sandbox, tokenize, generate) and hands
the text back to the event loop as it comes. A request is checked before it is queued; what only the worker can
find (a template error, a prompt longer than the context) is still answered as a JSON error, because a streamed
reply starts only once its prompt is ready. Errors have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`, status 400 (bad request), 404 (unknown model or path), 405,
413 (body too large), 503 (queue full), 500 (a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from juno_py.errors import JunoError, one_line, show
from juno_py.playback import Adapters, Sampling, SelectionError, UnknownAdapter, complete

MAX_BODY = 8 << 20  # bytes of one request
MAX_STOP = 4  # stop texts per request, as OpenAI allows
ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, one_line(message), param, code

    def body(self) -> dict:
        kind = {404: "not_found_error", 503: "server_overloaded", 500: "server_error"}.get(
            self.status, "invalid_request_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ------------------------------------------------------------------------------------------ the requests
@dataclass
class Job:
    """One request's work: what to play and on what prompt; `events` receives ("ready", prompt tokens),
    ("text", piece)..., then ("done", Completion) or ("error", RequestError)."""

    selection: Any
    prompt: Callable[[Any], list[int]]  # the model's tokenizer -> prompt ids (in the worker: templates take time)
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Engine:
    """The model, its adapters, the queue and the one worker thread that generates."""

    def __init__(self, model, adapters: Adapters, max_queue: int = 256, n_ctx: Optional[int] = None):
        self.model, self.adapters, self.max_queue = model, adapters, max_queue
        self.n_ctx = n_ctx or model.args.n_ctx_train
        self.created = int(time.time())
        self.served = 0
        self._queue: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._stopping = threading.Event()  # set at shutdown: the reply being generated ends after its token

    async def start(self) -> None:
        self._queue = asyncio.Queue(self.max_queue)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="juno-py-serve")
        self._task = asyncio.create_task(self._work())

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job) -> None:
        assert self._queue is not None, "the engine is not started"
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise RequestError(503, f"the server is busy: {self.max_queue} requests are waiting; retry later") from None

    async def _work(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            job = await self._queue.get()
            if not job.cancel.is_set():
                await loop.run_in_executor(self._executor, self._run, job)
            self._queue.task_done()

    def _run(self, job: Job) -> None:
        """In the worker thread: every failure becomes the job's error event, nothing escapes."""
        try:
            self.adapters.use(job.selection)
            tok = self.model.tokenizer
            ids = job.prompt(tok)
            if not ids:
                raise RequestError(400, "the prompt is empty: it has no tokens", "prompt")
            room = self.n_ctx - len(ids)
            if room < 1:
                raise RequestError(
                    400,
                    f"the prompt has {len(ids)} tokens; the model's context is {self.n_ctx} tokens",
                    "messages",
                    "context_length_exceeded",
                )
            sampling = job.sampling
            if sampling.max_tokens > room:
                sampling = Sampling(**{**sampling.__dict__, "max_tokens": room})
            job.put("ready", len(ids))
            done = complete(
                self.model,
                ids,
                sampling,
                lambda text: job.put("text", text),
                lambda: job.cancel.is_set() or self._stopping.is_set(),
            )
            self.served += 1
            job.put("done", done)
        except RequestError as e:
            job.put("error", e)
        except JunoError as e:  # a chat template that fails on these messages, an adapter that cannot combine
            job.put("error", RequestError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug: the client gets a 500, the server goes on
            job.put("error", RequestError(500, f"internal error: {type(e).__name__}: {e}"))


# -------------------------------------------------------------------------------------- reading requests
def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise RequestError(400, f"{name}: expected {'an integer' if integer else 'a number'}, got {show(value)}", name)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise RequestError(400, f"{name}: {show(value)} is out of range (expected {lo:g} to {hi:g})", name)
    return value


def _sampling(body: dict) -> Sampling:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({param: max_tokens}, param, 256, 1, 1 << 20, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise RequestError(400, f"stop: expected a string or a list of at most {MAX_STOP} strings", "stop")
    _number(body, "n", 1, 1, 1, integer=True)  # one choice per request
    top_k = _number(body, "top_k", 0, 0, 1 << 20, integer=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise RequestError(400, f"seed: expected a non-negative integer, got {show(seed)}", "seed")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_k=top_k or None,
        top_p=float(_number(body, "top_p", 1.0, 0, 1)),
        seed=seed,
        stop=stop,
    )


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(400, f"{where}: only text parts are served, got {show(part)}", "messages")
            out.append(part["text"])
        return "".join(out)
    raise RequestError(400, f"{where}: expected a string or a list of text parts, got {show(content)}", "messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where}: expected an object with role and content, got {show(m)}", "messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise RequestError(
                400, f"{where}.role: expected one of {', '.join(ROLES)}, developer; got {show(role)}", "messages"
            )
        out.append({"role": role, "content": _text_of(m.get("content"), f"{where}.content")})
    return out


def _prompt_of(body: dict) -> Callable[[Any], list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return lambda tok: tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        return lambda tok: _checked_ids(ids, tok.vocab_size)
    raise RequestError(400, "prompt: expected a string, or a list of token ids (one prompt per request)", "prompt")


def _checked_ids(ids: list[int], n_vocab: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise RequestError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0 to {n_vocab - 1})", "prompt")
    return ids


async def _body(request: Request) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise RequestError(413, f"the request body is larger than {MAX_BODY} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise RequestError(413, f"the request body is larger than {MAX_BODY} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {show(body)}")
    return body


def _selection(engine: Engine, body: dict):
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(400, f"model: expected a string ('base' or an adapter's name), got {show(model)}", "model")
    try:
        return model, engine.adapters.parse(model)
    except UnknownAdapter as e:
        raise RequestError(404, str(e), "model", "model_not_found") from None
    except SelectionError as e:
        raise RequestError(400, str(e), "model") from None


# ------------------------------------------------------------------------------------------------- answers
def _sse(record: dict) -> str:
    return f"data: {json.dumps(record, ensure_ascii=False)}\n\n"


def _usage(done) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _finish(done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


async def _answer(engine: Engine, request: Request, chat: bool) -> Response:
    try:
        body = await _body(request)
        name, selection = _selection(engine, body)
        if chat:
            messages = _messages(body)
            prompt = lambda tok: tok.apply_chat_template(messages, add_generation_prompt=True)  # noqa: E731
        else:
            if body.get("echo") or body.get("logprobs") or (body.get("best_of") or 1) != 1 or body.get("suffix"):
                raise RequestError(400, "echo, logprobs, best_of and suffix are not supported", "prompt")
            prompt = _prompt_of(body)
        if chat and body.get("logprobs"):
            raise RequestError(400, "logprobs are not supported", "logprobs")
        if body.get("tools"):
            raise RequestError(400, "tools are not supported", "tools")
        sampling = _sampling(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, f"stream: expected true or false, got {show(stream)}", "stream")
        options = body.get("stream_options") or {}
        usage_chunk = bool(isinstance(options, dict) and options.get("include_usage"))
        job = Job(selection, prompt, sampling, asyncio.get_running_loop())
        engine.submit(job)
        try:
            kind, value = await job.events.get()
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        if kind == "error":
            raise value
    except RequestError as e:
        return e.response()

    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created, "model": name}
    if not stream:
        pieces = []
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    pieces.append(value)
                elif kind == "error":
                    return value.response()
                else:
                    done = value
                    break
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        text = "".join(pieces)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            if chat
            else {"index": 0, "text": text, "logprobs": None}
        )
        choice["finish_reason"] = _finish(done)
        return JSONResponse({**head, "choices": [choice], "usage": _usage(done)})

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(piece: Optional[str], finish: Optional[str]) -> dict:
        if chat:
            delta = {} if piece is None else {"content": piece}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**chunk_head, "choices": [choice]}

    async def events() -> AsyncIterator[str]:
        try:
            if chat:
                first = chunk("", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(first)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield _sse(chunk(value, None))
                elif kind == "error":  # after the headers went out: the error is the stream's last event
                    yield _sse(value.body())
                    break
                else:
                    yield _sse(chunk(None, _finish(value)))
                    if usage_chunk:
                        yield _sse({**chunk_head, "choices": [], "usage": _usage(value)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client went away, or the reply is complete: either way the worker may stop

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def build_app(engine: Engine) -> Starlette:
    """The Starlette application serving `engine`; its lifespan starts and stops the worker."""

    async def chat_completions(request: Request) -> Response:
        return await _answer(engine, request, chat=True)

    async def completions(request: Request) -> Response:
        return await _answer(engine, request, chat=False)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": engine.created, "owned_by": "juno-py"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card(n) for n in engine.adapters.names()]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in engine.adapters.names():
            served = ", ".join(engine.adapters.names())
            error = RequestError(404, f"model {show(name)}: not served (served: {served})", "model", "model_not_found")
            return error.response()
        return JSONResponse(card(name))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "served": engine.served})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {404: f"no such path: {request.url.path}", 405: f"method {request.method} not allowed here"}
        return RequestError(status, message.get(status, str(getattr(exc, "detail", exc)))).response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
