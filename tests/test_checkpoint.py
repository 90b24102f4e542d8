"""Checkpoints: a rank killed mid-save leaves the last good checkpoint loadable; corrupt or
mismatched checkpoints fail with a clear error. (Bit-exact and resharded resume: test_training.py.)

Two 2-rank launches (tp2): the first trains 4 iterations saving every 2, and rank 1 dies
(os._exit) while writing iteration 4's shards; the second resumes from what is on disk and
tries the broken variants.
"""

import builtins
import io
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from megalab.lab import launch
from megalab.lab.checks import mistake, require
from megalab.training import checkpointing as ckpt
from tests.test_training import dataset, reference_run, training_config


def _crash_worker(root: str):
    import os

    import torch.distributed.checkpoint as dcp

    from megalab.lab import dist as mdist
    from megalab.training.training import pretrain

    rank, _ = mdist.init()
    write_data = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # rank 1 writes its iteration-4 shard, then dies before the commit
        future = write_data(self, plan, planner)
        if rank == 1 and "iter_0000004" in str(self.path):
            future.wait()
            os._exit(1)
        return future

    dcp.FileSystemWriter.write_data = write_then_die
    pretrain(training_config(tensor_model_parallel_size=2, save=f"{root}/ckpt", save_interval=2), dataset(), None)


def _try(fn):
    try:
        fn()
        return "no error"
    except ckpt.CheckpointError as e:
        return str(e)


def _resume_worker(root: str):
    from megalab.core import parallel_state
    from megalab.lab import dist as mdist
    from megalab.training.training import pretrain, setup_model_and_optimizer

    mdist.init()
    out = {"resumed": [(r["iteration"], r["loss"]) for r in pretrain(
        training_config(tensor_model_parallel_size=2, load=f"{root}/ckpt", exit_interval=3), dataset(), None)]}

    def load(config, directory, iteration=None):
        state = setup_model_and_optimizer(config)
        try:
            ckpt.load_checkpoint(directory, state.model, state.params, state.optimizer, state.scheduler,
                                 state.ps.get_tensor_model_parallel_group(), iteration)
        finally:
            parallel_state.destroy_model_parallel()

    good = training_config(tensor_model_parallel_size=2)
    bigger = training_config(tensor_model_parallel_size=2)
    bigger.model.hidden_size, bigger.model.ffn_hidden_size = 64, 256
    out["mismatch"] = _try(lambda: load(bigger, f"{root}/ckpt"))
    out["partial"] = _try(lambda: load(good, f"{root}/ckpt", 4))
    out["empty"] = _try(lambda: load(good, f"{root}/nothing"))
    for name in DAMAGE:
        out[name] = _try(lambda name=name: load(good, f"{root}/{name}"))
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(launch.RankFailedError):  # rank 1 died; rank 0 lost its peer
            launch.run_function(_crash_worker, 2, root, launch=dict(timeout=300))
        save_dir = Path(root) / "ckpt"
        on_disk = sorted(p.name for p in save_dir.iterdir())
        tracker = ckpt.read_tracker(save_dir)
        good = ckpt.checkpoint_dir(save_dir, 2)
        for name, damage in DAMAGE.items():
            shutil.copytree(good, Path(root) / name / good.name)
            (Path(root) / name / ckpt.TRACKER).write_text("2")
            damage(Path(root) / name / good.name)
        before = _files(root)
        res = launch.run_function(_resume_worker, 2, root, launch=dict(timeout=300)).returns
        return on_disk, tracker, res, before, _files(root)


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for name in DAMAGE for p in (Path(root) / name).rglob("*")
            if p.is_file()}


def _biggest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _rewrite(path: Path, change) -> None:
    path.write_bytes(change(path.read_bytes()))


