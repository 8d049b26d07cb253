"""Engines treat the artifact as data (issue 39): each attack with a live payload.

Every test arms a payload that writes a marker file and first shows it live (run
without the defence: the marker appears), then that exportlm refuses before it runs
(the marker stays absent): a library named by ``genai_config.json``, a folder's
``custom_generate/generate.py``, an interpreter planted in the current directory, an
edited file under a manifest, and a worker flooding its output. The fake workers do
with the hostile part what the real engine does (onnxruntime-genai dlopens
``custom_ops_library``; transformers 4.5x imports a local ``custom_generate/generate.py``
at ``from_pretrained`` even with ``trust_remote_code=False``); where an engine's
interpreter is found (``EXPORTLM_ENGINE_<NAME>``), its real worker is run on the
attack too, past exportlm's own check, to show the worker refuses as well.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import exportlm
from exportlm.cli import main
from exportlm.engines import (
    WORKERS_DIR,
    Engine,
    EngineInterpreterError,
    EngineRequest,
    find_interpreter,
    run_engine,
)
from exportlm.errors import ArtifactIntegrityError, EngineArtifactRefusedError, EngineError
from exportlm.models import build_model
from tests._exports import shared_export

# A worker that does what the real engines do with the hostile part of an artifact.
FAKE_ENGINE = f"""
import ctypes, json, os, runpy, sys
sys.path.insert(0, {str(WORKERS_DIR)!r})
import _worker

def serve(ctx):
    folder = _worker.artifact_folder(ctx.request["artifact"])
    genai = os.path.join(folder, "genai_config.json")
    if os.path.isfile(genai):  # onnxruntime-genai: session_options.custom_ops_library
        options = json.load(open(genai))["model"]["decoder"]["session_options"]
        if "custom_ops_library" in options:
            ctypes.CDLL(os.path.join(folder, options["custom_ops_library"]))
    generate = os.path.join(folder, "custom_generate", "generate.py")
    if os.path.isfile(generate):  # transformers 4.5x from_pretrained, trust_remote_code=False
        runpy.run_path(generate)
    rows = _worker.rows(ctx.request)
    n = ctx.request["max_new_tokens"]
    return [[1] * n for _ in rows], [[-1.0] * (len(r) - 1) for r in rows]

sys.exit(_worker.main("fake", "json", ("pytest",), serve))
"""

PAYLOAD_C = """
#include <stdio.h>
__attribute__((constructor)) static void payload(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the artifact's library ran", f); fclose(f); }
}
"""


def _request() -> EngineRequest:
    return EngineRequest.left_padded([[5, 6, 7], [9]], max_new_tokens=2)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    worker = tmp_path / "workers" / "fake_worker.py"
    worker.parent.mkdir()
    worker.write_text(FAKE_ENGINE)
    return Engine("fake", "json", ("pytest",), str(worker))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "payload-ran"


def _genai_folder(folder: Path, **session_options: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(b"a graph")
    options = {"log_id": "onnxruntime-genai", "provider_options": [], **session_options}
    config = {"model": {"decoder": {"filename": "model.onnx", "session_options": options}}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder / "model.onnx"


def _library(tmp_path: Path, marker: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the payload library")
    source = tmp_path / "evil.c"
    source.write_text(PAYLOAD_C)
    lib = tmp_path / "elsewhere" / "libevil.so"
    lib.parent.mkdir()
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(source)], check=True
    )
    return lib


def _run_worker_directly(python: str, worker: Path, artifact: Path, tmp_path: Path) -> dict:
    """The worker on ``artifact`` with exportlm's own check skipped: what it alone does."""
    request, response = tmp_path / "request.json", tmp_path / "response.json"
    request.write_text(json.dumps(_request().payload(str(artifact), {})))
    subprocess.run(
        [python, "-E", "-s", str(worker), str(request), str(response)],
        cwd=tmp_path,
        capture_output=True,
        timeout=600,
        check=False,
    )
    return dict(json.loads(response.read_text()))


# -- 1. a library named by genai_config.json -------------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["absolute-path", "shipped-in-folder"])
def test_a_custom_ops_library_in_genai_config_is_never_loaded(
    tmp_path: Path, engine: Engine, marker: Path, inside: bool
) -> None:
    lib = _library(tmp_path, marker)
    if inside:
        (tmp_path / "art").mkdir()
        lib = Path(shutil.copy(lib, tmp_path / "art" / "libevil.so"))
    graph = _genai_folder(tmp_path / "art", custom_ops_library=str(lib))
    _run_worker_directly(sys.executable, engine.worker_path(), graph, tmp_path)
    assert marker.exists(), "the payload is live: an engine loading the config runs it"
    marker.unlink()
    with pytest.raises(EngineArtifactRefusedError, match="custom_ops_library") as info:
        run_engine(engine, graph, _request())
    assert info.value.engine == "fake"
    assert not marker.exists()


