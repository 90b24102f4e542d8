"""Chapter 07 projects 1 and 4: the resume check rejects any curve that does not continue the reference,
a tp2·pp2 training checkpoint becomes one GPTModel with the trained model's logits, and the load test
times first tokens of streamed requests and counts every failure."""

import dataclasses
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalab.core.inference import InferenceEngine, PagedKVCache
from megalab.core.inference.text_generation_server.text_generation_server import ServerThread, create_app, load_test
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteTokenizer
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras import projects
from megalab.lab import launch
from megalab.lab.checks import mistake, wrong
from megalab.training.checkpointing import TRACKER, CheckpointError, checkpoint_dir
from tests.feedback import close, require

REFERENCE = [(1, 9.01), (2, 8.9), (3, 8.7), (4, 8.41), (5, 8.3), (6, 8.2)]


def _continues(reference, resumed, rtol=0.0, *, by_iteration=True, tail_in_order=True, relative=True,
               inclusive=True):
    """curves_match's rule, or what one typical mistake (the keyword flags) answers."""
    if not resumed:
        return False
    losses = dict(reference)
    if not by_iteration:  # the losses against the reference's last ones, iterations unread
        if len(resumed) > len(reference):
            return False
        pairs = [(loss, ref) for (_, loss), (_, ref) in zip(resumed, reference[-len(resumed):])]
    else:
        iterations = [it for it, _ in resumed]
        if iterations != sorted(losses)[-len(resumed):] if tail_in_order else any(it not in losses for it in iterations):
            return False
        pairs = [(loss, losses[it]) for it, loss in resumed]
    tolerance = (lambda ref: rtol * abs(ref)) if relative else (lambda ref: rtol)
    return all(abs(loss - ref) <= tolerance(ref) if inclusive else abs(loss - ref) < tolerance(ref) for loss, ref in pairs)


@pytest.mark.exercise("projects.curves_match")
def test_curves_match_names_the_mistake():
    tail = REFERENCE[3:]
    cases = [  # (reference, resumed, rtol, what), the right answer from the docstring's rule
        (REFERENCE, tail, 0.0, "the exact tail"), (REFERENCE, REFERENCE, 0.0, "the whole reference"),
        (REFERENCE, [(it, loss + 1e-12) for it, loss in tail], 0.0, "the tail + 1e-12, rtol=0"),
        (REFERENCE, [(it, loss + 5e-9) for it, loss in tail], 1e-9, "the tail + 5e-9, rtol=1e-9 (relative: 8e-9)"),
        (REFERENCE, [(it, loss * 1.001) for it, loss in tail], 1e-5, "the tail x 1.001, rtol=1e-5"),
        (REFERENCE, [], 0.0, "nothing"), (REFERENCE, REFERENCE[3:5], 0.0, "a tail stopping early"),
        (REFERENCE, [REFERENCE[3], REFERENCE[5]], 0.0, "a tail missing an iteration"),
        (REFERENCE, [REFERENCE[4], REFERENCE[3], REFERENCE[5]], 0.0, "a tail out of order"),
        (REFERENCE, [(1, 8.41), (2, 8.3), (3, 8.2)], 0.0, "the tail's losses under iterations 1, 2, 3"),
        (REFERENCE[:4], tail, 0.0, "a tail running past the reference"),
    ]
    got = [int(projects.curves_match(ref, resumed, rtol=rtol)) for ref, resumed, rtol, _ in cases]

    def answers(**mistake):
        return [int(_continues(ref, resumed, rtol, **mistake)) for ref, resumed, rtol, _ in cases]

    expected = answers()
    verdict = close(got, expected, "curves_match's answers (1 True, 0 False) for: " + "; ".join(c[3] for c in cases),
                  mistakes={
                      "compared the losses with the reference's last ones but never checked the iterations":
                          answers(by_iteration=False),
                      "accepted any iterations the reference has (they must be its tail, in order, none missing)":
                          answers(tail_in_order=False),
                      "used rtol as an absolute tolerance (it is relative: |loss - ref| <= rtol * |ref|)":
                          answers(relative=False),
                      "compared with < instead of <= (rtol=0 must accept identical losses)": answers(inclusive=False),
                  })
    if not verdict and not verdict.reason.startswith("likely mistake"):  # no typical mistake: which answers differ
        said = [f"{'True' if g else 'False'} for {c[3]!r} (expected {'True' if e else 'False'})"
                for g, e, c in zip(got, expected, cases) if g != e]
        verdict = wrong(f"curves_match answered {'; '.join(said)} — {verdict.reason}")
    require(verdict)


