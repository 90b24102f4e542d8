"""An HTTP server for the engine: OpenAI-style POST /v1/completions, streamed or not, on FastAPI + uvicorn.

    clients ──HTTP──> uvicorn (asyncio event loop) ──add_request──> EngineLoop thread
            <──JSON or SSE "data: {...}" chunks, then "data: [DONE]"──  on_token callbacks
                                                                         (call_soon_threadsafe)

The event loop only parses, validates and waits; one background thread runs engine.step()
whenever requests are in flight, so every connected client shares the continuous batch.
Every error has OpenAI's shape {"error": {"message", "type", "param", "code"}}: a bad request
(a body that is not UTF-8 JSON, a wrong type, which is never coerced, an unknown or unsupported
field, a value out of range, a prompt too long for the model) is a 400 naming the field; a request
the engine fails is a 500 for that request alone, the others in its batch go on; a client that
disconnects has its request cancelled and its KV blocks freed. It binds 127.0.0.1 unless told otherwise.
Megatron has two servers: an OpenAI-compatible one
for its dynamic engine on Quart + hypercorn (megatron/core/inference/text_generation_server/dynamic_text_gen_server/:
/v1/completions, /v1/chat/completions, streamed or not), and a Flask one for its static engine
(megatron/core/inference/text_generation_server/text_generation_server.py: PUT /api, POST /completions).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import statistics
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from megalab.core.inference.engines.dynamic_engine import InferenceEngine
from megalab.core.inference.sampling_params import SamplingParams

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt this model can take
MAX_STOP = 4  # stop strings per request, as OpenAI


class CompletionRequest(BaseModel):
    """The OpenAI /v1/completions body, checked strictly: a wrong type is a 400, never coerced
    ("max_tokens": "3" or true is refused), and so is a field this server does not know."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=1 << 20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # OpenAI fields this server does not implement: accepted only at the value that changes nothing
    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"give at most {MAX_STOP} non-empty stop strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        neutral = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}
        for name, value in neutral.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by this server "
                                 f"(only {name}={value!r}); {UNSUPPORTED_HINTS[name]}")
        if self.logit_bias:
            raise ValueError(f"logit_bias is not supported by this server; {UNSUPPORTED_HINTS['logit_bias']}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


CompletionRequest.model_rebuild()

UNSUPPORTED_HINTS = {
    "n": "send n separate requests (with different seeds) instead",
    "best_of": "send several requests and pick the best yourself",
    "echo": "prepend the prompt to the completion yourself",
    "logprobs": "the engine's SamplingParams(return_log_probs=True) gives them in Python",
    "suffix": "this model only continues text",
    "presence_penalty": "leave it at 0",
    "frequency_penalty": "leave it at 0",
    "logit_bias": "leave it out",
}


class EngineLoop:
    """Runs engine.step() in one background thread while requests are in flight.

    Every touch of the engine (add, cancel, step) holds one lock, so a request can be cancelled
    from the server's event loop between two steps.
    """

    def __init__(self, engine: InferenceEngine):
        self.engine, self.lock = engine, threading.Condition()
        self.running, self.thread = False, None

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._run, name="megalab-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.running = False
            self.engine.abort_all("cancelled")
            self.lock.notify()
        self.thread.join()

    def add_request(self, *args, **kwargs):
        with self.lock:  # raises ValueError on a request the engine cannot take
            request = self.engine.add_request(*args, **kwargs)
            self.lock.notify()
            return request

    def cancel(self, request, reason: str = "cancelled") -> None:
        with self.lock:
            self.engine.cancel(request, reason)

    def _run(self) -> None:
        while True:
            with self.lock:
                while self.running and not self.engine.has_unfinished_requests():
                    self.lock.wait()
                if not self.running:
                    return
                try:
                    self.engine.step()  # fails a broken request alone
                except Exception:  # a fault outside any one request (the scheduler): end them all, keep serving
                    traceback.print_exc()
                    self.engine.abort_all("error")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": None, "code": None}})


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_completion_request(raw: bytes) -> CompletionRequest:
    """The body's bytes -> a checked CompletionRequest, or BadRequest saying what is wrong and where."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", 413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start}): send UTF-8 JSON") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise BadRequest(f"malformed JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object like {{\"prompt\": \"...\"}}, got a {type(body).__name__}")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"]) or "body"
        if e["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown field (this server takes {', '.join(CompletionRequest.model_fields)})")
        elif e["type"] == "value_error":  # our own validators: their message is the whole story
            problems.append(f"{where + ': ' if e['loc'] else ''}{e['msg'].removeprefix('Value error, ')}")
        else:
            problems.append(f"{where}: {e['msg']}")
    return "; ".join(problems)


def _codec(tokenizer):
    """(encode, decode) of a tokenizer with encode/decode, or Megatron's tokenize/detokenize (chapter 05's)."""
    if hasattr(tokenizer, "tokenize"):
        return tokenizer.tokenize, tokenizer.detokenize
    return tokenizer.encode, tokenizer.decode


class _TextStream:
    """Text of the tokens so far, handed out in pieces. Holds back a cut multi-byte character and any
    tail that could still grow into a stop string; ends at the first stop string, which is not sent."""

    def __init__(self, decode, stop: list[str] = ()):
        self.decode, self.stop, self.tokens, self.sent = decode, list(stop or ()), [], 0

    def push(self, token: int | None, final: bool) -> tuple[str, bool]:
        """(new text to send, whether a stop string ended the completion)."""
        if token is not None:
            self.tokens.append(token)
        text = self.decode(self.tokens)
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            return self._take(text, min(hits)), True
        if final:
            return self._take(text, len(text)), False
        if text.endswith("\ufffd"):
            return "", False
        held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(text, max(self.sent, len(text) - held)), False

    def _take(self, text: str, end: int) -> str:
        piece, self.sent = text[self.sent:end], end
        return piece


def create_app(engine: InferenceEngine, tokenizer, model_name: str = "megalab-gpt") -> FastAPI:
    """The app; generation stops at the tokenizer's end-of-document id (`eod`) when it has one."""
    loop_thread, (encode, decode) = EngineLoop(engine), _codec(tokenizer)
    termination_id = getattr(tokenizer, "eod", None)

    @asynccontextmanager
    async def lifespan(app):
        loop_thread.start()
        yield
        loop_thread.stop()

    app = FastAPI(title="megalab inference server", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)  # unknown route (404), wrong method (405), ...
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(Exception)  # a bug of ours: still OpenAI's shape, and the server goes on
    async def server_error(request: Request, exc: Exception):
        traceback.print_exception(exc)
        return _error(500, f"internal error: {type(exc).__name__} (see the server log)", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active": len(engine.active), "waiting": len(engine.waiting),
                "paused": len(engine.paused)}  # out of KV blocks, resumed as blocks free up

    @app.post("/v1/completions")
    async def completions(http: Request):
        try:
            body = parse_completion_request(await http.body())
            if body.model not in (None, model_name):
                raise BadRequest(f"model {body.model!r} is not served here; this server serves {model_name!r}",
                                 404, "model_not_found")
            params = SamplingParams(temperature=body.temperature, top_k=body.top_k,
                                    top_p=0.0 if body.top_p == 1.0 else body.top_p,
                                    num_tokens_to_generate=body.max_tokens, seed=body.seed, termination_id=termination_id)
            prompt_tokens = encode(body.prompt)
            loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
            on_token = lambda request, token: loop.call_soon_threadsafe(  # runs in the engine thread
                tokens.put_nowait, (token, request.finish_reason))
            request = loop_thread.add_request(prompt_tokens, params, on_token)
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.kind)
        except ValueError as exc:  # the engine's own checks (prompt too long for the model, ...)
            return _error(400, str(exc))
        meta = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        text = _TextStream(decode, body.stop)

        async def next_piece():  # -> (text, finish_reason or None); a matched stop string ends the request
            token, finish = await tokens.get()
            piece, stopped = text.push(token, finish is not None)
            if stopped and finish is None:
                loop_thread.cancel(request, "stop")
                finish = "stop"
            return piece, finish

        def usage():
            n_prompt, n_out = len(prompt_tokens), len(request.generated_tokens)
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

        if body.stream:
            async def events():
                finish = None
                try:
                    while finish is None:
                        piece, finish = await next_piece()
                        if finish == "error":
                            yield f"data: {json.dumps(_failed(request))}\n\n"
                            break
                        choice = {"text": piece, "index": 0, "logprobs": None, "finish_reason": finish}
                        yield f"data: {json.dumps({**meta, 'choices': [choice]})}\n\n"
                    if body.stream_options and body.stream_options.include_usage:
                        yield f"data: {json.dumps({**meta, 'choices': [], 'usage': usage()})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client went away (or the server stops): stop generating for it
                    if finish is None:
                        loop_thread.cancel(request)
            return StreamingResponse(events(), media_type="text/event-stream")

        pieces, finish, checked = [], None, loop.time()
        try:
            while finish is None:
                try:
                    piece, finish = await asyncio.wait_for(next_piece(), timeout=DISCONNECT_POLL_S)
                    pieces.append(piece)
                except TimeoutError:
                    pass
                if finish is None and loop.time() - checked >= DISCONNECT_POLL_S:  # is the client still there?
                    checked = loop.time()
                    if await http.is_disconnected():
                        break
        finally:
            if finish is None:  # the client went away (or this handler was cancelled)
                loop_thread.cancel(request)
        if finish is None:
            return _error(499, "the client closed the connection", "client_closed")
        if finish == "error":
            return JSONResponse(status_code=500, content=_failed(request))
        return {**meta, "choices": [{"text": "".join(pieces), "index": 0, "logprobs": None, "finish_reason": finish}],
                "usage": usage()}

    return app


DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def _failed(request) -> dict:
    """The error body of a request the engine failed (alone: the others in its batch went on)."""
    return {"error": {"message": f"the engine failed while generating this request ({request.error}); "
                                 "other requests are unaffected (see the server log)",
                      "type": "server_error", "param": None, "code": None}}


def _free_port(host: str) -> int:
    """A port the OS says is free on `host` now (the server binds it right after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving an app in a background thread of this process; start() returns once it listens.

        with ServerThread(app) as server:   # 127.0.0.1, a free port
            httpx.get(server.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or _free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="megalab-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url} (port taken? see the log above)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------ a bounded loopback load test
@dataclass
class LoadTestResult:
    requests: int
    errors: int
    wall_s: float
    completion_tokens: int
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    latencies_s: list[float] = field(default_factory=list)  # every request's, in completion order
    ttfts_s: list[float] = field(default_factory=list)  # streamed: time to each request's first token

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    def summary(self) -> dict[str, float]:
        """The serving metrics: throughput, error rate, latency and (streamed) time-to-first-token percentiles."""
        row = {"requests/s": self.requests / self.wall_s, "tokens/s": self.tokens_per_s,
               "error rate": self.errors / self.requests}
        for name, xs in (("latency", self.latencies_s), ("TTFT", self.ttfts_s)):
            row.update({f"{name} p{q} (s)": _percentile(xs, q) for q in (50, 95, 99) if xs})
        return row


def _percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def load_test(url: str, prompts: list[str], concurrency: int = 64, requests_per_client: int = 1,
              max_tokens: int = 16, timeout: float = 120.0, stream: bool = False, **body) -> LoadTestResult:
    """`concurrency` clients send requests_per_client completions each, all at once (loopback only).

    stream=True asks for server-sent events and also times each request's first token (TTFT).
    """
    if not _is_loopback(httpx.URL(url).host):
        raise ValueError(f"load_test only targets this machine (127.0.0.1 / localhost), not {url!r}")
    if not 1 <= concurrency <= 256 or not 1 <= requests_per_client <= 100:
        raise ValueError("keep the load test bounded: 1..256 clients, 1..100 requests each")

    async def streamed(client: httpx.AsyncClient, payload: dict, start: float) -> tuple[int, float]:
        """(completion tokens, TTFT) of one streamed request: one event per token, then [DONE]. A stream
        whose last event reports an engine error, or that stops before [DONE], is a failed request."""
        tokens, ttft, done = 0, None, False
        async with client.stream("POST", "/v1/completions", json={**payload, "stream": True}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise httpx.HTTPError(f"the server failed this request: {event['error']['message']}")
                    if not event["choices"]:  # the usage event (stream_options.include_usage)
                        continue
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    tokens += 1
        if not done or ttft is None:
            raise httpx.HTTPError("the stream ended before its tokens and [DONE]")
        return tokens, ttft

    async def run() -> LoadTestResult:
        latencies, ttfts, counts = [], [], {"errors": 0, "tokens": 0}
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            async def one_client(i: int):
                for j in range(requests_per_client):
                    payload = {"prompt": prompts[(i * requests_per_client + j) % len(prompts)],
                               "max_tokens": max_tokens, **body}
                    start = time.perf_counter()
                    try:
                        if stream:
                            tokens, ttft = await streamed(client, payload, start)
                            ttfts.append(ttft)
                        else:
                            response = await client.post("/v1/completions", json=payload)
                            response.raise_for_status()
                            tokens = response.json()["usage"]["completion_tokens"]
                        counts["tokens"] += tokens
                    except httpx.HTTPError:
                        counts["errors"] += 1
                    latencies.append(time.perf_counter() - start)

            start = time.perf_counter()
            await asyncio.gather(*(one_client(i) for i in range(concurrency)))
            wall = time.perf_counter() - start
        return LoadTestResult(len(latencies), counts["errors"], wall, counts["tokens"],
                              _percentile(latencies, 50), _percentile(latencies, 90), _percentile(latencies, 99),
                              latencies, ttfts)

    with ThreadPoolExecutor(1) as pool:  # its own event loop, also inside Jupyter (whose loop is running)
        return pool.submit(asyncio.run, run()).result()
