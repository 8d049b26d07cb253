"""Export at the speed of the disk (issue 21, point 3): every file hashed as it is written.

The hf_checkpoint target computes each file's BLAKE3 digest (manifest schema 3) from the
bytes it writes (shards, index, configs) and the model's hash on worker threads; the
manifest reads nothing back. These tests pin that (a spy on the re-reading hash), that
the digests are the files' real BLAKE3, and the writer's threads (order, failure, the
digest of one file).
No timing here: ``benchmarks/bench_export_disk.py`` measures.
"""

from __future__ import annotations

import errno
import functools
import importlib.metadata
import json
import threading
import time
import types
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from safetensors.torch import load_file

import exportlm
import exportlm.export.guard
import exportlm.export.manifest
from exportlm import _libraries
from exportlm.errors import ExportFailedError
from exportlm.export.hf_checkpoint import _write as target_module  # the in-memory source
from exportlm.export.hf_checkpoint import shards as sink_module  # the one shard writer
from exportlm.export.hf_checkpoint.sink import ShardedSafetensorsWriter, write_safetensors
from exportlm.export.manifest import model_hash, read_manifest
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


def _fp8_model() -> Any:
    model = tiny_hf_model("llama", num_hidden_layers=2)
    batch = torch.randint(
        0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, "fp8", calibrate=lambda m: m(batch))
    return model


