#!/usr/bin/env python3
"""PyTorch reference for `cargo run --release -p ferrotron-tape --example bench_tape -- --json`.

Runs the same two benchmarks on one CPU thread (`--threads N` for more) and prints the
same JSON keys, one object per line:

    python3 tape/benches/torch_reference.py [--threads N]
"""
import argparse
import json
import resource
import statistics
import time

import torch

CHAIN_LEN = 1000
WIDTH = 1024


def tiny_ops():
    """Best-of-20 forward µs per op and backward µs per node of an elementwise chain."""
    x = torch.empty(WIDTH).uniform_(-1.0, 1.0).requires_grad_()
    s = torch.empty(WIDTH).uniform_(0.5, 0.9).requires_grad_()
    best_fwd = best_bwd = float("inf")
    for _ in range(20):
        x.grad = None
        s.grad = None
        start = time.perf_counter()
        y = x
        for i in range(CHAIN_LEN):
            y = y * s if i % 2 == 0 else y + s
        loss = y.sum()
        forward = time.perf_counter() - start
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - start
        best_fwd = min(best_fwd, forward * 1e6 / (CHAIN_LEN + 1))
        best_bwd = min(best_bwd, backward * 1e6 / (CHAIN_LEN + 1))
    return best_fwd, best_bwd


def mlp_step():
    """Median ms per step (after 5 warm-up steps, 20 timed) of the 1024→4096→1024 MLP."""
    torch.manual_seed(2)
    w1 = (torch.randn(1024, 4096) * 0.02).requires_grad_()
    b1 = torch.zeros(4096, requires_grad=True)
    w2 = (torch.randn(4096, 1024) * 0.02).requires_grad_()
    b2 = torch.zeros(1024, requires_grad=True)
    x = torch.randn(64, 1024)
    target = torch.randn(64, 1024)
    sgd = torch.optim.SGD([w1, b1, w2, b2], lr=1e-3)
    times = []
    for step in range(25):
        start = time.perf_counter()
        h = torch.relu(x @ w1 + b1)
        y = h @ w2 + b2
        loss = ((y - target) ** 2).mean()
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        if step >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return statistics.median(times), peak_rss_mb


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(parser.parse_args().threads)
    fwd, bwd = tiny_ops()
    ms, rss = mlp_step()
    print(json.dumps({"bench": "tiny_ops", "fwd_us_per_op": round(fwd, 3), "bwd_us_per_node": round(bwd, 3)}))
    print(json.dumps({"bench": "mlp_step", "ms_per_step": round(ms, 3), "peak_rss_mb": round(rss, 1)}))


if __name__ == "__main__":
    main()
