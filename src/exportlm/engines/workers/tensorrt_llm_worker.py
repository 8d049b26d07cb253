"""tensorrt-llm worker (a stub): reports whether tensorrt-llm imports in this interpreter.

tensorrt-llm runs on GPU runners only. Where it does not import, the response is
``unavailable`` with the import error; where it does, the adapter is not written
yet and the response is ``refused`` at stage ``load`` saying so, so a GPU runner
that enables it gets a named failure, never a silent pass (``docs/engines.md``).
"""

from __future__ import annotations

import sys

import _worker


def serve(ctx: _worker.Context) -> tuple[list[list[int]], list[list[float]]]:
    """Refuse: this adapter is a stub."""
    raise NotImplementedError(
        "the exportlm tensorrt-llm adapter is a stub: tensorrt-llm imports here, but serving an "
        "artifact through it is not implemented yet"
    )


if __name__ == "__main__":
    sys.exit(_worker.main("tensorrt-llm", "tensorrt_llm", ("tensorrt-llm",), serve))