@pytest.mark.exercise("projects.curves_match")
def test_curves_match_accepts_the_exact_continuation_only():
    def expect(answer, resumed, why, **kw):
        got = projects.curves_match(REFERENCE, resumed, **kw)
        assert got == answer, (
            f"curves_match(reference iterations {REFERENCE[0][0]}..{REFERENCE[-1][0]}, {why}"
            f"{''.join(f', {k}={v}' for k, v in kw.items())}) is {got}, expected {answer}")

    expect(True, REFERENCE[3:], "the exact tail from its 4th iteration")
    expect(True, REFERENCE, "the whole reference (a resume from iteration 0)")
    nudged = [(it, loss + 1e-12) for it, loss in REFERENCE[3:]]
    expect(False, nudged, "the tail with every loss + 1e-12 (rtol=0 means bit for bit)")
    expect(True, nudged, "the tail with every loss + 1e-12", rtol=1e-9)
    expect(False, [(it, loss * 1.001) for it, loss in REFERENCE[3:]], "the tail with every loss x 1.001", rtol=1e-5)


@pytest.mark.exercise("projects.curves_match")
def test_curves_match_rejects_wrong_iterations():
    for reference, resumed, why in [
        (REFERENCE, [], "an empty resumed curve (nothing resumed proves nothing)"),
        (REFERENCE, REFERENCE[3:5], "a resumed curve that stops before the reference's end"),
        (REFERENCE, [REFERENCE[3], REFERENCE[5]], "a resumed curve with an iteration missing"),
        (REFERENCE, [REFERENCE[4], REFERENCE[3], REFERENCE[5]], "a resumed curve out of order"),
        (REFERENCE, [(1, 8.41), (2, 8.3), (3, 8.2)], "the right losses under a restarted iteration count"),
        (REFERENCE[:4], REFERENCE[3:], "a resumed curve that runs past the reference"),
    ]:
        got = projects.curves_match(reference, resumed)
        assert not got, f"curves_match accepts {why}: {resumed[:3]}{' ...' if len(resumed) > 3 else ''}; expected False"


def test_curves_match_rejects_a_negative_tolerance():
    with pytest.raises(ValueError, match="rtol"):
        projects.curves_match(REFERENCE, REFERENCE, rtol=-1)


def _train_and_reference_logits(root: str, tokens: torch.Tensor):
    """4 ranks: 3 iterations at tp2·pp2 saving at 3; then load that checkpoint at tp2 (dp2) with the training
    code's own loader and return the TP model's logits for `tokens` (gathered over the vocab)."""
    from megalab.core import parallel_state
    from megalab.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megalab.lab import dist as mdist
    from megalab.training import checkpointing as ckpt
    from megalab.training.training import pretrain, setup_model_and_optimizer

    mdist.init()
    dataset, tokenizer = projects.build_dataset()
    pretrain(projects.recipe(tokenizer.vocab_size, train_iters=3, save=root, save_interval=3), dataset, on_log=None)
    state = setup_model_and_optimizer(projects.recipe(tokenizer.vocab_size, tp=2, pp=1, train_iters=3))
    try:
        ckpt.load_checkpoint(root, state.model, state.params, state.optimizer, state.scheduler,
                             state.ps.get_tensor_model_parallel_group())
        with torch.no_grad():  # the model's logits are vocab-parallel [b, s, V/t] (as Megatron's): gather them
            logits = state.model.eval()(tokens)
            return gather_from_tensor_model_parallel_region(logits, state.ps.get_tensor_model_parallel_group())
    finally:
        parallel_state.destroy_model_parallel()


