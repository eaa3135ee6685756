"""PyTorch side of `bench_rows` (tape/examples/bench_rows.rs): softmax, log-softmax,
causal softmax, layer norm, cross-entropy, bias + GELU and bias + residual (eager, so
unfused), forward and backward, at the same shapes
and formats on the same GPU, each kernel timed with torch.profiler (CUDA time per
kernel) and printed as the same JSON lines: bytes are the arrays each kernel reads and
writes once, counted as bench_rows counts them, so the GB/s columns compare. Not run in
CI (torch is not installed there).

    python tape/benches/torch_rows_reference.py            # 8192x768 and 98304x1024
    python tape/benches/torch_rows_reference.py 8192x768
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

REPEATS = 20


def kernels(run):
    """CUDA time (µs) and launches of each kernel over REPEATS runs of `run`."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            run()
        torch.cuda.synchronize()
    return {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0}


def report(op, phase, shape, dtype, stats, bytes_per_run):
    """One line for the forward or backward kernels of `op` together (PyTorch may split
    an op into several kernels; their time adds up)."""
    total_us = sum(us for us, _ in stats.values())
    launches = sum(count for _, count in stats.values())
    print(json.dumps({
        "bench": "row_kernel", "impl": "torch", "op": op, "phase": phase,
        "kernels": sorted(stats), "rows": shape[0], "width": shape[1], "dtype": dtype,
        "launches": launches, "mean_us": total_us / REPEATS,
        "gbs": bytes_per_run * REPEATS / (total_us * 1e-6) / 1e9 if total_us else None,
    }))


def bench(rows, width, dtype):
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    size = torch.finfo(dtype).bits // 8
    n = rows * width
    x = torch.randn(rows, width, device="cuda").to(dtype).requires_grad_()
    upstream = torch.randn(rows, width, device="cuda").to(dtype)
    weight = torch.randn(width, device="cuda").to(dtype).requires_grad_()
    bias = torch.randn(width, device="cuda").to(dtype).requires_grad_()
    residual = torch.randn(rows, width, device="cuda").to(dtype)
    ops = {
        "softmax": lambda t: t.softmax(-1),
        "log_softmax": lambda t: t.log_softmax(-1),
        "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (width,), weight, bias, 1e-5),
        "bias_gelu": lambda t: torch.nn.functional.gelu(t + bias, approximate="tanh"),
    }
    if rows % width == 0:
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device="cuda"), 1)

        def causal(t):
            scores = t.view(rows // width, width, width) * 0.125
            return scores.masked_fill(mask, float("-inf")).softmax(-1).view(rows, width)

        ops["causal_softmax"] = causal
    for op, f in ops.items():
        forward = kernels(lambda: f(x))
        y = f(x)
        backward = kernels(lambda: torch.autograd.grad(y, [x], upstream, retain_graph=True))
        # Forward reads x, writes y; backward reads the gradient and y (or x), writes dx.
        report(op, "forward", (rows, width), name, forward, 2 * n * size)
        report(op, "backward", (rows, width), name, backward, 3 * n * size)
    # The residual branch's end has no backward kernel for x (the gradient passes through).
    report("bias_dropout_add", "forward", (rows, width), name,
           kernels(lambda: residual + (x + bias)), 3 * n * size)
    logits = torch.randn(rows, width, device="cuda", requires_grad=True)
    labels = torch.randint(0, width, (rows,), device="cuda")
    loss_of = lambda: torch.nn.functional.cross_entropy(logits, labels)
    loss = loss_of()
    report("cross_entropy", "forward", (rows, width), "f32", kernels(loss_of), 4 * n)
    backward = kernels(lambda: torch.autograd.grad(loss, [logits], retain_graph=True))
    report("cross_entropy", "backward", (rows, width), "f32", backward, 8 * n)


def main():
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:]] or [(8192, 768), (98304, 1024)]
    for rows, width in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            bench(rows, width, dtype)


if __name__ == "__main__":
    main()
