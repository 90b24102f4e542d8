"""An HTTP server for the engine: OpenAI-style POST /v1/completions, streamed or not, on FastAPI + uvicorn.

    clients ──HTTP──> uvicorn (asyncio event loop) ──add_request──> EngineLoop thread
            <──JSON or SSE "data: {...}" chunks, then "data: [DONE]"──  on_token callbacks
                                                                         (call_soon_threadsafe)

The event loop only parses, validates and waits; one background thread runs engine.step()
whenever requests are in flight, so every connected client shares the continuous batch.
Bad requests (malformed JSON, wrong types, out-of-range sampling values, prompts too long for
the model) get a 400 with an OpenAI-style {"error": {"message", "type"}} body; the server keeps
serving. It binds 127.0.0.1 unless told otherwise. Megatron serves with a Flask text-generation
server (megatron/inference/text_generation_server.py) and an OpenAI-compatible endpoint in
megatron/core/inference/text_generation_server/endpoints/completions.py.
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
from pydantic import BaseModel, ConfigDict, Field

from megalab.core.inference.engines.dynamic_engine import InferenceEngine
from megalab.core.inference.sampling_params import SamplingParams


class CompletionRequest(BaseModel):
    """The common OpenAI /v1/completions body (fields it does not know are ignored)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    seed: int | None = None


class EngineLoop:
    """Runs engine.step() in one background thread while requests are in flight."""

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
            self.lock.notify()
        self.thread.join()

    def add_request(self, *args, **kwargs):
        with self.lock:  # raises ValueError on a request the engine cannot take
            request = self.engine.add_request(*args, **kwargs)
            self.lock.notify()
            return request

    def _run(self) -> None:
        while True:
            with self.lock:
                while self.running and not self.engine.has_unfinished_requests():
                    self.lock.wait()
                if not self.running:
                    return
                try:
                    self.engine.step()
                except Exception:  # fail the requests in flight, keep serving
                    traceback.print_exc()
                    self.engine.abort_all("error")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


def _codec(tokenizer):
    """(encode, decode) of a tokenizer with encode/decode, or Megatron's tokenize/detokenize (chapter 05's)."""
    if hasattr(tokenizer, "tokenize"):
        return tokenizer.tokenize, tokenizer.detokenize
    return tokenizer.encode, tokenizer.decode


class _Detokenizer:
    """Text of the tokens so far, handed out in pieces; holds back a cut multi-byte character."""

    def __init__(self, decode):
        self.decode, self.tokens, self.sent = decode, [], 0

    def push(self, token: int | None, final: bool) -> str:
        if token is not None:
            self.tokens.append(token)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd") and not final:
            return ""
        piece, self.sent = text[self.sent:], len(text)
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

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors():
            if e["type"] == "json_invalid":
                problems.append(f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}")
            else:
                where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
                problems.append(f"{where}: {e['msg']}")
        return _error(400, "; ".join(problems))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active": len(engine.active), "waiting": len(engine.waiting)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model not in (None, model_name):
            return _error(404, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                          "model_not_found")
        try:
            params = SamplingParams(temperature=body.temperature, top_k=body.top_k,
                                    top_p=0.0 if body.top_p == 1.0 else body.top_p,
                                    num_tokens_to_generate=body.max_tokens, seed=body.seed, termination_id=termination_id)
            prompt_tokens = encode(body.prompt)
            loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
            on_token = lambda request, token: loop.call_soon_threadsafe(  # runs in the engine thread
                tokens.put_nowait, (token, request.finish_reason, request))
            loop_thread.add_request(prompt_tokens, params, on_token)
        except ValueError as exc:
            return _error(400, str(exc))
        meta = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        detok = _Detokenizer(decode)

        async def next_piece():  # -> (text, finish_reason or None, request)
            token, finish, request = await tokens.get()
            return detok.push(token, finish is not None), finish, request

        if body.stream:
            async def events():
                finish = None
                while finish is None:
                    piece, finish, request = await next_piece()
                    choice = {"text": piece, "index": 0, "logprobs": None, "finish_reason": finish}
                    yield f"data: {json.dumps({**meta, 'choices': [choice]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        text, finish = [], None
        while finish is None:
            piece, finish, request = await next_piece()
            text.append(piece)
        if finish == "error":
            return _error(500, "the engine failed while generating this request (see the server log)", "server_error")
        n_prompt, n_out = len(prompt_tokens), len(request.generated_tokens)
        return {**meta, "choices": [{"text": "".join(text), "index": 0, "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    return app


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
                    if json.loads(line[6:])["choices"][0]["finish_reason"] == "error":
                        raise httpx.HTTPError("the engine failed while streaming this request")
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
