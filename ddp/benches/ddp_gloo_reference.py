"""PyTorch DDP (gloo, CPU) reference for `cargo run --release -p ferrotron-ddp --example bench_ddp`.

Same model and measurement: 8 x (Linear(1024, 1024) + relu), batch 32 per rank, loss =
mean of the output, bucket cap 4 MiB; a step is forward + backward (+ the sync where
named), median over the timed steps on rank 0 with a barrier before each step.

* backward           -- no sync (plain module, no DDP)
* backward_then_sync -- DDP inside no_sync(), then one all_reduce per bucket-sized chunk
                        of flattened gradients after backward (what DDP would do without
                        overlap)
* overlapped         -- DDP as normally used

    python ddp/benches/ddp_gloo_reference.py --ranks 2 --json

Not run in ferrotron's CI (torch is not installed there); kept for comparison by hand.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, LAYERS, BATCH, BUCKET_CAP_MB = 1024, 8, 32, 4


def model():
    torch.manual_seed(1)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def sync_after_backward(module):
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    cap = BUCKET_CAP_MB * 1024 * 1024 // 4
    chunk = []
    for grad in reversed(grads):
        chunk.append(grad)
        if sum(g.numel() for g in chunk) >= cap:
            flush(chunk)
            chunk = []
    if chunk:
        flush(chunk)


def flush(chunk):
    flat = torch.cat([g.reshape(-1) for g in chunk])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in chunk:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def time_mode(mode, rank, steps):
    module = model()
    ddp = None
    if mode != "backward":
        ddp = DDP(module, bucket_cap_mb=BUCKET_CAP_MB)
    torch.manual_seed(10 + rank)
    x = torch.randn(BATCH, WIDTH)
    times = []
    for step in range(steps + 2):
        module.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if mode == "backward":
            module(x).mean().backward()
        elif mode == "backward_then_sync":
            with ddp.no_sync():
                ddp(x).mean().backward()
            sync_after_backward(module)
        else:
            ddp(x).mean().backward()
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def worker(rank, args, results):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    figures = {m: time_mode(m, rank, args.steps) for m in ("backward", "backward_then_sync", "overlapped")}
    if rank == 0:
        results.update(figures)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, results), nprocs=args.ranks)
        backward, then_sync, overlapped = (
            results["backward"],
            results["backward_then_sync"],
            results["overlapped"],
        )
    cost = then_sync - backward
    hidden = (then_sync - overlapped) / cost if cost > 0 else 0.0
    out = {
        "bench": "ddp-torch-gloo",
        "ranks": args.ranks,
        "backward_ms": backward,
        "backward_then_sync_ms": then_sync,
        "overlapped_ms": overlapped,
        "hidden_fraction": hidden,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:<24} {value}")


if __name__ == "__main__":
    main()
