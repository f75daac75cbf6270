"""One line naming the machine a benchmark ran on: CPU model, the instruction sets that decide
which kernels run (AMX and AVX512-BF16 make bfloat16 native, see ``engine.config.auto_dtype``;
AVX2-only CPUs emulate it), cores, Python, and the CUDA device where one is seen. Figures from two
CPUs are not comparable."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    import torch

    isa = [name for name, has in (("AMX", torch.cpu._is_amx_tile_supported()),
                                  ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                  ("AVX512", torch.cpu._is_avx512_supported()),
                                  ("AVX2", torch.cpu._is_avx2_supported())) if has]
    gpu = f", CUDA: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu_model()} ({', '.join(isa[:2]) or 'no AVX2'}), {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}{gpu}")
