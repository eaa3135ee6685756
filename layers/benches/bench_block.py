"""PyTorch reference for `cargo run --release -p ferrotron-layers --example bench_block`.

One pre-norm transformer block (hidden 512, 8 heads, sequence 128, batch 8), tensor
parallel over TP gloo processes on the CPU, Megatron-style: LN -> QKV column-parallel
(heads split) -> causal attention -> output row-parallel (all-reduce) -> residual ->
LN -> MLP 512->2048 column-parallel, tanh GELU, row-parallel -> residual.
Loss = sum of the output; forward + backward; median ms per step over >= 10 steps
after warm-up. Prints {"bench":"block_step","tp":T,"ms_per_step":F}.

    python layers/benches/bench_block.py --tp 2 --json
    python layers/benches/bench_block.py --device cuda --json   # the whole block, one GPU
    python layers/benches/bench_block.py --device cuda --bf16 --json   # in bf16

With --device cuda the block runs unsharded in this process on one GPU (the math of every
TP size), the reference for `bench_block --device cuda:0`.

Not run in this repository's CI (torch is not installed there).
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HIDDEN, HEADS, SEQ, BATCH = 512, 8, 128, 8


class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if dist.is_initialized():
            dist.all_reduce(grad)
        return grad


class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        if dist.is_initialized():
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def worker(rank, size, args, port, queue):
    device = torch.device(args.device)
    if size > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(args.threads)

    dtype = torch.bfloat16 if args.bf16 else torch.float32

    def shard(full, dim, rank, size):
        part = torch.tensor_split(full, size, dim=dim)[rank]
        return part.to(device=device, dtype=dtype).clone().requires_grad_()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        if size > 1:
            dist.barrier()

    gen = torch.Generator().manual_seed(0)
    std = 0.02
    qkv_w = shard(torch.randn(3 * HIDDEN, HIDDEN, generator=gen) * std, 0, rank, size)
    qkv_b = shard(torch.zeros(3 * HIDDEN), 0, rank, size)
    proj_w = shard(torch.randn(HIDDEN, HIDDEN, generator=gen) * std, 1, rank, size)
    proj_b = torch.zeros(HIDDEN, device=device, dtype=dtype, requires_grad=True)
    fc1_w = shard(torch.randn(4 * HIDDEN, HIDDEN, generator=gen) * std, 0, rank, size)
    fc1_b = shard(torch.zeros(4 * HIDDEN), 0, rank, size)
    fc2_w = shard(torch.randn(HIDDEN, 4 * HIDDEN, generator=gen) * std, 1, rank, size)
    fc2_b = torch.zeros(HIDDEN, device=device, dtype=dtype, requires_grad=True)
    ln = [
        torch.ones(HIDDEN, device=device, dtype=dtype, requires_grad=True),
        torch.zeros(HIDDEN, device=device, dtype=dtype, requires_grad=True),
    ] * 2
    params = [qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b, *ln]
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(device=device, dtype=dtype)
    local_heads, head_dim = HEADS // size, HIDDEN // HEADS
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).to(device)

    def step():
        h = F.layer_norm(x, (HIDDEN,), ln[0], ln[1])
        qkv = F.linear(CopyToRegion.apply(h), qkv_w, qkv_b)
        qkv = qkv.view(SEQ, BATCH, local_heads, 3, head_dim)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        ctx = (probs @ v).permute(2, 0, 1, 3).reshape(SEQ, BATCH, local_heads * head_dim)
        h1 = x + ReduceFromRegion.apply(F.linear(ctx, proj_w)) + proj_b
        m = F.layer_norm(h1, (HIDDEN,), ln[2], ln[3])
        inner = F.gelu(F.linear(CopyToRegion.apply(m), fc1_w, fc1_b), approximate="tanh")
        out = h1 + ReduceFromRegion.apply(F.linear(inner, fc2_w)) + fc2_b
        out.sum().backward()

    times = []
    for i in range(args.warmup + args.steps):
        for p in params:
            p.grad = None
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        queue.put(statistics.median(times))
    if size > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true", help="parameters and activations in bf16")
    args = parser.parse_args()
    if args.device == "cuda":
        import queue as queues

        results = queues.SimpleQueue()
        worker(0, 1, args, None, results)
        report(args, 1, results.get())
        return
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args.tp, args, port, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    median = queue.get()
    for p in procs:
        p.join()
    report(args, args.tp, median)


def report(args, tp, median):
    if args.json:
        print(json.dumps({"bench": "block_step", "impl": "torch", "device": args.device,
                          "dtype": "BF16" if args.bf16 else "F32", "tp": tp,
                          "ms_per_step": round(median, 3)}))
    else:
        print(f"block step tp {tp} on {args.device}: {median:.3f} ms")


if __name__ == "__main__":
    main()
