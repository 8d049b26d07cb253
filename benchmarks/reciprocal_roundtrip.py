"""How many float32 scales a stored float32 reciprocal can give back exactly.

compressed-tensors stores NVFP4's second-level scales as global scales (``1 / scale``);
a loader recovers the scale as ``1 / global_scale``. This counts, over log-uniform
float32 scales, how often ``fp32(1 / fp32(1 / s)) == s``, and how often *any* float32
``g`` near ``1 / s`` (up to 3 ulps either way) gives ``fp32(1 / g) == s``.

    python benchmarks/reciprocal_roundtrip.py
"""

from __future__ import annotations

import torch

N = 1_000_000
ULPS = 3


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    exponent = torch.empty(N, dtype=torch.float64).uniform_(-6, 3, generator=gen)
    s = (torch.rand(N, dtype=torch.float64, generator=gen) * 10**exponent).float()
    g = 1.0 / s
    candidates, up, down = [g], g, g
    for _ in range(ULPS):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        candidates += [up, down]
    exact = (1.0 / torch.stack(candidates)) == s
    print(f"{N} log-uniform float32 scales in [1e-6, 1e3]:")
    print(f"  1 / (1 / s) == s:                      {exact[0].float().mean():.2%}")
    print(f"  some g within {ULPS} ulps with 1 / g == s: {exact.any(0).float().mean():.2%}")


if __name__ == "__main__":
    main()