def _write_tp1_checkpoint(root: Path, model: GPTModel, iteration: int = 3) -> None:
    """A training checkpoint of `model` in the layout save_checkpoint writes (model.<name> tensors at full shape,
    common.pt with the model config, the tracker), written by one process without a process group."""
    path = checkpoint_dir(root, iteration)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({f"model.{name}": p.detach() for name, p in model.named_parameters()}, checkpoint_id=path, no_dist=True)
    torch.save({"iteration": iteration, "model_config": dataclasses.asdict(model.config)}, path / "common.pt")
    (root / TRACKER).write_text(str(iteration))


@pytest.mark.exercise("projects.load_inference_model")
def test_load_inference_model_loads_every_parameter_and_names_the_mistake(tmp_path):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                               share_embeddings_and_output_weights=False)
    torch.manual_seed(1)
    trained = GPTModel(config)
    with torch.no_grad():  # "trained": every parameter moved off its initial value (biases 0, norms 1 included)
        for p in trained.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    _write_tp1_checkpoint(tmp_path, trained)
    torch.manual_seed(2)  # the model load_inference_model builds starts from other weights
    try:
        model, failed = projects.load_inference_model(tmp_path), None
    except CheckpointError as e:
        model, failed = None, str(e)
    if failed is not None:  # said outside the handler: the grader shows the first error of a traceback
        lacked = re.search(r"lacks '([^']+)'", failed)
        if lacked and lacked[1] in dict(trained.named_parameters()):
            require(mistake("asked the checkpoint for the parameter's own name; it stores each one as model.<name>",
                            f"read_state found no '{lacked[1]}' (the checkpoint holds 'model.{lacked[1]}')"))
        raise AssertionError(f"load_inference_model raised CheckpointError: {failed}")
    assert isinstance(model, GPTModel), f"load_inference_model returned a {type(model).__name__}, not a GPTModel"
    saved = dict(trained.named_parameters())
    names = list(saved)
    loaded = [int(torch.equal(p.detach(), saved[name].detach())) for name, p in model.named_parameters()]
    missing = [name for name, ok in zip(names, loaded) if not ok]
    what = (f"which of the {len(names)} parameters hold the checkpoint's values (1: loaded, in named_parameters order; "
            f"not loaded: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    require(close(loaded, [1] * len(names), what, mistakes={
        "read the checkpoint but never copied its tensors into the model's parameters": [0] * len(names),
        "copied only the weights (biases and norm parameters stay freshly initialized)":
            [int(name.endswith("weight")) for name in names],
        "loaded only the transformer layers (the embeddings and the output layer stay freshly initialized)":
            [int(name.startswith("decoder.")) for name in names],
    }))


@pytest.mark.integration
@pytest.mark.exercise("projects.load_inference_model")
def test_a_tp2_pp2_checkpoint_becomes_one_model_with_the_trained_logits():
    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    root = tempfile.mkdtemp(prefix="megalab-test-projects-")
    try:
        expected = launch.run_function(_train_and_reference_logits, 4, root, tokens,
                                       launch=dict(timeout=300)).returns[0]
        model = projects.load_inference_model(root)
        assert isinstance(model, GPTModel), f"load_inference_model returned a {type(model).__name__}, not a GPTModel"
        assert not model.training, "load_inference_model returned a model in training mode: call .eval()"
        with torch.no_grad():
            require(close(model(tokens), expected, "the logits of the model load_inference_model built from a tp2-pp2 "
                                                   "checkpoint vs the training code's tp2 model loaded from it",
                          rtol=1e-5, atol=1e-5))
        untrained = GPTModel(model.config)
        assert not torch.allclose(untrained.output_layer.weight, model.output_layer.weight), (  # weights really loaded
            "the loaded model's output layer equals a freshly initialized one: the checkpoint's weights were not copied in")
        for shard in Path(root).glob("iter_*/*.distcp"):  # the files cut short (a full disk, a copy interrupted)
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])
        with pytest.raises(CheckpointError, match=r"iter_0000003/__\d_0\.distcp is truncated"):
            projects.load_inference_model(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_load_inference_model_says_what_to_do_without_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="project 1"):
        projects.load_inference_model(tmp_path)
    with pytest.raises(CheckpointError, match="incomplete"):
        (tmp_path / "iter_0000012").mkdir()
        projects.load_inference_model(tmp_path, iteration=12)


