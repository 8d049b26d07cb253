"""The engine room without any engine: registry, support tables, interpreter discovery,
and run_engine against fake workers (ok, refusal, crash, timeout, bad answers)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import exportlm.engines as engines
from exportlm.engines import (
    WORKERS_DIR,
    Engine,
    EngineCrashedError,
    EngineInterpreterError,
    EngineProtocolError,
    EngineRefusedError,
    EngineRequest,
    EngineTimeoutError,
    EngineUnavailableError,
    Verdict,
    find_interpreter,
    get_engine,
    parse_engine_options,
    run_engine,
)
from exportlm.errors import CustomCodeRefusedError, EngineError, UnknownNameError
from exportlm.registry import Registry, load_entry_point_registry
from tests._distinfo import make_distribution

BUILTIN = ["openvino", "sglang", "tensorrt-llm", "transformers", "vllm"]
PYTEST_VERSION = pytest.__version__

# A worker on the real shared worker code (_worker.main): its "engine" is the standard
# library's json module, its behaviour chosen by the request's "mode" option.
FAKE_WORKER = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(WORKERS_DIR)!r})
import _worker

def serve(ctx):
    given = ctx.options(["mode", "pidfile", "answer"])
    mode = given.get("mode", "ok")
    rows = _worker.rows(ctx.request)
    n = ctx.request["max_new_tokens"]
    if mode == "answer":  # the tokens and logprobs the test hands over, as JSON
        import json
        tokens, logprobs = json.loads(given["answer"])
        return tokens, logprobs
    if mode == "refuse":
        with ctx.stage("generate"):
            raise ValueError("scheme 'W8A16' has no kernel here")
    if mode == "crash":
        sys.stderr.write("fatal: the kernel segfaulted\\n")
        sys.stderr.flush()
        os._exit(3)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(ctx.request["options"]["pidfile"], "w") as f:
            f.write(str(child.pid))
        time.sleep(120)
    if mode == "short":
        n -= 1
    return [[row[-1]] * n for row in rows], [[-1.5] * (len(row) - 1) for row in rows]

sys.exit(_worker.main("fake", {{module!r}}, ("pytest",), serve))
"""


def _fake(tmp_path: Path, module: str = "json", name: str = "fake") -> Engine:
    worker = tmp_path / f"{name}_worker.py"
    worker.write_text(FAKE_WORKER.format(module=module))
    return Engine(name=name, module=module, distributions=("pytest",), worker=str(worker))


def _request(mode: str = "ok", **options: str) -> EngineRequest:
    return EngineRequest.left_padded(
        [[5, 6, 7], [9], [1, 2, 3, 4, 5]], max_new_tokens=4, options={"mode": mode, **options}
    )


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    (tmp_path / "artifact").mkdir()  # a folder of its own: no worker .py beside it
    path = tmp_path / "artifact" / "model.onnx"
    path.write_bytes(b"not read by the fake engine")
    return path


# -- registry ------------------------------------------------------------------


def test_the_builtin_engines_are_registered_with_their_workers_on_disk() -> None:
    assert set(BUILTIN) <= set(engines.engine_names())
    for name in BUILTIN:
        engine = get_engine(name)
        assert engine.name == name
        assert engine.worker_path().parent == WORKERS_DIR
        assert engine.worker_path().is_file()


def test_an_unknown_engine_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownNameError, match="vllm") as info:
        get_engine("vlm")
    assert set(BUILTIN) <= set(info.value.available)


