"""bf16 against fp32 on this CPU: the measurement behind ``dtype: auto`` (schemas/precision.py).

    .venv/bin/python benchmarks/bf16_cpu.py [--seconds 3] [--threads 1]

A 512x576 @ 576x1536 matmul (the default model's hidden x MLP width) forward + backward, one thread, timed in each
dtype for ``--seconds``. On CPUs without native bf16 (AVX2 only) torch emulates bf16 and it runs many times slower;
with AVX-512 BF16 or AMX it is faster than fp32. Last line: ``RESULT fp32_per_s=.. bf16_per_s=.. slowdown=..
native_bf16=..``.
"""

from __future__ import annotations

import argparse
import time

import torch

from schemas.precision import detect


def rate(dtype: torch.dtype, seconds: float) -> float:
    """Forward + backward products per second of the benchmark matmul in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 576, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(576, 1536, generator=gen).to(dtype).requires_grad_()
    (x @ w).sum().backward()  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        (x @ w).sum().backward()
        done += 1
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hw = detect()
    fp32, bf16 = rate(torch.float32, args.seconds), rate(torch.bfloat16, args.seconds)
    print(f"{hw.name}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s)")
    print(f"fp32 {fp32:.2f}/s, bf16 {bf16:.2f}/s: bf16 is {fp32 / bf16:.1f}x slower")
    print(f"RESULT fp32_per_s={fp32:.2f} bf16_per_s={bf16:.2f} slowdown={fp32 / bf16:.2f} "
          f"native_bf16={int(hw.native_bf16)}")


if __name__ == "__main__":
    main()
