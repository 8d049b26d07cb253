"""AWQ's per-input-channel activation statistics of a quantizer (its mixin)."""

from __future__ import annotations

import torch

__all__ = ["ChannelStatistics"]


class ChannelStatistics:
    """:attr:`channel_amax`, the per-channel ``mean(|x|)`` sums and their reset, kept by a
    :class:`~exportlm.quant.TensorQuantizer` that tracks channels (AWQ smoothing)."""

    channel_amax: torch.Tensor | None
    channel_sum: torch.Tensor | None
    channel_steps: torch.Tensor | None
    channel_experts: int | None

    def add_channel_mean(self, mean: torch.Tensor, expert: int | None = None) -> None:
        """Add one forward's per-channel ``mean(|x|)`` to :attr:`channel_sum` (of ``expert``).

        The sum is float64: a float64 sum of float32 means is exact (while a channel's
        means lie within 2**29 of each other), so it does not depend on the order of
        the forwards, and data-parallel ranks' sums add up to one process's bit for bit.
        """
        mean = mean.double()
        total, steps = self.channel_sum, self.channel_steps
        if total is None or steps is None:
            rows = () if expert is None else (self.channel_experts or expert + 1,)
            total = mean.new_zeros((*rows, mean.shape[-1]))
            steps = torch.zeros(rows, dtype=torch.float32, device=mean.device)
        if expert is None:
            total, steps = total + mean, steps + 1
        else:
            at = torch.tensor([expert], device=total.device)
            total, steps = total.index_add(0, at, mean[None]), steps.clone()
            steps[expert] += 1
        self.channel_sum, self.channel_steps = total, steps

    @property
    def channel_mean(self) -> torch.Tensor | None:
        """The per-channel activation statistic of AWQ: the mean over calibration forwards
        of ``mean(|x|)`` (rows of an expert that saw no token are zero), or ``None``."""
        if self.channel_sum is None or self.channel_steps is None:
            return None
        steps = self.channel_steps.clamp(min=1)
        return self.channel_sum / (steps if steps.dim() == 0 else steps[:, None])

    def reset_channels(self) -> None:
        """Forget the per-channel statistics (:attr:`channel_amax`, :attr:`channel_mean`)."""
        self.channel_amax = None
        self.channel_sum = None
        self.channel_steps = None