def test_a_third_party_engine_registers_through_the_entry_point_group(tmp_path: Path) -> None:
    worker = tmp_path / "w.py"
    worker.write_text("")
    source = (
        "from exportlm.engines import Engine\n"
        f"ENGINE = Engine('my-engine', 'json', ('json',), {str(worker)!r})\n"
        "WRONG_NAME = Engine('other', 'json', ('json',), " + repr(str(worker)) + ")\n"
    )
    group = {"my-engine": "plug_engine:ENGINE", "renamed": "plug_engine:WRONG_NAME"}
    make_distribution(
        tmp_path, "my-engine-dist", {engines.ENGINES_GROUP: group}, {"plug_engine.py": source}
    )
    code = (
        "import exportlm.engines as e, warnings; warnings.simplefilter('ignore');"
        "print(e.engine_names()); print(sorted(e.ENGINE_REGISTRY.failed()))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert "my-engine" in out[0]
    assert "vllm" in out[0]
    assert out[1] == "['renamed']"


def test_the_validator_refuses_what_is_not_an_engine_with_a_worker(tmp_path: Path) -> None:
    reg: Registry[Engine] = Registry("engine", engines.validate_engine)
    with pytest.raises(TypeError, match=r"must point at an exportlm\.engines\.Engine"):
        reg.validate("x", object())
    with pytest.raises(ValueError, match="is not a file"):
        reg.validate("x", Engine("x", "json", (), str(tmp_path / "missing.py")))
    assert load_entry_point_registry("exportlm.test_no_such_group", reg) == []


def test_a_builtin_name_cannot_be_claimed(tmp_path: Path) -> None:
    source = (
        "from exportlm.engines import Engine\n"
        f"ENGINE = Engine('vllm', 'json', ('json',), {str(tmp_path / 'p.py')!r})\n"
    )
    (tmp_path / "p.py").write_text("")
    make_distribution(
        tmp_path,
        "evil",
        {engines.ENGINES_GROUP: {"vllm": "plug_vllm:ENGINE"}},
        {"plug_vllm.py": source},
    )
    code = (
        "import exportlm.engines as e, warnings; warnings.simplefilter('ignore');"
        "print(e.get_engine('vllm').worker); print(len(e.ENGINE_REGISTRY.plugin_errors))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["vllm_worker.py", "1"]


# -- support tables --------------------------------------------------------------


def test_vllm_refuses_modelopt_int8_and_awq_and_names_the_layout_it_takes() -> None:
    vllm = get_engine("vllm")
    for scheme in ("W8A16", "W4A16_AWQ"):
        match = vllm.support("hf_checkpoint", "modelopt", scheme)
        assert match.verdict is Verdict.REFUSED
        assert "ModelOpt currently only supports" in match.reason
        assert match.row is not None
        assert "compressed-tensors" in match.row.instead


def test_an_fp8_checkpoint_is_an_engine_limit_on_cpu_and_runs_on_cuda() -> None:
    vllm = get_engine("vllm")
    cpu = vllm.support("hf_checkpoint", "modelopt", "FP8", device="cpu")
    assert cpu.verdict is Verdict.ENGINE_LIMIT
    assert "AMX" in cpu.reason
    assert vllm.support("hf_checkpoint", "modelopt", "FP8", device="cuda").verdict is Verdict.RUNS


def test_a_dtype_or_artifact_outside_the_table_is_unknown_never_runs() -> None:
    vllm = get_engine("vllm")
    amx = frozenset({"amx_tile"})  # the row needs it (test_engines_cpu_features.py)
    w8a8 = vllm.support(
        "hf_checkpoint", "compressed-tensors", "W8A8", dtype="float16", cpu_features=amx
    )
    assert w8a8.verdict is Verdict.RUNS
    assert vllm.support("hf_checkpoint", "compressed-tensors", "W8A8").verdict is Verdict.UNKNOWN
    assert vllm.support("onnx", "plain").verdict is Verdict.UNKNOWN


def test_openvino_states_the_hints_it_needs() -> None:
    ov = get_engine("openvino")
    match = ov.support("onnx", "plain")
    assert match.verdict is Verdict.RUNS
    assert match.row is not None
    assert match.row.hints == {
        "INFERENCE_PRECISION_HINT": "f32",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
    }
    assert ov.hints == match.row.hints
    assert ov.support("onnx", "plain", "fp8").verdict is Verdict.ENGINE_LIMIT


# -- interpreter discovery ----------------------------------------------------------


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_environment_variable_names_the_interpreter_or_its_venv(tmp_path: Path) -> None:
    python = _executable(tmp_path / "venv" / "bin" / "python")
    assert engines.engine_env_var("tensorrt-llm") == "EXPORTLM_ENGINE_TENSORRT_LLM"
    for given in (python, tmp_path / "venv"):
        found = find_interpreter("vllm", environ={"EXPORTLM_ENGINE_VLLM": str(given)})
        assert (found.path, found.source) == (python, "env")


def test_an_explicit_option_wins_over_the_environment(tmp_path: Path) -> None:
    env_python = _executable(tmp_path / "a" / "python")
    opt_python = _executable(tmp_path / "b" / "python")
    found = find_interpreter(
        "vllm", {"vllm": str(opt_python)}, environ={"EXPORTLM_ENGINE_VLLM": str(env_python)}
    )
    assert (found.path, found.source) == (opt_python, "option")


def test_a_given_path_that_is_no_interpreter_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "python").write_text("")  # not executable
    for given in (tmp_path / "python", tmp_path / "nowhere"):
        with pytest.raises(EngineInterpreterError, match="EXPORTLM_ENGINE_VLLM") as info:
            find_interpreter("vllm", environ={"EXPORTLM_ENGINE_VLLM": str(given)})
        assert info.value.engine == "vllm"


def test_the_current_interpreter_runs_an_engine_that_imports_here(tmp_path: Path) -> None:
    found = find_interpreter(_fake(tmp_path), environ={})
    assert (found.path, found.source) == (Path(sys.executable), "current")


def test_no_interpreter_says_how_to_give_one(tmp_path: Path) -> None:
    found = find_interpreter(_fake(tmp_path, module="exportlm_no_such_engine"), environ={})
    assert found.path is None
    assert "EXPORTLM_ENGINE_FAKE" in found.reason
    assert "--export-engine fake=PATH" in found.reason


def test_a_dotted_engine_module_whose_package_is_missing_has_no_interpreter(
    tmp_path: Path,
) -> None:
    found = find_interpreter(_fake(tmp_path, module="exportlm_no_such_pkg.runtime"), environ={})
    assert found.path is None
    assert "exportlm_no_such_pkg.runtime does not import" in found.reason


def test_engine_options_parse_name_equals_path() -> None:
    assert parse_engine_options(["vllm=/opt/v/bin/python", "openvino = /x"]) == {
        "vllm": "/opt/v/bin/python",
        "openvino": "/x",
    }
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_engine_options(["/opt/v/bin/python"])
    with pytest.raises(ValueError, match="twice"):
        parse_engine_options(["vllm=/a", "vllm=/b"])
    with pytest.raises(UnknownNameError):
        parse_engine_options(["vlm=/a"])


# -- the request ---------------------------------------------------------------------


def test_a_request_left_pads_and_gives_the_prompts_back() -> None:
    req = EngineRequest.left_padded([[5, 6], [7, 8, 9]], pad_token_id=3)
    assert req.input_ids == ((3, 5, 6), (7, 8, 9))
    assert req.attention_mask == ((0, 1, 1), (1, 1, 1))
    assert req.prompts() == [[5, 6], [7, 8, 9]]


def test_a_request_refuses_right_padding_and_ragged_rows() -> None:
    with pytest.raises(ValueError, match="left padding"):
        EngineRequest(((1, 2, 0),), ((1, 1, 0),))
    with pytest.raises(ValueError, match="rectangle"):
        EngineRequest(((1, 2), (3,)), ((1, 1), (1,)))


# -- run_engine on fake workers -----------------------------------------------------


def test_an_answer_becomes_a_result_with_the_engine_version(tmp_path: Path, artifact: Path) -> None:
    result = run_engine(_fake(tmp_path), artifact, _request())
    assert result.engine == "fake"
    assert result.engine_version == PYTEST_VERSION
    assert result.tokens == [[7] * 4, [9] * 4, [5] * 4]
    assert result.logprobs == [[-1.5] * 2, [], [-1.5] * 4]


def test_a_refusal_carries_the_stage_version_and_engine_message(
    tmp_path: Path, artifact: Path
) -> None:
    with pytest.raises(EngineRefusedError) as info:
        run_engine(_fake(tmp_path), artifact, _request("refuse"))
    err = info.value
    assert (err.engine, err.version, err.stage) == ("fake", PYTEST_VERSION, "generate")
    assert err.detail == "ValueError: scheme 'W8A16' has no kernel here"
    assert "Traceback" not in str(err)


def test_an_option_the_worker_does_not_know_is_refused(tmp_path: Path, artifact: Path) -> None:
    with pytest.raises(EngineRefusedError, match="unknown engine options"):
        run_engine(_fake(tmp_path), artifact, _request(colour="blue"))


def test_a_crash_gives_the_exit_status_and_the_output_tail(tmp_path: Path, artifact: Path) -> None:
    with pytest.raises(EngineCrashedError) as info:
        run_engine(_fake(tmp_path), artifact, _request("crash"))
    assert info.value.returncode == 3
    assert info.value.version == PYTEST_VERSION
    assert "fatal: the kernel segfaulted" in info.value.detail


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_a_timeout_kills_the_worker_and_its_children(tmp_path: Path, artifact: Path) -> None:
    pidfile = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(EngineTimeoutError) as info:
        run_engine(_fake(tmp_path), artifact, _request("hang", pidfile=str(pidfile)), timeout=4)
    assert time.monotonic() - start < 30
    assert info.value.timeout == 4
    assert info.value.version == PYTEST_VERSION
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), f"the worker's child {child} outlived the timeout"