DAMAGE = {  # name: what is done to a copy of the good iteration-2 checkpoint
    "truncated_shard": lambda d: _rewrite(_biggest_shard(d), lambda b: b[:100]),
    "missing_shard": lambda d: _biggest_shard(d).unlink(),
    "bit_rot": lambda d: _rewrite(_biggest_shard(d), lambda b: b[:len(b) // 2] + bytes([b[len(b) // 2] ^ 0x10])
                                  + b[len(b) // 2 + 1:]),
    "no_metadata": lambda d: (d / ".metadata").unlink(),
    "flipped_metadata": lambda d: _rewrite(d / ".metadata", lambda b: b[:8] + bytes(x ^ 0xFF for x in b[8:40]) + b[40:]),
    "truncated_common": lambda d: _rewrite(d / "common.pt", lambda b: b[:len(b) // 2]),
    "no_tracker": lambda d: (d.parent / ckpt.TRACKER).unlink(),
}


def test_crash_mid_save_keeps_last_good_checkpoint(results):
    on_disk, tracker, res, _, _ = results
    assert tracker == 2
    assert "iter_0000002" in on_disk and "iter_0000004.tmp" in on_disk and "iter_0000004" not in on_disk
    (iteration, loss), = res[0]["resumed"]
    assert iteration == 3
    assert loss == pytest.approx(reference_run(3)[2][0], rel=1e-5)
    assert res[0] == res[1]


def test_bad_checkpoints_give_clear_errors(results):
    res = results[2][0]
    assert "saved from another model" in res["mismatch"] and "hidden_size" in res["mismatch"]
    assert "does not exist" in res["partial"]
    assert "no latest_checkpointed_iteration.txt" in res["empty"]
    assert "incomplete" in res["no_metadata"]


@pytest.mark.parametrize("damage,words", [
    ("truncated_shard", r"truncated_shard/iter_0000002/__\d_0\.distcp is truncated"),
    ("missing_shard", r"missing_shard/iter_0000002/__\d_0\.distcp is missing"),
    ("bit_rot", r"bit_rot/iter_0000002/__\d_0\.distcp does not match its checksum"),
    ("flipped_metadata", r"flipped_metadata/iter_0000002/\.metadata cannot be read"),
    ("truncated_common", r"truncated_common/iter_0000002/common\.pt cannot be loaded"),
    ("no_tracker", r"no_tracker/latest_checkpointed_iteration\.txt is missing, but .* holds iter_0000002"),
])
def test_every_damaged_file_is_named_on_every_rank_and_left_as_it_is(results, damage, words):
    _, _, res, before, after = results
    assert re.search(words, res[0][damage]), res[0][damage]
    assert res[1][damage] == res[0][damage]  # the same verdict on every rank: none goes on alone
    assert after == before  # loading changed no file


def test_checksums_cost_one_crc32_per_file_and_are_optional(tmp_path):
    """The save records each shard's CRC32; without checksums nothing is recorded and bit rot loads silently."""
    import torch.distributed.checkpoint as dcp

    state = {"model.weight": torch.arange(12.0).reshape(3, 4)}
    metadata = dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    files = ckpt._shard_files(metadata)
    sums = ckpt._checksum_files(tmp_path, files, no_dist=True)
    assert sorted(sums) == files and all(len(v) == 8 for v in sums.values())
    torch.save({"checksums": {"algorithm": "crc32", "files": sums}}, tmp_path / "common.pt")
    ckpt.read_state(tmp_path, {"model.weight": torch.empty(3, 4)}, no_dist=True)  # intact: loads
    info, = metadata.storage_data.values()
    shard = tmp_path / info.relative_path
    raw = bytearray(shard.read_bytes())
    raw[raw.find(state["model.weight"].numpy().tobytes()) + 21] ^= 0x01  # one bit of one element (5.0)
    shard.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="does not match its checksum"):
        ckpt.read_state(tmp_path, {"model.weight": torch.empty(3, 4)}, no_dist=True)
    (tmp_path / "common.pt").unlink()  # an old checkpoint without checksums: loads, the flipped bit unseen
    loaded = {"model.weight": torch.empty(3, 4)}
    ckpt.read_state(tmp_path, loaded, no_dist=True)
    assert not torch.equal(loaded["model.weight"], state["model.weight"])


class NotPlainData:
    """An object no weights_only allow-list holds (importing megatron.core allows pathlib's paths, for one)."""


def test_tracker_and_common_errors(tmp_path):
    assert ckpt.read_tracker(tmp_path) is None
    (tmp_path / ckpt.TRACKER).write_text("latest")
    with pytest.raises(ckpt.CheckpointError, match="iteration number"):
        ckpt.read_tracker(tmp_path)
    d = tmp_path / "iter_0000001"
    d.mkdir()
    (d / ".metadata").write_bytes(b"")
    torch.save({"iteration": 1, "config": NotPlainData()}, d / "common.pt")  # an object weights_only refuses
    with pytest.raises(ckpt.CheckpointError, match="weights_only=True"):
        ckpt.read_common(d)
    (d / "common.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.read_common(d)
    torch.save({"iteration": 1, "consumed_samples": 8}, d / "common.pt")
    assert ckpt.read_common(d)["consumed_samples"] == 8


class _CommitWatch:
    """Watches the file-system steps of one commit_checkpoint call (os.rename/os.replace, shutil.rmtree, open for
    writing): `problem` is the first moment the tracker newly names an iteration whose directory is not complete
    yet, or the tracker opened for writing under its own name (a crash mid-write leaves it empty)."""

    def __init__(self, save_dir: Path, monkeypatch):
        self.save_dir, self.tracker, self.problem = save_dir, save_dir / ckpt.TRACKER, None
        real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree, "open": builtins.open,
                "io.open": io.open}
        self._read = lambda: real["open"](self.tracker).read() if self.tracker.exists() else None
        self.before = self._read()  # re-saving the iteration the tracker already names is not a new claim

        def step(name):
            def watched(*args, **kwargs):
                self.check(f"before {name}{tuple(Path(a).name for a in args[:2])}")
                out = real[name](*args, **kwargs)
                self.check(f"after {name}{tuple(Path(a).name for a in args[:2])}")
                return out
            return watched

        def opened(name):
            def watched(file, mode="r", *args, **kwargs):
                if (isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
                        and Path(file).resolve() == self.tracker.resolve() and self.problem is None):
                    self.problem = mistake(
                        "the tracker is written in place, not atomic: a crash mid-write leaves it empty or half "
                        "written (write a temporary file beside it, then os.replace it onto the tracker)",
                        f"{ckpt.TRACKER} was opened with mode {mode!r}")
                self.check(f"opening {Path(file).name if isinstance(file, (str, os.PathLike)) else file}")
                return real[name](file, mode, *args, **kwargs)
            return watched

        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, step(name))
        monkeypatch.setattr(shutil, "rmtree", step("rmtree"))
        monkeypatch.setattr(builtins, "open", opened("open"))
        monkeypatch.setattr(io, "open", opened("io.open"))

    def check(self, when: str) -> None:
        text = self._read()
        if self.problem is not None or text is None or text == self.before or not text.strip().isdigit():
            return
        final = ckpt.checkpoint_dir(self.save_dir, int(text))
        if not (final / "common.pt").exists():
            self.problem = mistake(
                "the tracker before the data: it named a checkpoint not yet in place (rename tmp to its final name "
                "first, then replace the tracker)", f"{when}: the tracker says {text.strip()} but {final.name}/"
                "common.pt does not exist")


@pytest.mark.exercise("checkpoint.commit")
def test_commit_is_rename_then_tracker(tmp_path, monkeypatch):
    for commit, iteration in enumerate((2, 4, 4)):  # a new checkpoint, a later one, the same iteration saved again
        tmp = tmp_path / f"iter_{iteration:07d}.tmp"
        tmp.mkdir()
        content = f"iteration {iteration}, commit {commit}"
        (tmp / "common.pt").write_text(content)
        where = f"commit_checkpoint({tmp.name}, iteration {iteration})"
        with monkeypatch.context() as patch:
            watch = _CommitWatch(tmp_path, patch)
            try:
                final, error = ckpt.commit_checkpoint(tmp, tmp_path, iteration), None
            except OSError as e:
                error = f"{type(e).__name__}: {e}"  # named below, outside the handler (the grader shows the first error)
        if error is not None:
            require(mistake("renamed onto an existing checkpoint directory without removing it first (remove the old "
                            "final directory, then rename tmp)", f"{where}: {error}"))
        if watch.problem is not None:
            require(watch.problem)
        nested = ckpt.checkpoint_dir(tmp_path, iteration) / tmp.name
        if nested.exists():
            require(mistake("tmp nested inside the existing checkpoint directory (shutil.move into a directory moves "
                            "INTO it): remove the old final directory, then rename tmp",
                            f"{where}: {nested.relative_to(tmp_path)} exists"))
        assert final == ckpt.checkpoint_dir(tmp_path, iteration), (
            f"{where} returned {final}, expected {ckpt.checkpoint_dir(tmp_path, iteration)} (the final directory)")
        got = (final / "common.pt").read_text() if (final / "common.pt").exists() else "(missing)"
        assert got == content, (
            f"{where}: {final.name}/common.pt holds {got!r}, expected {content!r} (the new checkpoint "
            "should replace an older one of the same iteration)")
        assert not tmp.exists(), f"{where}: {tmp.name} still exists; rename it to {final.name}"
        tracker = ckpt.read_tracker(tmp_path)
        assert tracker == iteration, f"{where}: the tracker says iteration {tracker}, expected {iteration}"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["iter_0000002", "iter_0000004", ckpt.TRACKER], (
        f"after committing iterations 2, 4 and 4 again, the directory holds {names}; expected only "
        f"{['iter_0000002', 'iter_0000004', ckpt.TRACKER]} (no .tmp directories or leftover files)")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty"])
def test_a_damaged_metadata_file_is_a_checkpoint_error_and_left_as_it_is(tmp_path, damage):
    """A corrupt or truncated .metadata used to escape as a raw UnpicklingError/EOFError (read before the
    guarded load); now a CheckpointError names the file, and reading changes no file."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "iter_0000001"
    state = {"model.weight": torch.arange(6.0).reshape(2, 3)}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    meta = path / ".metadata"
    raw = meta.read_bytes()
    meta.write_bytes({"flipped": raw[:8] + bytes(b ^ 0xFF for b in raw[8:40]) + raw[40:],
                      "truncated": raw[: len(raw) // 2], "empty": b""}[damage])
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(ckpt.CheckpointError, match=r"iter_0000001/\.metadata cannot be read .*corrupt or truncated"):
        ckpt.read_state(path, {"model.weight": torch.empty(2, 3)}, no_dist=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def _cuda_rng_worker(root: str):
    """A rank training on a GPU, played on CPU: torch.cuda's generator calls are stand-ins."""
    from megalab.core import parallel_state
    from megalab.lab import dist as mdist
    from megalab.training.training import setup_model_and_optimizer

    mdist.init()
    generator = {"state": torch.arange(16, dtype=torch.uint8)}
    torch.cuda.get_rng_state = lambda device=None: generator["state"].clone()
    torch.cuda.set_rng_state = lambda state, device=None: generator.update(state=state.clone())
    torch.cuda.current_device = lambda: 0
    ckpt._on_cuda = lambda params: True
    state = setup_model_and_optimizer(training_config())
    try:
        ckpt.save_checkpoint(root, 1, state.model, state.params, state.optimizer, state.scheduler, 0)
        generator["state"] = torch.zeros(16, dtype=torch.uint8)  # the run went on drawing
        common = ckpt.load_checkpoint(root, state.model, state.params, state.optimizer, state.scheduler)
    finally:
        parallel_state.destroy_model_parallel()
    return common["cuda_rng"], generator["state"].tolist()


def test_a_gpu_run_saves_and_restores_its_cuda_generator(tmp_path):
    saved, restored = launch.run_function(_cuda_rng_worker, 1, str(tmp_path), launch=dict(timeout=120)).returns[0]
    assert saved is True and restored == list(range(16))
