"""All-or-nothing ``quantize``: a snapshot of what it may change, restored on failure.

:func:`~exportlm.quant.quantize` converts modules in place (their class is swapped,
quantizer submodules and a few plain attributes are added) and then runs the user's
calibration forwards. If any step fails, :func:`quantize_transaction` puts every
module back exactly as it was: its class, plain attributes, children, parameters
(the same ``Parameter`` objects), buffers (the same objects, with their values as
before) and training flag. The failure is re-raised as a
:class:`~exportlm.errors.QuantizationError` that names the step that failed.

Parameters are restored by identity, not by value: copying every weight of a large
model to guard against a ``calibrate`` function that writes into one would double its
memory. ``quantize`` itself writes into a parameter's data only through
:func:`overwrite` (AWQ's clip search clamps a few elements of a weight in place), which
journals the elements it changes and their old values, so a failure puts them back; a
weight replaced by a new ``Parameter`` would keep both alive until ``quantize`` returns
(one more copy of every clipped weight at the peak of a streamed layer). Buffers are
small (rotary frequencies, position ids, running statistics) and a forward pass may
update them in place, so their values are copied and put back.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from exportlm.errors import QuantizationError

__all__ = ["ModelSnapshot", "QuantizeSteps", "overwrite", "quantize_transaction"]

#: ``(destination view, coordinates of the changed elements [n, dims], their old values)``
#: of every :func:`overwrite` of the ``quantize`` call running in this context.
_Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_JOURNAL: contextvars.ContextVar[list[_Entry] | None] = contextvars.ContextVar(
    "exportlm_quantize_journal", default=None
)


def overwrite(destination: torch.Tensor, values: torch.Tensor) -> int:
    """Write ``values`` into ``destination`` (a parameter or a view of one) in place; inside
    :func:`quantize_transaction` the elements that change are journaled (their coordinates
    and old values, not the whole tensor), so a failed ``quantize`` writes them back.
    Returns how many elements changed."""
    with torch.no_grad():
        target = destination.detach()
        where = (target != values).nonzero()
        if where.numel() == 0:
            return 0
        journal = _JOURNAL.get()
        if journal is not None:
            journal.append((target, where, target[tuple(where.T)].clone()))
        target.copy_(values)
    return int(where.shape[0])


def _unwind(journal: list[_Entry]) -> None:
    with torch.no_grad():
        for target, where, old in reversed(journal):
            target[tuple(where.T)] = old
    journal.clear()


_ROLLED_BACK = (
    "quantize() restored the model to its state before the call (module types, "
    "parameters, buffers); fix the cause and call quantize() again"
)


@dataclass
class _ModuleState:
    module: nn.Module
    cls: type[nn.Module]
    training: bool
    attributes: dict[str, object]
    children: dict[str, nn.Module]
    parameters: dict[str, nn.Parameter]
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # (object, copy of its values)

    @classmethod
    def take(cls, module: nn.Module) -> _ModuleState:
        # vars() lists an nn.Module's plain attributes beside its private registries;
        # parameters, buffers and children are read through the public accessors.
        attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        return cls(
            module=module,
            cls=type(module),
            training=module.training,
            attributes=attributes,
            children=dict(module.named_children()),
            parameters=dict(module.named_parameters(recurse=False)),
            buffers={
                name: (buffer, buffer.detach().clone())
                for name, buffer in module.named_buffers(recurse=False)
            },
        )

    def restore(self) -> None:
        module = self.module
        if type(module) is not self.cls:
            module.__class__ = self.cls
        self._restore_registered(module)
        for name in [k for k in vars(module) if not k.startswith("_")]:
            if name not in self.attributes:
                delattr(module, name)
        for name, value in self.attributes.items():
            if vars(module).get(name, _MISSING) is not value:
                setattr(module, name, value)
        module.training = self.training

    def _restore_registered(self, module: nn.Module) -> None:
        for name, _ in list(module.named_children()):
            if name not in self.children:
                delattr(module, name)
        for name, child in self.children.items():
            if getattr(module, name, None) is not child:
                setattr(module, name, child)
        for name, _ in list(module.named_parameters(recurse=False)):
            if name not in self.parameters:
                delattr(module, name)
        for name, param in self.parameters.items():
            if getattr(module, name, None) is not param:
                setattr(module, name, param)
        for name, _ in list(module.named_buffers(recurse=False)):
            if name not in self.buffers:
                delattr(module, name)
        with torch.no_grad():
            for name, (buffer, values) in self.buffers.items():
                if getattr(module, name, None) is not buffer:
                    module.register_buffer(name, buffer)
                if buffer.shape != values.shape:
                    buffer.set_(values)  # type: ignore[call-overload]  # stubs lack set_(Tensor)
                elif not torch.equal(buffer, values):
                    buffer.copy_(values)


_MISSING = object()


@dataclass
class ModelSnapshot:
    """The state of every module of a model that ``quantize`` may change."""

    states: list[_ModuleState]

    @classmethod
    def take(cls, model: nn.Module) -> ModelSnapshot:
        """Record ``model`` and each of its submodules (shared ones once)."""
        return cls([_ModuleState.take(m) for m in model.modules()])

    def restore(self) -> None:
        """Put every recorded module back as it was when the snapshot was taken."""
        for state in self.states:
            state.restore()


@dataclass
class QuantizeSteps:
    """Which step of ``quantize`` is running, for the message of a failure."""

    current: str = "preparation"
    done: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Mark ``name`` as the running step for the duration of the block."""
        self.current = name
        yield
        self.done.append(name)


@contextlib.contextmanager
def quantize_transaction(model: nn.Module) -> Iterator[QuantizeSteps]:
    """Run the block on ``model``; on any failure restore it and say which step failed.

    A :class:`QuantizationError` (or subclass) keeps its type and message and gains
    a note naming the step and the rollback; any other exception (e.g. from the
    user's ``calibrate``) is wrapped in a :class:`QuantizationError` chained to it.
    ``KeyboardInterrupt`` and other ``BaseException`` s restore the model and
    propagate unchanged.
    """
    snapshot = ModelSnapshot.take(model)
    steps = QuantizeSteps()
    journal: list[_Entry] = []
    token = _JOURNAL.set(journal)
    try:
        yield steps
    except Exception as err:
        snapshot.restore()
        _unwind(journal)
        what = f"quantize() failed during {steps.current}"
        if isinstance(err, QuantizationError):
            err.add_note(f"{what}; {_ROLLED_BACK}.")
            raise
        raise QuantizationError(
            f"{what}: {type(err).__name__}: {err}. {_ROLLED_BACK} (the chained exception "
            "has the traceback)."
        ) from err
    except BaseException:
        snapshot.restore()
        _unwind(journal)
        raise
    finally:
        _JOURNAL.reset(token)
        journal.clear()  # a success keeps every write