def test_an_engine_that_does_not_import_is_unavailable(tmp_path: Path, artifact: Path) -> None:
    engine = _fake(tmp_path, module="exportlm_no_such_engine")
    with pytest.raises(EngineUnavailableError, match="EXPORTLM_ENGINE_FAKE"):
        run_engine(engine, artifact, _request())
    with pytest.raises(EngineUnavailableError) as info:
        run_engine(engine, artifact, _request(), python=sys.executable)
    assert "No module named 'exportlm_no_such_engine'" in info.value.detail


@pytest.mark.parametrize("name", ["sglang", "tensorrt-llm"])
def test_the_gpu_only_stubs_report_that_they_cannot_import_here(name: str, artifact: Path) -> None:
    module = get_engine(name).module
    if find_interpreter(name).source == "current":
        pytest.skip(f"{module} imports here: this check is for machines without it")
    with pytest.raises(EngineUnavailableError) as info:
        run_engine(name, artifact, _request(), python=sys.executable)
    assert f"No module named '{module}'" in info.value.detail
    assert info.value.engine == name


@pytest.mark.parametrize(
    ("response", "match"),
    [
        ("not json", "not JSON"),
        (json.dumps({"protocol": 2, "status": "ok"}), "not protocol 1"),
        (json.dumps({"protocol": 1, "status": "ok", "tokens": [[1]], "logprobs": []}), "malformed"),
        (json.dumps({"protocol": 1, "status": "maybe"}), "unknown status"),
    ],
)
def test_an_answer_off_the_protocol_is_a_protocol_error(
    tmp_path: Path, artifact: Path, response: str, match: str
) -> None:
    worker = tmp_path / "raw.py"
    worker.write_text(f"import sys\nopen(sys.argv[2], 'w').write({response!r})\n")
    engine = Engine("raw", "json", (), str(worker))
    with pytest.raises(EngineProtocolError, match=match):
        run_engine(engine, artifact, _request())


