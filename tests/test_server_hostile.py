"""The server under hostile input: every bad request gets OpenAI's error shape naming what is wrong,
a request the engine fails is failed alone (the others in its batch produce the tokens they would
have produced alone), a client that goes away has its request cancelled, and afterwards threads,
file descriptors and KV-cache blocks are back where they started."""

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
import torch

from megalab.core.inference import InferenceEngine, PagedKVCache, SamplingParams
from megalab.core.inference.sampling_params import make_generator, sample
from megalab.core.inference.text_generation_server.text_generation_server import (
    MAX_BODY_BYTES,
    ServerThread,
    _TextStream,
    create_app,
)
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteTokenizer
from megalab.core.transformer.transformer_config import TransformerConfig

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=96,
              hidden_dropout=0.0, attention_dropout=0.0)
BLOCKS = 32  # 256 tokens: the concurrent requests below outgrow it, so the engine pauses some (timing decides which)
RAISES, NANS = 7, 8  # byte tokens "\a" and "\b": the model raises on the first, gives NaN for the second


def _engine(poisoned: bool = True) -> InferenceEngine:
    config = TransformerConfig(**CONFIG)
    torch.manual_seed(0)
    model = GPTModel(config)
    output = model.output
    model.output = lambda hidden: output(hidden).index_fill(-1, torch.tensor([RAISES, NANS]), float("-inf"))
    if poisoned:  # the model never generates the poison tokens: only a prompt carries them
        def poison(module, inputs, output):  # only the poisoned request's rows are touched
            time.sleep(0.01)  # and a step takes at least 10 ms: a client can go away mid-generation
            ids = inputs[0]
            if (ids == RAISES).any():
                raise RuntimeError("poisoned token")
            return output.masked_fill((ids == NANS)[..., None], float("nan"))
        model.embedding.word_embeddings.register_forward_hook(poison)
    cache = PagedKVCache(config, BLOCKS, 8, enable_prefix_caching=True)  # LRU: released prompt blocks stay cached
    return InferenceEngine(model, cache, max_batch_size=64, max_tokens=2048)


def _alone(prompt: str, **params) -> str:
    """What the request produces on its own, in a fresh engine."""
    tokenizer = ByteTokenizer()
    request = _engine(poisoned=False).generate([tokenizer.encode(prompt)], SamplingParams(**params))[0]
    return tokenizer.decode(request.generated_tokens)


def test_a_request_that_fails_is_failed_alone_in_its_batch():
    engine, tokenizer = _engine(), ByteTokenizer()
    good = [("The cat", dict(temperature=0)), ("Once upon", dict(temperature=0.9, top_k=30, seed=3)),
            ("x", dict(temperature=0.7, top_p=0.8, seed=11))]
    requests = [engine.add_request(tokenizer.encode(p), SamplingParams(num_tokens_to_generate=12, **kw))
                for p, kw in good[:2]]
    engine.step()  # the first two are decoding when the poisoned ones arrive
    raising = engine.add_request(tokenizer.encode("bad\a"), SamplingParams(num_tokens_to_generate=12))
    nan = engine.add_request(tokenizer.encode("nan\b"), SamplingParams(num_tokens_to_generate=12, temperature=0))
    requests.append(engine.add_request(tokenizer.encode(good[2][0]), SamplingParams(num_tokens_to_generate=12,
                                                                                 **good[2][1])))
    while engine.has_unfinished_requests():
        engine.step()
    assert raising.finish_reason == "error" and "poisoned token" in raising.error
    assert nan.finish_reason == "error" and "NaN" in nan.error
    for (prompt, kw), request in zip(good, requests):
        assert request.finish_reason == "length"
        assert tokenizer.decode(request.generated_tokens) == _alone(prompt, num_tokens_to_generate=12, **kw)
    assert engine.cache.allocator.get_referenced_count() == 0 and not engine.active and not engine.paused


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-8, 0.5, 2.0, 1e300])
@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (5, 0.0), (0, 1e-300), (10**6, 0.999)])
def test_sampling_never_produces_nan_for_accepted_parameters(temperature, top_k, top_p):
    logits = torch.randn(256) * 30
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    token = sample(logits, params, make_generator(params))
    assert 0 <= token < 256
    if temperature < 1e-8 or (top_p == 1e-300 and temperature <= 2):  # the limit is greedy
        assert token == int(logits.argmax())