def test_the_real_onnxruntime_genai_worker_refuses_a_custom_ops_library(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, marker: Path
) -> None:
    python = find_interpreter("onnxruntime-genai").path
    if python is None:
        pytest.skip("onnxruntime-genai has no interpreter here (EXPORTLM_ENGINE_ONNXRUNTIME_GENAI)")
    shared = shared_export(
        tmp_path_factory, "onnx", "llama", filename="model.onnx", kv_cache=True, genai_config=True
    )
    folder = Path(shutil.copytree(shared.path.parent, tmp_path / "art"))
    for file in folder.iterdir():
        file.chmod(0o644)
    config = json.loads((folder / "genai_config.json").read_text())
    lib = _library(tmp_path, marker)
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = str(lib)
    (folder / "genai_config.json").write_text(json.dumps(config))
    worker = WORKERS_DIR / "ort_genai.py"
    answer = _run_worker_directly(str(python), worker, folder / "model.onnx", tmp_path)
    assert not marker.exists(), "onnxruntime-genai loaded the library"
    assert answer["status"] == "refused", answer
    assert "custom_ops_library" in answer["error"]
    with pytest.raises(EngineArtifactRefusedError, match="custom_ops_library"):
        run_engine("onnxruntime-genai", folder / "model.onnx", _request())
    assert not marker.exists()


# -- 2. Python shipped in the artifact: custom_generate/, auto_map, *.py, libraries -------


def _custom_generate(folder: Path, marker: Path) -> None:
    (folder / "custom_generate").mkdir(parents=True)
    (folder / "custom_generate" / "generate.py").write_text(
        f"open({str(marker)!r}, 'w').write('the artifact ran')\n"
        "def generate(model, **kwargs):\n    return None\n"
    )


def test_a_custom_generate_folder_is_never_run(
    tmp_path: Path, engine: Engine, marker: Path
) -> None:
    folder = tmp_path / "ckpt"
    _custom_generate(folder, marker)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _run_worker_directly(sys.executable, engine.worker_path(), folder, tmp_path)
    assert marker.exists(), "the payload is live: transformers 4.5x imports it"
    marker.unlink()
    with pytest.raises(EngineArtifactRefusedError, match="custom_generate"):
        run_engine(engine, folder, _request())
    assert not marker.exists()


def _transformers_pythons() -> list[str]:
    """Interpreters here that import transformers (the optimum venv holds transformers 4.5x)."""
    found = {sys.executable}
    for name in ("transformers", "optimum-onnxruntime"):
        python = find_interpreter(name).path
        if python is not None:
            found.add(str(python))
    return sorted(found)


@pytest.mark.parametrize("python", _transformers_pythons())
def test_the_transformers_worker_itself_refuses_custom_generate(
    tmp_path: Path, marker: Path, python: str
) -> None:
    folder = exportlm.export_model("hf_checkpoint", build_model("llama"), tmp_path / "ckpt")
    _custom_generate(folder, marker)
    worker = WORKERS_DIR / "transformers_worker.py"
    answer = _run_worker_directly(python, worker, folder, tmp_path)
    if answer.get("status") == "unavailable":
        pytest.skip(f"transformers does not import in {python}")
    assert not marker.exists(), f"transformers {answer.get('engine_version')} ran the artifact"
    assert answer["status"] == "refused", answer
    assert "custom_generate" in answer["error"]


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({"config.json": json.dumps({"auto_map": {"AutoModel": "m.Model"}})}, "auto_map"),
        ({"modeling_evil.py": "raise SystemExit"}, "modeling_evil.py"),
        ({"kernels/libops.so.1": "ELF"}, "kernels/libops.so.1"),
        ({"libops.dylib": "Mach-O"}, "libops.dylib"),
        ({"__pycache__/x.cpython-311.pyc": ""}, "x.cpython-311.pyc"),
    ],
    ids=["auto_map", "py", "so-versioned", "dylib", "pyc"],
)
def test_code_anywhere_in_an_artifact_folder_is_refused_before_any_worker(
    tmp_path: Path, engine: Engine, marker: Path, files: dict[str, str], reason: str
) -> None:
    graph = _genai_folder(tmp_path / "art")
    for name, text in files.items():
        (graph.parent / name).parent.mkdir(parents=True, exist_ok=True)
        (graph.parent / name).write_text(text)
    spy = Engine("spy", "json", (), str(_spy(tmp_path, marker)))
    with pytest.raises(EngineArtifactRefusedError, match=reason.replace(".", r"\.")):
        run_engine(spy, graph, _request())
    assert not marker.exists(), "a worker was started"