def _no_reread(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every call of the hash that re-reads a file, wherever it is imported."""
    calls: list[Path] = []

    def spy(path: Any) -> str:
        calls.append(Path(path))
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(exportlm.export.guard, "file_digest", spy)
    monkeypatch.setattr(exportlm.export.manifest, "file_digest", spy)
    return calls


def test_an_export_hashes_every_file_as_it_writes_it_and_reads_none_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _fp8_model()
    calls = _no_reread(monkeypatch)
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", max_shard_size="64KB")
    assert calls == []
    manifest = read_manifest(out)
    assert manifest is not None
    files = {p.name for p in out.iterdir()} - {"exportlm-manifest.json"}
    assert "model.safetensors.index.json" in files
    assert "config.json" in files
    assert set(manifest.files) == files  # shards, index and configs, nothing else


def test_the_recorded_digests_are_the_blake3_of_the_published_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", "1")  # the model hash is asked for
    model = _fp8_model()
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", max_shard_size="64KB")
    manifest = read_manifest(out)
    assert manifest is not None
    assert len([n for n in manifest.files if n.endswith(".safetensors")]) > 2
    for name, entry in manifest.files.items():
        data = (out / name).read_bytes()
        assert entry == {"blake3": blake3.blake3(data).hexdigest(), "size": len(data)}, name
    assert manifest.model_hash == model_hash(model)
    reloaded = exportlm.load_exported("hf_checkpoint", out)  # verified on load, as always
    assert reloaded is not None


def test_write_safetensors_returns_the_digest_of_what_it_wrote_across_pieces(
    tmp_path: Path,
) -> None:
    tensors = {  # 72 MB: several pieces handed to the hashing thread, hashed multithreaded
        "big": torch.arange(18 << 20, dtype=torch.float32),
        "small": torch.tensor([1, 2, 3], dtype=torch.int8),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "t.safetensors"
    digest = write_safetensors(path, tensors, {"format": "pt"})
    data = path.read_bytes()
    assert (digest.digest, digest.size) == (blake3.blake3(data).hexdigest(), len(data))
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_shards_written_by_threads_keep_their_order_names_and_bytes(tmp_path: Path) -> None:
    tensors = {f"t{i:02d}": torch.full((1000,), float(i)) for i in range(12)}  # 4 KB each
    summaries = []
    for threads in (1, 3):
        directory = tmp_path / f"threads-{threads}"
        directory.mkdir()
        writer = ShardedSafetensorsWriter(directory, max_shard_size=9000, write_threads=threads)
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        summaries.append((directory, writer.finish()))
    (one, first), (three, second) = summaries
    assert first.files == second.files
    assert len(first.files) == 6
    assert first.weight_map == second.weight_map
    for name in [*first.files, "model.safetensors.index.json"]:
        assert (one / name).read_bytes() == (three / name).read_bytes()
        assert first.digests[name] == second.digests[name]
    index = json.loads((three / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t00"] == "model-00001-of-00006.safetensors"


def _shard_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("exportlm-shard")]


def test_a_finished_writer_s_threads_end_after_its_last_write(tmp_path: Path) -> None:
    before = set(_shard_threads())
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_size=10, write_threads=2)
    for name in "abc":
        writer.add(name, torch.ones(4))
    summary = writer.finish()  # returns once every file is written, not once freed
    assert len(summary.files) == 3
    for thread in set(_shard_threads()) - before:
        thread.join(timeout=30)  # it only drops the tensors it wrote, then exits
        assert not thread.is_alive()


def test_a_failed_background_write_surfaces_at_finish_as_our_error(tmp_path: Path) -> None:
    writer = ShardedSafetensorsWriter(tmp_path / "gone", max_shard_size=10)
    writer.add("a", torch.ones(4))
    writer.add("b", torch.ones(4))  # the first shard goes to the writer thread: no directory
    with pytest.raises(ExportFailedError, match=r"shard \.shard-00001.*FileNotFoundError") as e:
        writer.finish()
    assert isinstance(e.value.__cause__, FileNotFoundError)


def test_a_write_failing_while_finish_waits_for_it_leaves_no_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()

    def slow_failure(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Any:
        started.set()
        time.sleep(0.3)  # still running when finish's last shard waits for a free thread
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sink_module, "write_safetensors", slow_failure)
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_size=10)  # one writer thread
    writer.add("a", torch.ones(4))
    writer.add("b", torch.ones(4))  # the first shard goes to the writer thread
    assert started.wait(10)
    with pytest.raises(ExportFailedError, match=r"shard \.shard-00001.*OSError"):
        writer.finish()
    # The error came from finish's wait for the first shard, before finish's own cleanup:
    # the writer's threads are shut down with it (they once outlived the writer, and a
    # later test found them).
    assert not _shard_threads()
    with pytest.raises(ExportFailedError, match="already finished"):
        writer.add("c", torch.ones(4))


def _disk_full_at_shard(monkeypatch: pytest.MonkeyPatch, failing: int) -> None:
    """The writer of shard ``failing`` (1-based) writes a little, then finds the disk full."""
    real = sink_module.write_safetensors

    def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Any:
        if path.name.startswith(f".shard-{failing:05d}"):
            path.write_bytes(b"\0" * 100)  # a half-written shard in the staged directory
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors, metadata)

    monkeypatch.setattr(sink_module, "write_safetensors", write)


@pytest.mark.parametrize("write_threads", [1, 3])
def test_a_full_disk_in_a_shard_writer_publishes_nothing_and_raises_our_error(
    write_threads: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _fp8_model()
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", max_shard_size="64KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _disk_full_at_shard(monkeypatch, failing=2)
    monkeypatch.setattr(  # shards written by parallel threads too
        target_module,
        "ShardedSafetensorsWriter",
        functools.partial(ShardedSafetensorsWriter, write_threads=write_threads),
    )
    with pytest.raises(ExportFailedError, match=r"No space left on device.*publishes nothing"):
        exportlm.export_model("hf_checkpoint", model, out, max_shard_size="64KB", overwrite=True)
    assert list(tmp_path.iterdir()) == [out]  # no staged directory, no half-written shard
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert exportlm.load_exported("hf_checkpoint", out) is not None  # still verifies
    assert not _shard_threads()


def test_a_failed_shard_among_parallel_writers_is_our_error_and_stops_every_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _disk_full_at_shard(monkeypatch, failing=2)
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_size=4000, write_threads=3)

    def write_all() -> None:
        for i in range(8):  # one shard each; a later add may be the one that sees it
            writer.add(f"t{i}", torch.full((1000,), float(i)))
        writer.finish()

    with pytest.raises(ExportFailedError, match=r"\.shard-00002.*OSError") as e:
        write_all()
    writer.abort()  # what the target does after any failure: wait for the writes in flight
    assert isinstance(e.value.__cause__, OSError)
    assert e.value.__cause__.errno == errno.ENOSPC
    assert not _shard_threads()


def test_model_hash_is_the_same_on_any_number_of_threads() -> None:
    model = tiny_hf_model("llama", num_hidden_layers=1)
    assert model_hash(model, threads=1) == model_hash(model, threads=4)
    expected = blake3.blake3(b"transformers.models.llama.modeling_llama.LlamaForCausalLM\n")
    for name, tensor in sorted(model.state_dict().items()):
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        line = f"{name}|{dtype}|{list(tensor.shape)}|{blake3.blake3(raw).hexdigest()}\n"
        expected.update(line.encode())
    assert model_hash(model) == expected.hexdigest()  # the documented definition


def test_a_manifest_reads_each_library_version_once_and_a_missing_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_libraries, "_FOUND", {})  # as in a fresh process
    real = importlib.metadata.version
    reads: list[str] = []

    def version(distribution: str) -> str:
        reads.append(distribution)
        if distribution == "safetensors" and reads.count(distribution) == 1:
            raise importlib.metadata.PackageNotFoundError(distribution)  # not installed yet
        return real(distribution)

    shim = types.SimpleNamespace(
        version=version, PackageNotFoundError=importlib.metadata.PackageNotFoundError
    )
    monkeypatch.setattr(_libraries, "metadata", shim)  # the versions manifests read
    model = tiny_hf_model("llama", num_hidden_layers=1)
    first = read_manifest(exportlm.export_model("hf_checkpoint", model, tmp_path / "a"))
    second = read_manifest(exportlm.export_model("hf_checkpoint", model, tmp_path / "b"))
    assert first is not None
    assert second is not None
    assert first.versions["runtime:safetensors"] is None
    assert second.versions["runtime:safetensors"] == real("safetensors")  # found later
    assert {k: v for k, v in first.versions.items() if "safetensors" not in k} == {
        k: v for k, v in second.versions.items() if "safetensors" not in k
    }
    assert sorted(reads) == ["exportlm", "safetensors", "safetensors", "torch", "transformers"]