@pytest.mark.parametrize("bad", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                 dict(top_k=True), dict(seed=2**64), dict(seed=-1), dict(top_p=float("nan"))])
def test_sampling_params_refuse_what_cannot_be_sampled(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_text_stream_holds_back_a_possible_stop_string_and_ends_at_one():
    stream, out = _TextStream(lambda tokens: bytes(tokens).decode("utf-8", "replace"), ["END", "\n\n"]), []
    for ch in b"ab E":
        out.append(stream.push(ch, False))
    assert out == [("a", False), ("ab"[1:], False), (" ", False), ("", False)]  # "E" may start "END"
    assert stream.push(ord("x"), False) == ("Ex", False)  # it did not
    assert stream.push(ord("\n"), False) == ("", False)
    assert stream.push(ord("\n"), False) == ("", True)  # the stop string is not sent
    multibyte = _TextStream(lambda tokens: bytes(tokens).decode("utf-8", "replace"))
    assert multibyte.push(0xC3, False) == ("", False) and multibyte.push(0xA9, False) == ("é", False)


# ------------------------------------------------------------------ ≥ 40 hostile requests, good ones beside
HOSTILE = [  # (name, method, path, body bytes, expected status, words the error message must contain)
    ("truncated JSON", "POST", "/v1/completions", b'{"prompt": "hi", ', 400, "malformed JSON"),
    ("not UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not UTF-8"),
    ("empty body", "POST", "/v1/completions", b"", 400, "malformed JSON"),
    ("array body", "POST", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("string body", "POST", "/v1/completions", b'"hi"', 400, "JSON object"),
    ("null body", "POST", "/v1/completions", b"null", 400, "JSON object"),
    ("NaN literal", "POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "NaN"),
    ("Infinity literal", "POST", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, "Infinity"),
    ("nested 100k deep", "POST", "/v1/completions", b"[" * 100_000, 400, "nested too deeply"),
    ("body over 1 MiB", "POST", "/v1/completions",
     json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode(), 413, "limit"),
    ("max_tokens true", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ('max_tokens "3"', "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("max_tokens 1.5", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens 0", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -1", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 1e30", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_tokens > model", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 200}, 400, "seq_length 96"),
    ('temperature "1"', "POST", "/v1/completions", {"prompt": "hi", "temperature": "1"}, 400, "temperature"),
    ("temperature -1", "POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("temperature 3", "POST", "/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ("temperature true", "POST", "/v1/completions", {"prompt": "hi", "temperature": True}, 400, "temperature"),
    ("top_p 0", "POST", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p 1.5", "POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k -1", "POST", "/v1/completions", {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("top_k 2.5", "POST", "/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("stream 1", "POST", "/v1/completions", {"prompt": "hi", "stream": 1}, 400, "stream"),
    ('stream "true"', "POST", "/v1/completions", {"prompt": "hi", "stream": "true"}, 400, "stream"),
    ("stream_options alone", "POST", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("seed 2**70", "POST", "/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("seed -1", "POST", "/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ('seed "7"', "POST", "/v1/completions", {"prompt": "hi", "seed": "7"}, 400, "seed"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("number prompt", "POST", "/v1/completions", {"prompt": 123}, 400, "prompt"),
    ("list prompt", "POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("null prompt", "POST", "/v1/completions", {"prompt": None}, 400, "prompt"),
    ("no prompt", "POST", "/v1/completions", {"max_tokens": 4}, 400, "prompt: Field required"),
    ("prompt too long", "POST", "/v1/completions", {"prompt": "x" * 90, "max_tokens": 10}, 400, "seq_length 96"),
    ("n 2", "POST", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n=2 is not supported"),
    ("best_of 3", "POST", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("echo", "POST", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("logprobs 5", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 5}, 400, "logprobs"),
    ("logit_bias", "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"1": 5.0}}, 400, "logit_bias"),
    ("presence_penalty", "POST", "/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400,
     "presence_penalty"),
    ("unknown field", "POST", "/v1/completions", {"prompt": "hi", "foo": 1}, 400, "foo: unknown field"),
    ("5 stop strings", "POST", "/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, "stop"),
    ("empty stop string", "POST", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("number stop", "POST", "/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("another model", "POST", "/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404, "serves 'tiny'"),
    ("GET completions", "GET", "/v1/completions", None, 405, "Method Not Allowed"),
    ("unknown route", "POST", "/v1/nope", {"prompt": "hi"}, 404, "Not Found"),
    ("model raises", "POST", "/v1/completions", {"prompt": "boom\a", "max_tokens": 8}, 500, "poisoned token"),
    ("model gives NaN", "POST", "/v1/completions", {"prompt": "nan\b", "max_tokens": 8, "temperature": 0.5}, 500,
     "NaN"),
]
GOOD = [("The cat sat", dict(temperature=0)), ("Once upon a time", dict(temperature=0.8, top_k=20, seed=5)),
        ("Hello", dict(temperature=0.6, top_p=0.9, seed=9)), ("a", dict(temperature=0))]


def _census(engine) -> dict:
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "held KV blocks": engine.cache.allocator.get_referenced_count(),  # cached prefixes are held by nobody
            "in flight": len(engine.active) + len(engine.paused) + len(engine.waiting)}


def _leaks(engine, baseline: dict, timeout: float = 10.0) -> dict:
    """What is still above its baseline once the server has settled: threads and fds may only go down (a
    keep-alive socket of the warm-up request can close meanwhile), KV blocks and requests must be back exactly."""
    deadline = time.monotonic() + timeout
    while True:
        now = _census(engine)
        leaks = {k: (baseline[k], now[k]) for k in now
                 if (now[k] > baseline[k] if k in ("threads", "fds") else now[k] != baseline[k])}
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_hostile_requests_beside_good_ones():
    engine, cancelled = _engine(), []
    cancel = engine.cancel

    def spy(request, reason="cancelled"):  # which requests the server cancelled, and how far they had got
        if reason == "cancelled" and request.finish_reason is None:
            cancelled.append((bytes(request.prompt_tokens).decode(), len(request.generated_tokens)))
        cancel(request, reason)

    engine.cancel = spy
    expected = {prompt: _alone(prompt, num_tokens_to_generate=24, **kw) for prompt, kw in GOOD}
    with ServerThread(create_app(engine, ByteTokenizer(), model_name="tiny")) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2},
                   headers={"connection": "close"})  # no keep-alive socket left in the baseline
        time.sleep(0.2)
        baseline = _census(engine)

        async def hostile(client, name, method, path, body, status, words):
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            response = await client.request(method, path, content=content,
                                            headers={"content-type": "application/json"})
            error = response.json()["error"]
            assert (response.status_code, set(error)) == (status, {"message", "type", "param", "code"}), name
            assert words in error["message"], (name, error["message"])

        async def good(client, prompt, kw, stream):
            body = {"prompt": prompt, "max_tokens": 24, **kw}
            if not stream:
                reply = (await client.post("/v1/completions", json=body)).json()
                assert "choices" in reply and reply["choices"][0]["text"] == expected[prompt], (prompt, reply)
                return
            text = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "error" not in event, (prompt, event)
                        text.append(event["choices"][0]["text"])
            assert "".join(text) == expected[prompt], prompt

        async def goes_away_mid_stream(client):
            body = {"prompt": "long", "max_tokens": 90, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one token, then the client is gone

        async def goes_away_waiting(client):
            with pytest.raises(httpx.ReadTimeout):  # a non-streamed request the client stops waiting for
                await client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 90}, timeout=0.3)

        async def streamed_failure(client):
            body = {"prompt": "s\a", "max_tokens": 8, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert "poisoned token" in json.loads(events[0][6:])["error"]["message"] and events[-1] == "data: [DONE]"

        async def stop_string(client):
            prompt, kw = GOOD[0]
            stop = expected[prompt][5:7]
            reply = (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "stop": stop,
                                                                  **kw})).json()["choices"][0]
            assert reply == {**reply, "text": expected[prompt][:expected[prompt].index(stop)], "finish_reason": "stop"}

        async def tiny_temperature_is_greedy(client):
            reply = (await client.post("/v1/completions", json={"prompt": "The cat sat", "max_tokens": 24,
                                                                  "temperature": 1e-45})).json()
            assert reply["choices"][0]["text"] == expected["The cat sat"]

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                await asyncio.gather(
                    *(hostile(client, *case) for case in HOSTILE),
                    *(good(client, prompt, kw, stream) for prompt, kw in GOOD for stream in (False, True)),
                    goes_away_mid_stream(client), goes_away_waiting(client), streamed_failure(client),
                    stop_string(client), tiny_temperature_is_greedy(client))

        asyncio.run(run())
        assert len(HOSTILE) + 3 >= 40
        assert sorted(prompt for prompt, _ in cancelled) == ["long", "slow"], cancelled
        assert all(n < 90 for _, n in cancelled), cancelled  # both were stopped early
        assert not _leaks(engine, baseline), (_leaks(engine, baseline, timeout=0), engine.pause_count)
        assert baseline["held KV blocks"] == 0 and len(engine.cache.allocator.free_blocks) + \
            engine.cache.allocator.get_evictable_block_count() == BLOCKS  # full-free: every block free or cached
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 24, "temperature": 0}
                          ).json()["choices"][0]["text"] == expected["a"]  # still serving, same answers
