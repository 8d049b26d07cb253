"""Step 1 of ``check.sh``: print the environment; exit 2 unless this python can run CUDA.

The last line printed is the comma-separated list of registered export targets
that declare the ``cuda`` capability (what ``check.sh`` passes to
``--export-targets``). Installs nothing.
"""

from __future__ import annotations

import platform
import sys

#: Exit status when this python cannot run the CUDA subset.
NO_CUDA = 2


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return NO_CUDA


def main(device: str = "cuda") -> int:
    """Print the environment and the CUDA targets; ``NO_CUDA`` when CUDA cannot run.

    ``device="cpu"`` (a dry run of ``check.sh``) reports a missing CUDA and goes on.
    """
    print(f"python {platform.python_version()} at {sys.executable}")
    try:
        import torch
    except ImportError as err:
        return _fail(
            f"{sys.executable} cannot import torch ({err}); point PYTHON= at a python with a CUDA torch"
        )
    print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")
    if device == "cpu":
        print(f"dry run on the CPU (DEVICE=cpu); CUDA available: {torch.cuda.is_available()}")
        return _targets()
    if torch.version.cuda is None:
        return _fail(
            f"this torch is a CPU build (torch.version.cuda is None): install a CUDA torch, "
            f"or run with PYTHON=/path/to/python whose torch has CUDA ({sys.executable} has {torch.__version__})"
        )
    if not torch.cuda.is_available():
        return _fail(
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
            "(torch.cuda.is_available() is False): check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        total = torch.cuda.get_device_properties(index).total_memory / 2**30
        print(
            f"cuda:{index} {torch.cuda.get_device_name(index)}, capability {major}.{minor}, {total:.0f} GiB"
        )
    print(f"cuDNN {torch.backends.cudnn.version()}")
    fp8 = torch.cuda.get_device_capability(0) >= (8, 9)
    print(
        f"FP8 tensor cores (capability >= 8.9): {'yes' if fp8 else 'no: fp8_gemm will fail under --export-require-device'}"
    )
    return _targets()


def _targets() -> int:
    """Print exportlm's version and the targets declaring ``cuda`` (the last line)."""
    try:
        import exportlm
        from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered, get_target_info
    except ImportError as err:
        return _fail(
            f"{sys.executable} cannot import exportlm ({err}); install the repository into it (pip install -e '.[pytest]')"
        )
    ensure_exporters_registered()
    names = EXPORT_REGISTRY.names()
    cuda = sorted(n for n in names if get_target_info(n).has("cuda"))
    others = sorted(n for n in names if n not in cuda)
    print(
        f"exportlm {getattr(exportlm, '__version__', '?')}; targets declaring cuda: {', '.join(cuda) or 'none'}; CPU only: {', '.join(others) or 'none'}"
    )
    print(",".join(cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
