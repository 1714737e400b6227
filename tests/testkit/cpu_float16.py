"""Float16 on a CPU without oneDNN's float16 kernels, for the live tests of float16 paths: in a rank started with
:data:`FLOAT16_ENV` set to ``1``, DeepSpeed's CPU accelerator reports float16 support, as it does on a CPU with
AVX-512 FP16 or AMX (torch computes float16 on any CPU, more slowly), and llmrl's config check, which asks the
accelerator, lets ``dtype: float16`` with ``devices: cpu`` through. Nothing changes in a rank without it."""

from __future__ import annotations

import os

FLOAT16_ENV = "LLMRL_TEST_CPU_FLOAT16"


def allow_if_asked() -> None:
    if os.environ.get(FLOAT16_ENV) == "1":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda self: True
