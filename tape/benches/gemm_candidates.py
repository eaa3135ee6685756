#!/usr/bin/env python3
"""PyTorch's single-thread f32 GEMM on the shapes of `tape/benches/gemm-candidates`
(best of 15), as the same Markdown rows:

    python3 tape/benches/gemm_candidates.py
"""
import time

import torch

CASES = [
    ("MLP forward x·W1", 64, 1024, 4096, False, False),
    ("MLP forward h·W2", 64, 4096, 1024, False, False),
    ("MLP backward g·W2ᵀ", 64, 1024, 4096, False, True),
    ("MLP backward hᵀ·g", 4096, 64, 1024, True, False),
    ("MLP backward xᵀ·g", 1024, 64, 4096, True, False),
    ("block QKV x·W", 1024, 512, 1536, False, False),
    ("block MLP up", 1024, 512, 2048, False, False),
    ("block MLP down", 1024, 2048, 512, False, False),
    ("block weight grad xᵀ·g", 512, 1024, 2048, True, False),
    ("attention scores q·kᵀ", 128, 64, 128, False, True),
]


def main():
    torch.set_num_threads(1)
    print("| product | m×k×n | PyTorch ms (GFLOP/s) |")
    print("|---|---|---:|")
    total = 0.0
    for name, m, k, n, transpose_a, transpose_b in CASES:
        a = torch.randn(k, m).t() if transpose_a else torch.randn(m, k)
        b = torch.randn(n, k).t() if transpose_b else torch.randn(k, n)
        best = float("inf")
        for _ in range(15):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        total += best
        print(f"| {name} | {m}×{k}×{n} | {best * 1e3:.2f} ({2 * m * n * k / best / 1e9:.0f}) |")
    print(f"| total | | {total * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
