"""The HTTP server end to end over loopback: OpenAI-style completions (whole and streamed) equal the
engine's own output, bad requests get clear 400s while the server keeps serving, and 64
concurrent clients get their answers without errors."""

import json

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from megalab.core.inference import InferenceEngine, PagedKVCache, SamplingParams
from megalab.core.inference.text_generation_server.text_generation_server import ServerThread, create_app, load_test
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteTokenizer
from megalab.core.transformer.transformer_config import TransformerConfig

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=96,
              hidden_dropout=0.0, attention_dropout=0.0)


def _engine():
    config = TransformerConfig(**CONFIG)
    torch.manual_seed(0)
    return InferenceEngine(GPTModel(config), PagedKVCache(config, 256, 8), max_batch_size=32, max_tokens=512)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(_engine(), ByteTokenizer(), model_name="tiny")) as s:
        yield s


def _expected(prompt, **params):
    tokenizer = ByteTokenizer()
    request = _engine().generate([tokenizer.encode(prompt)], SamplingParams(**params))[0]
    return tokenizer.decode(request.generated_tokens)


def test_binds_loopback_and_reports_health(server):
    assert server.host == "127.0.0.1"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    config = TransformerConfig(**CONFIG)  # an engine out of KV blocks: 3 requests, room for 2 to grow
    engine = InferenceEngine(GPTModel(config), PagedKVCache(config, 3, 4))
    for _ in range(3):
        engine.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=8))
    for _ in range(3):
        engine.step()
    health = TestClient(create_app(engine, ByteTokenizer())).get("/health").json()  # no lifespan: no engine thread
    assert (health["active"], health["waiting"], health["paused"]) == (1, 1, 1) == (
        len(engine.active), len(engine.waiting), len(engine.paused))


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, top_k=20, seed=7)])
def test_completion_equals_the_engine_output(server, sampling):
    body = {"model": "tiny", "prompt": "Hello, world", "max_tokens": 12, **sampling}
    reply = httpx.post(server.url + "/v1/completions", json=body).json()
    params = dict(temperature=sampling["temperature"], top_k=sampling.get("top_k", 0),
                  top_p=sampling.get("top_p", 0.0), seed=sampling.get("seed"), num_tokens_to_generate=12)
    assert reply["choices"][0]["text"] == _expected("Hello, world", **params)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24}


def test_streaming_sends_sse_chunks_then_done(server):
    body = {"prompt": "stream me", "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(chunks) == 10  # one event per generated token
    assert "".join(c["choices"][0]["text"] for c in chunks) == _expected(
        "stream me", temperature=0, num_tokens_to_generate=10)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "hi", ', "malformed JSON"),
    ('{"max_tokens": 4}', "prompt: Field required"),
    ('{"prompt": "hi", "temperature": -1}', "temperature"),
    ('{"prompt": "hi", "top_p": 1.5}', "top_p"),
    ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "hi", "top_k": "many"}', "top_k"),
    ('{"prompt": "' + "x" * 90 + '", "max_tokens": 10}', "exceeds the model's seq_length 96"),
])
def test_bad_requests_get_a_clear_400_and_the_server_keeps_serving(server, content, message):
    response = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unknown_model_is_a_404(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": "gpt-5", "prompt": "hi"})
    assert response.status_code == 404 and "tiny" in response.json()["error"]["message"]


def test_64_concurrent_clients_without_errors(server):
    result = load_test(server.url, ["a", "the cat", "Once upon a time", "x" * 20], concurrency=64, max_tokens=8,
                       temperature=0)
    assert result.requests == 64 and result.errors == 0 and result.completion_tokens == 64 * 8
    assert 0 < result.latency_p50_s <= result.latency_p90_s <= result.latency_p99_s <= result.wall_s
    assert httpx.get(server.url + "/health").json()["active"] == 0


def test_load_test_stays_on_this_machine():
    with pytest.raises(ValueError, match="127.0.0.1"):
        load_test("http://example.com:8000", ["hi"])
    with pytest.raises(ValueError, match="bounded"):
        load_test("http://127.0.0.1:1", ["hi"], concurrency=10_000)


def test_a_failing_engine_step_fails_only_its_requests():
    engine = _engine()
    step, calls = engine.step, []

    def flaky_step():  # the first forward blows up (say, out of memory), the next ones work
        calls.append(1)
        if len(calls) == 1:
            engine.cache.reserve(engine.waiting[0].request_id, 1)  # half-done work: a block is taken
            engine.active.append(engine.waiting.popleft())
            raise RuntimeError("simulated failure inside a step")
        return step()

    engine.step = flaky_step
    with ServerThread(create_app(engine, ByteTokenizer())) as s:
        failed = httpx.post(s.url + "/v1/completions", json={"prompt": "boom", "max_tokens": 4})
        assert failed.status_code == 500 and "engine failed" in failed.json()["error"]["message"]
        assert len(engine.cache.allocator.free_blocks) == 256  # its blocks came back
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 4}).status_code == 200


@pytest.mark.timeout(90)
def test_streamed_load_test_counts_engine_failures_as_errors():
    engine = _engine()
    step = engine.step

    def failing_step():  # every request fails once it is in a step
        if engine.waiting:
            engine.active.append(engine.waiting.popleft())
        raise RuntimeError("simulated failure inside a step")

    engine.step = failing_step
    with ServerThread(create_app(engine, ByteTokenizer())) as s:
        result = load_test(s.url, ["a", "b"], concurrency=4, max_tokens=4, stream=True, timeout=20)
        assert result.requests == 4 and result.errors == 4 and result.completion_tokens == 0
        assert result.ttfts_s == []
        engine.step = step  # the failures (before any cache block was taken) left the server serving
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 4}, timeout=20)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
