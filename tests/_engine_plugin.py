"""A third-party engine plugin, written as a user would from docs/engines.md.

:func:`make_engine_plugin` writes a distribution ``toy-engine`` under a directory: its
``exportlm.engines`` entry point names an :class:`~exportlm.engines.Engine` with its
support table, its tolerance (with the measurement it rests on) and its worker: a
script speaking the worker protocol (version 1) that computes the logits in its own
process (transformers for a checkpoint, onnxruntime for an ONNX graph). ``drop_mask=True`` plants a bug: the worker leaves out
the attention mask (and position ids), so a left-padded row attends to its padding.
"""

from __future__ import annotations

from pathlib import Path

from tests._distinfo import make_distribution

__all__ = [
    "BROKEN",
    "ENGINE",
    "engine_worker",
    "make_broken_engine_plugin",
    "make_engine_plugin",
]

#: The plugin's engine name (its ``served`` items: ``served[<target>-toy-engine-<family>-cpu]``).
ENGINE = "toy-engine"

_RECORD = """
from pathlib import Path

from exportlm.engines import Engine, Support, Tolerance

ENGINE = Engine(
    name="toy-engine",
    module="transformers",
    distributions=("toy-engine",),
    worker=str(Path(__file__).with_name("toy_engine_worker.py")),
    table=(
        Support("hf_checkpoint", evidence="measured: the toy engine's own test"),
        {extra_rows}
    ),
    tolerances=(
        Tolerance(1e-4, "measured 1e-6 on the toy llama (float32, transformers in-process)"),
        {extra_tolerances}
    ),
)
"""

_WORKER = """
import json
import os
import sys


def write(path, response):
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        json.dump({"protocol": 1, "engine": "toy-engine", "engine_version": "1.0", **response}, out)
    os.replace(path + ".tmp", path)


def load(artifact):
    # (input_ids, attention_mask, position_ids) -> logits: a checkpoint through
    # transformers, an ONNX graph through onnxruntime
    import torch

    if artifact.endswith(".onnx"):
        import onnxruntime

        session = onnxruntime.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}

        def run(ids, mask, pos):
            given = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
            feed = {k: v.numpy() for k, v in given.items() if k in names and v is not None}
            if "attention_mask" in names and mask is None:
                feed["attention_mask"] = torch.ones_like(ids).numpy()
            return torch.from_numpy(session.run(None, feed)[0])

        return run
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        artifact, local_files_only=True, trust_remote_code=False, dtype=torch.float32
    ).eval()
    return lambda ids, mask, pos: model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def serve(req):
    import torch

    model = load(req["artifact"])
    ids = torch.tensor(req["input_ids"])
    mask = torch.tensor(req["attention_mask"])
    first = (mask == 0).sum(-1)
    with torch.no_grad():
        logprobs = []
        scored = forward(model, ids, mask)
        lp = torch.log_softmax(scored.double(), dim=-1)[:, :-1]
        picked = lp.gather(-1, ids[:, 1:, None])[..., 0]
        logprobs = [picked[r, int(first[r]):].tolist() for r in range(ids.shape[0])]
        new = []
        for _ in range(int(req["max_new_tokens"])):
            nxt = forward(model, ids, mask)[:, -1].argmax(-1)
            new.append(nxt.tolist())
            ids = torch.cat([ids, nxt[:, None]], dim=-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    tokens = [list(row) for row in zip(*new)] if new else [[] for _ in logprobs]
    return tokens, logprobs


def forward(model, ids, mask):
    if DROP_MASK:  # the planted bug: the padding is attended to
        return model(ids, None, None)
    return model(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))


DROP_MASK = {drop_mask}
request = json.load(open(sys.argv[1], encoding="utf-8"))
write(sys.argv[2], {{"status": "running"}})
if request.get("action") == "probe":
    write(sys.argv[2], {{"status": "ok"}})
else:
    try:
        tokens, logprobs = serve(request)
    except Exception as err:
        write(sys.argv[2], {{"status": "refused", "stage": "run", "error": repr(err)}})
    else:
        write(sys.argv[2], {{"status": "ok", "tokens": tokens, "logprobs": logprobs}})
"""


def engine_worker(*, drop_mask: bool = False) -> str:
    """The toy engine's worker script (also the worker of docs/architecture.md's
    "How to add an engine"); ``drop_mask=True`` plants the attention-mask bug."""
    return _WORKER.replace("{drop_mask}", repr(drop_mask)).replace("{{", "{").replace("}}", "}")


def make_engine_plugin(
    root: Path, *, drop_mask: bool = False, extra_rows: str = "", extra_tolerances: str = ""
) -> Path:
    """Write the ``toy-engine`` distribution under ``root``; returns ``root``.

    ``extra_rows`` / ``extra_tolerances``: more ``Support(...)`` / ``Tolerance(...)``
    entries of its record (each ending in a comma).
    """
    record = _RECORD.format(extra_rows=extra_rows, extra_tolerances=extra_tolerances)
    make_distribution(
        root,
        "toy-engine",
        {"exportlm.engines": {ENGINE: "toy_engine:ENGINE"}},
        {
            "toy_engine.py": record,
            "toy_engine_worker.py": engine_worker(drop_mask=drop_mask),
        },
    )
    return root


#: The name of the engine plugin :func:`make_broken_engine_plugin` writes.
BROKEN = "broken-engine"


def make_broken_engine_plugin(root: Path) -> Path:
    """Write a distribution ``broken-engine-dist`` whose engine entry point fails to import."""
    make_distribution(
        root,
        "broken-engine-dist",
        {"exportlm.engines": {BROKEN: "broken_engine:ENGINE"}},
        {"broken_engine.py": "raise ImportError('broken_engine needs libengine.so')\n"},
    )
    return root
