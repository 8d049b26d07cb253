"""GPTQ's Hessian statistics: one ``X^T X`` per calibration *input*, shared by its readers.

``q_proj``, ``k_proj`` and ``v_proj`` read the very same tensor (and so do ``gate_proj``
and ``up_proj``), so their Hessians are one matrix: :func:`collect_hessians` hooks every
linear :func:`~exportlm.quant._gptq_apply.mark_gptq` marked, and a linear that on its
first forward reads the tensor another marked linear just read joins that linear's
:class:`HessianStat` (a tensor is recognized by its identity while alive, as the AWQ
Gram loss and the calibration's groups recognize it). Each input then costs one float64
``X^T X`` and one ``[in, in]`` matrix where each reader paid its own (three for the
attention's input). The statistic is the one each reader would have summed alone: the
same products of the same rows added in the same order, so the Hessian and GPTQ's codes
are bit for bit those of a statistic per linear.

A linear that shares a statistic must keep reading its leader's tensor (the linear that
started the statistic), as often as the leader does: one that later reads another tensor,
or reads it more or fewer times, cannot share (its own sum was not kept), and GPTQ stops
with a :class:`~exportlm.errors.QuantizationError` naming both (:meth:`HessianStat.check`
at the end of the calibration forwards).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from exportlm.errors import DistributedCalibrationError, QuantizationError
from exportlm.quant._distributed import data_parallel_world
from exportlm.quant._modules import QuantLinear

__all__ = ["HessianStat", "Hessians", "collect_hessians", "reduce_hessians"]


class HessianStat:
    """``sum X^T X`` (float64) of one input's calibration tensors and their token count,
    with the linears that read that input (``readers``: their names, the leader first)."""

    def __init__(self, leader: str) -> None:
        self.gram: torch.Tensor | None = None
        self.tokens = 0
        self.readers: list[str] = [leader]
        self._last: weakref.ref[torch.Tensor] | None = None
        self._reads: dict[str, int] = {}  # how often each reader read the last tensor

    def add(self, x: torch.Tensor) -> None:
        """Add one forward's input ``x`` (``[..., in]``)."""
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        if rows.shape[0] == 0:
            return
        g = rows.T @ rows
        self.gram = g if self.gram is None else self.gram.add_(g)
        self.tokens += int(rows.shape[0])

    def read(self, name: str, x: torch.Tensor) -> None:
        """Reader ``name`` reads ``x``: the leader adds it; another reader must read the
        tensor the leader read last, as often as the leader did (it is already counted)."""
        leader = self.readers[0]
        if name == leader:
            if not self.reads_last(x):
                self.check()
                self._last, self._reads = weakref.ref(x), {}
            self._reads[name] = self._reads.get(name, 0) + 1
            self.add(x)
            return
        count = self._reads.get(name, 0) + 1
        if not self.reads_last(x) or count > self._reads.get(leader, 0):
            raise self._apart(name)
        self._reads[name] = count

    def check(self) -> None:
        """Every reader read the leader's last tensor as often as the leader did."""
        want = self._reads.get(self.readers[0], 0)
        for name in self.readers[1:]:
            if self._reads.get(name, 0) != want:
                raise self._apart(name)

    def _apart(self, name: str) -> QuantizationError:
        return QuantizationError(
            f"GPTQ: {name} read the same input tensor as {self.readers[0]} on its first "
            "calibration forward and not on a later one; GPTQ keeps one Hessian per input, "
            "shared by the linears that read it, so each must read what the first one reads, "
            f"as often. Give one of them another recipe ({{{name!r}: 'int4_awq'}}) or "
            "exclude it."
        )

    def reads_last(self, x: torch.Tensor) -> bool:
        """``x`` is the tensor the leader read last (and it is still alive)."""
        return self._last is not None and self._last() is x

    def hessian(self) -> torch.Tensor | None:
        """``2 X^T X / n``, float64, or ``None`` when no token was seen."""
        if self.gram is None or self.tokens == 0:
            return None
        return self.gram * (2.0 / self.tokens)