def test_a_short_answer_is_a_protocol_error(tmp_path: Path, artifact: Path) -> None:
    with pytest.raises(EngineProtocolError, match="expected 4 new tokens"):
        run_engine(_fake(tmp_path), artifact, _request("short"))


def test_a_directory_that_would_run_its_own_code_never_reaches_an_engine(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.Model"}}))
    marker = tmp_path / "ran"
    worker = tmp_path / "w.py"
    worker.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(CustomCodeRefusedError):
        run_engine(Engine("w", "json", (), str(worker)), checkpoint, _request())
    assert not marker.exists()


def test_every_engine_error_names_the_engine_and_its_version() -> None:
    err = EngineRefusedError("vllm", "0.32.0", "load", "ValueError: no")
    assert isinstance(err, EngineError)
    assert str(err).startswith("vllm 0.32.0: refused the artifact at stage 'load'")


# -- the workers themselves -----------------------------------------------------------

ENGINE_IMPORTS = {
    "vllm",
    "transformers",
    "torch",
    "openvino",
    "optimum",
    "onnxruntime_genai",
    "numpy",
    "_worker",
}


def _worker_files() -> list[Path]:
    return sorted(WORKERS_DIR.glob("*.py"))


@pytest.mark.parametrize("path", _worker_files(), ids=lambda p: p.name)
def test_a_worker_imports_only_its_engine_numpy_and_the_standard_library(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    others = imported - ENGINE_IMPORTS - set(sys.stdlib_module_names)
    assert not others, f"{path.name} imports {sorted(others)}"


@pytest.mark.parametrize("path", _worker_files(), ids=lambda p: p.name)
def test_a_worker_never_trusts_remote_code(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
            assert isinstance(node.value, ast.Constant), path.name
            assert node.value.value is False, path.name


def test_the_workers_ship_in_the_wheel() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"engines/workers/*.py"' in textwrap.dedent(pyproject)
