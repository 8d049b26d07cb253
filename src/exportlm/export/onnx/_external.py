"""External data under a content-unique name, so a graph never reads another export's weights.

torch.onnx writes the weights of a large model to ``<file>.data``. Published under that
fixed name, a crash between publishing the data and the graph (or two writers racing)
would pair the old graph with the new weights. Renamed to ``<file>.<sha256[:16]>.data``
and referenced by that name from the graph, each graph names exactly the bytes it was
exported with; :func:`~exportlm.atomic.atomic_output` publishes the data before the
graph and removes data files that no published graph uses.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.export.manifest import file_sha256

__all__ = ["name_external_data_by_content"]


def _tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of ``graph`` (initializers and node attributes), subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _tensors(sub)


def name_external_data_by_content(path: Path) -> None:
    """Rename ``<path>.data`` to ``<path>.<sha256[:16]>.data`` and point ``path``'s graph at it.

    ``path`` is the staged graph; a graph without ``<path>.data`` is left alone.
    Needs the ``onnx`` package (checked by the caller before the export starts).
    """
    import onnx

    data = path.with_name(f"{path.name}.data")
    if not data.is_file():
        return
    unique = f"{path.name}.{file_sha256(data)[:16]}.data"
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in _tensors(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value == data.name:
                    entry.value = unique
    os.replace(data, data.with_name(unique))
    onnx.save_model(proto, str(path))  # tensors stay external: no raw data is loaded