class Hessians:
    """The marked linears (by name) and the statistic of the input each reads."""

    def __init__(self) -> None:
        self.linears: dict[str, QuantLinear] = {}
        self.stat_of: dict[str, HessianStat] = {}
        self._stats: list[HessianStat] = []

    def __bool__(self) -> bool:
        return bool(self.linears)

    @property
    def stats(self) -> list[HessianStat]:
        """Each statistic once, in the order their leaders first read."""
        return list(self._stats)

    def read(self, name: str, x: torch.Tensor) -> None:
        """Linear ``name`` reads ``x``; on its first read it joins the statistic whose
        leader read ``x`` last, or starts its own."""
        stat = self.stat_of.get(name)
        if stat is None:
            stat = next((s for s in reversed(self._stats) if s.reads_last(x)), None)
            if stat is None:
                stat = HessianStat(name)
                self._stats.append(stat)
            else:
                stat.readers.append(name)
            self.stat_of[name] = stat
        stat.read(name, x)

    def check(self) -> None:
        """Every statistic's readers read its leader's last tensor as the leader did."""
        for stat in self._stats:
            stat.check()

    def regroup(self, leader_of: dict[str, str]) -> None:
        """A statistic for every leader of ``leader_of`` (``{reader: its leader}``), with its
        readers in module order, the sums kept where this process has them."""
        old = {stat.readers[0]: stat for stat in self._stats}
        self._stats, self.stat_of = [], {}
        for name in self.linears:
            leader = leader_of.get(name)
            if leader is None:
                continue
            if leader == name:
                stat = HessianStat(name)
                if name in old:
                    stat.gram, stat.tokens = old[name].gram, old[name].tokens
                self._stats.append(stat)
            else:
                stat = self.stat_of[leader]
                stat.readers.append(name)
            self.stat_of[name] = stat


def collect_hessians(
    model: nn.Module, handles: list[torch.utils.hooks.RemovableHandle], marked: str
) -> Hessians:
    """Hook every linear with the attribute ``marked`` (the hooks appended to ``handles``);
    the statistics fill as the calibration forwards run (empty without a GPTQ recipe)."""
    hessians = Hessians()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and getattr(module, marked, None):
            hessians.linears[name] = module
            handles.append(module.register_forward_pre_hook(_hook(hessians, name)))
    return hessians


def _hook(hessians: Hessians, name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            hessians.read(name, args[0])

    return hook


def reduce_hessians(hessians: Hessians) -> None:
    """Each statistic summed over the data-parallel ranks, in rank order (alone: nothing).

    The ranks agree first on who reads whose input (a rank whose linears no token reached
    has no statistic for them), then sum each leader's ``X^T X`` and token count, so every
    rank quantizes from the same float64 Hessians.
    """
    world = data_parallel_world()
    if world is None:
        return
    import torch.distributed as dist

    local = {
        name: (stat.readers[0], stat.tokens, 0 if stat.gram is None else int(stat.gram.shape[0]))
        for name, stat in hessians.stat_of.items()
    }
    gathered: list[dict[str, tuple[str, int, int]] | None] = [None] * world[1]
    dist.all_gather_object(gathered, local)
    leader_of: dict[str, str] = {}
    for rank, part in enumerate(gathered):
        for name, (leader, _, _) in (part or {}).items():
            if leader_of.setdefault(name, leader) != leader:
                raise DistributedCalibrationError(
                    f"rank {rank}: {name} shares the Hessian of {leader}, another rank's of "
                    f"{leader_of[name]}: every rank must quantize the same model with the "
                    "same recipe and calibration code"
                )
    hessians.regroup(leader_of)
    for stat in hessians.stats:
        leader = stat.readers[0]
        entries = [(part or {}).get(leader, (leader, 0, 0)) for part in gathered]
        width = max(entry[2] for entry in entries)
        if width == 0:
            continue
        mine = stat.gram
        parts = [torch.empty(width, width, dtype=torch.float64) for _ in range(world[1])]
        dist.all_gather(
            parts,
            (
                torch.zeros(width, width, dtype=torch.float64) if mine is None else mine.cpu()
            ).contiguous(),
        )
        total = parts[0]
        for piece in parts[1:]:
            total = total + piece
        stat.gram = total.to(mine.device if mine is not None else torch.device("cpu"))
        stat.tokens = sum(entry[1] for entry in entries)