@pytest.fixture(scope="module")
def server():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=96,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    engine = InferenceEngine(GPTModel(config), PagedKVCache(config, 256, 8), max_batch_size=32, max_tokens=512)
    with ServerThread(create_app(engine, ByteTokenizer(), model_name="tiny")) as s:
        yield s


def test_streamed_load_test_times_the_first_token(server):
    prompts = ["a", "the cat", "Once upon a time"]
    plain = load_test(server.url, prompts, concurrency=12, max_tokens=6, temperature=0)
    result = load_test(server.url, prompts, concurrency=12, max_tokens=6, temperature=0, stream=True)
    assert result.requests == 12 and result.errors == 0 and result.completion_tokens == plain.completion_tokens == 72
    assert len(result.ttfts_s) == len(result.latencies_s) == 12 and plain.ttfts_s == []
    assert all(0 < t <= lat for t, lat in zip(sorted(result.ttfts_s), sorted(result.latencies_s)))
    row = result.summary()
    assert row["error rate"] == 0 and row["tokens/s"] == pytest.approx(72 / result.wall_s)
    assert row["latency p50 (s)"] <= row["latency p95 (s)"] <= row["latency p99 (s)"] <= max(result.latencies_s)
    assert row["TTFT p50 (s)"] <= row["TTFT p99 (s)"] and "TTFT p50 (s)" not in plain.summary()


def test_load_test_counts_rejected_requests_as_errors(server):
    for stream in (False, True):
        result = load_test(server.url, ["hi"], concurrency=4, max_tokens=200, stream=stream)  # > seq_length: 400
        assert result.errors == result.requests == 4 and result.completion_tokens == 0
        assert result.summary()["error rate"] == 1.0


def test_bad_requests_get_clear_4xx_replies(server):
    replies = projects.bad_request_replies(server.url)
    assert set(replies) == set(projects.BAD_REQUESTS)
    assert all(400 <= status < 500 and message for status, message in replies.values()), replies
    assert replies["unknown model"][0] == 404 and "tiny" in replies["unknown model"][1]
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_trained_checkpoint_trains_only_when_project_1_is_missing(tmp_path, monkeypatch):
    """Missing: the recipe trains in this run's own scratch folder, which is then published whole (one rename);
    complete: nothing is trained."""
    calls, trained = [], tmp_path / "trained"
    curve = [(1, 9.010609388351440), (2, 0.1 + 0.2)]

    def fake_training(fn, n, run, **kw):
        calls.append((fn, n))
        Path(run).mkdir(parents=True)
        (Path(run) / "latest_checkpointed_iteration.txt").write_text(str(projects.TRAIN_ITERS))
        projects.save_curve(run, curve)

    monkeypatch.setattr(launch, "run_function", fake_training)
    assert projects.trained_checkpoint(trained) == trained
    assert calls == [(projects.train_reference, 8)]  # nothing there: train the recipe on 8 ranks
    assert projects.load_curve(trained) == curve  # published, floats bit for bit
    projects.trained_checkpoint(trained)
    assert len(calls) == 1  # complete: no new training
    with pytest.raises(CheckpointError, match="not a finished reference run"):
        projects.publish_trained(tmp_path / "empty", trained)
