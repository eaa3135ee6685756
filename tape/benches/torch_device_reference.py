"""PyTorch side of `bench_device` (tape/examples/bench_device.rs): the same GEMM and
tiny-op chain on the same GPU, printed as the same JSON lines. Run both in one command,
e.g. scripts/gpu-suite.sh does."""
import json
import sys
import time

import torch


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def gemm(n, tf32, dtype=torch.float32):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, n, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, n, device="cuda", generator=g).to(dtype)
    times = []
    for i in range(25):
        torch.cuda.synchronize()
        start = time.perf_counter()
        c = a @ b
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
        del c
    return median(times)


def tiny_ops(chain=1000):
    x = torch.rand(1024, device="cuda", requires_grad=True)
    s = torch.rand(1024, device="cuda", requires_grad=True)
    forward, backward = [], []
    for _ in range(20):
        x.grad = None
        s.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        y = x
        for i in range(chain):
            y = y * s if i % 2 == 0 else y + s
        loss = y.sum()
        torch.cuda.synchronize()
        forward.append((time.perf_counter() - start) * 1e6 / (chain + 1))
        start = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        backward.append((time.perf_counter() - start) * 1e6 / (chain + 1))
    return median(forward), median(backward)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    flops = 2.0 * n**3
    for tf32 in (False, True):
        ms = gemm(n, tf32)
        print(json.dumps({"bench": "gemm", "impl": "torch", "device": "cuda:0", "n": n,
                          "tf32": tf32, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}))
    n16 = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    ms = gemm(n16, False, torch.bfloat16)
    print(json.dumps({"bench": "gemm_bf16", "impl": "torch", "device": "cuda:0", "n": n16,
                      "ms": ms, "tflops": 2.0 * n16**3 / (ms * 1e-3) / 1e12}))
    fwd, bwd = tiny_ops()
    print(json.dumps({"bench": "tiny_ops", "impl": "torch", "device": "cuda:0",
                      "forward_us_per_op": fwd, "backward_us_per_node": bwd}))


if __name__ == "__main__":
    main()