def _spy(tmp_path: Path, marker: Path) -> Path:
    worker = tmp_path / "workers" / "spy.py"
    worker.parent.mkdir(exist_ok=True)
    worker.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return worker


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"provider_options": [{"qnn": {"backend_path": "/tmp/libQnn.so"}}]}, "backend_path"),
        ({"provider_options": [{"tensorrt": {"trt_extra_plugin_lib_paths": "x"}}]}, "plugin"),
        ({"ep_context_file_path": "/tmp/out.onnx"}, "ep_context_file_path"),
        ({"config_entries": {"ep.context_file_path": "/tmp/x"}}, "context_file_path"),
    ],
)
def test_genai_session_options_that_load_or_write_files_are_refused(
    tmp_path: Path, marker: Path, options: dict[str, object], reason: str
) -> None:
    graph = _genai_folder(tmp_path / "art", **options)
    spy = Engine("spy", "json", (), str(_spy(tmp_path, marker)))
    with pytest.raises(EngineArtifactRefusedError, match=reason):
        run_engine(spy, graph, _request())
    assert not marker.exists()


def test_a_genai_graph_filename_outside_the_folder_is_refused(tmp_path: Path, marker: Path) -> None:
    graph = _genai_folder(tmp_path / "art")
    config = json.loads((graph.parent / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "../../elsewhere/model.onnx"
    (graph.parent / "genai_config.json").write_text(json.dumps(config))
    spy = Engine("spy", "json", (), str(_spy(tmp_path, marker)))
    with pytest.raises(EngineArtifactRefusedError, match=r"filename.*climbs out"):
        run_engine(spy, graph, _request())
    assert not marker.exists()


def test_what_exportlm_writes_for_onnxruntime_genai_is_served(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> None:
    shared = shared_export(
        tmp_path_factory, "onnx", "llama", filename="model.onnx", kv_cache=True, genai_config=True
    )
    result = run_engine(engine, shared.path, _request())  # nothing refused: no false alarm
    assert result.tokens == [[1, 1], [1, 1]]


# -- 3. an interpreter given as a relative path ------------------------------------------


def _planted_python(shared: Path, marker: Path) -> Path:
    planted = shared / "venv" / "bin" / "python"
    planted.parent.mkdir(parents=True)
    planted.write_text(f"#!/bin/sh\necho planted > {marker}\n")
    planted.chmod(planted.stat().st_mode | stat.S_IXUSR)
    return planted


def test_a_relative_interpreter_path_is_refused_never_looked_up_in_the_cwd(
    tmp_path: Path, engine: Engine, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    planted = _planted_python(shared, marker)
    graph = _genai_folder(tmp_path / "art")
    with pytest.raises(EngineError):  # live: given absolutely, the planted file runs
        run_engine(engine, graph, _request(), overrides={"fake": str(planted)})
    assert marker.exists()
    marker.unlink()
    monkeypatch.chdir(shared)
    for given in ("venv/bin/python", "venv", "./venv"):
        with pytest.raises(EngineInterpreterError, match="relative path"):
            run_engine(engine, graph, _request(), overrides={"fake": given})
    monkeypatch.setenv("EXPORTLM_ENGINE_FAKE", "venv")
    with pytest.raises(EngineInterpreterError, match=r"EXPORTLM_ENGINE_FAKE.*relative path"):
        run_engine(engine, graph, _request())
    assert not marker.exists()


def test_verify_refuses_a_relative_python(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    marker: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared = tmp_path / "shared"
    _planted_python(shared, marker)
    checkpoint = shared_export(tmp_path_factory, "hf_checkpoint", "llama", filename="ckpt").path
    monkeypatch.chdir(shared)
    argv = ["verify", str(checkpoint), "--engine", "transformers", "--python", "venv/bin/python"]
    assert main(argv) == 2  # resolved in the cwd, the planted python would serve it
    assert "relative path" in capsys.readouterr().err
    assert not marker.exists()


def test_the_plugin_refuses_a_relative_export_engine_path(
    pytester: pytest.Pytester, marker: Path
) -> None:
    _planted_python(pytester.path, marker)
    result = pytester.runpytest(
        "--export-targets=torch_export",
        "--export-only",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "--export-engine=transformers=venv/bin/python",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'venv/bin/python' is a relative path*absolute path*"])
    assert not marker.exists()


# -- 4. an edited file under a manifest --------------------------------------------------


def test_verify_holds_the_artifact_to_its_manifest_before_any_engine_starts(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    marker: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared = shared_export(
        tmp_path_factory, "onnx", "llama", filename="model.onnx", kv_cache=True, genai_config=True
    )
    folder = Path(shutil.copytree(shared.path.parent, tmp_path / "art"))
    for file in folder.iterdir():
        file.chmod(0o644)
    planted = _planted_python(tmp_path / "engine", marker)
    monkeypatch.setenv("EXPORTLM_ENGINE_ONNXRUNTIME_GENAI", str(planted))
    argv = ["verify", str(folder / "model.onnx"), "--engine", "onnxruntime-genai"]
    argv += ["--model", "llama"]
    assert main(argv) == 1  # the untouched artifact reaches the engine (it "crashes")
    assert marker.exists()
    marker.unlink()
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 7
    (folder / "genai_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "genai_config.json does not match its blake3 digest in the manifest" in err
    assert not marker.exists()


def test_a_genai_folder_that_differs_from_its_manifest_raises_integrity(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from exportlm.export.manifest import verify_artifact

    shared = shared_export(
        tmp_path_factory, "onnx", "llama", filename="model.onnx", kv_cache=True, genai_config=True
    )
    folder = Path(shutil.copytree(shared.path.parent, tmp_path / "art"))
    (folder / "genai_config.json").chmod(0o644)
    (folder / "genai_config.json").write_text("{}")
    with pytest.raises(ArtifactIntegrityError, match=r"genai_config\.json"):
        verify_artifact(folder / "model.onnx")


# -- 5. a worker flooding its output -----------------------------------------------------

FLOOD = """
import os, sys, time
open({pidfile!r}, "w").write(str(os.getpid()))
chunk = b"x" * 2**20 + b"\\n"
for _ in range({megabytes}):
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
    time.sleep(0.002)
open({done!r}, "w").close()
time.sleep(60)
"""

MEASURE = """
import json, resource, sys
from exportlm.engines import Engine, EngineRequest, run_engine
from exportlm.errors import EngineOutputLimitError
worker, artifact, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    run_engine(Engine("flood", "json", (), worker), artifact,
               EngineRequest.left_padded([[1, 2]], max_new_tokens=1), timeout=300, max_output=cap)
    error, kind = None, None
except Exception as err:
    error, kind = str(err), type(err).__name__
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_kib": grew, "error": error, "kind": kind}))
"""


def test_a_worker_flooding_its_output_is_killed_at_the_cap_with_memory_bounded(
    tmp_path: Path,
) -> None:
    pidfile, done = tmp_path / "pid", tmp_path / "flood-done"
    worker = tmp_path / "workers" / "flood.py"
    worker.parent.mkdir()
    worker.write_text(FLOOD.format(pidfile=str(pidfile), done=str(done), megabytes=200))
    graph = _genai_folder(tmp_path / "art")
    cap = 4 * 2**20
    env = {**os.environ, "EXPORTLM_ENGINE_REUSE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(worker), str(graph), str(cap)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=env,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kind"] == "EngineOutputLimitError", got
    assert "more than 4194304 bytes (4 MiB) of output" in got["error"]
    assert got["grew_kib"] < 48 * 1024, got  # a 200 MB flood read whole: > 400 MiB
    assert not done.exists(), "the worker was not killed at the cap"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)


def test_a_response_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    worker = tmp_path / "workers" / "big.py"
    worker.parent.mkdir()
    worker.write_text(
        "import sys\nwith open(sys.argv[2], 'w') as f:\n"
        '    f.write(\'{"protocol": 1, "status": "ok", "pad": "\' + \'x\' * 3_000_000 + \'"}\')\n'
    )
    graph = _genai_folder(tmp_path / "art")
    with pytest.raises(EngineError, match=r"more than 1048576 bytes \(1 MiB\) of response"):
        run_engine(Engine("big", "json", (), str(worker)), graph, _request(), max_output=2**20)
