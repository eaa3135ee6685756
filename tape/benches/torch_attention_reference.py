"""PyTorch side of `bench_attention` (tape/examples/bench_attention.rs): causal
self-attention forward and backward with `scaled_dot_product_attention` (the flash
backend where the GPU has it), batch 8, 12 heads, head dim 64, sequences 1024 and 4096,
in bf16 and f32 (`--groups` fewer key/value heads than query heads: grouped-query
attention, as Llama's `--batch 2 --heads 32 --groups 8 --head-dim 128 --seqs 4096`), timed with CUDA events and printed as the same JSON lines (ms per
forward and backward, TFLOP/s counted as bench_attention counts them, the most memory
held above the inputs). Not run in CI (torch is not installed there).

    python tape/benches/torch_attention_reference.py
    python tape/benches/torch_attention_reference.py --seqs 1024 --dtypes bf16
"""
import argparse
import json

import torch
import torch.nn.functional as F

REPEATS = 5


def bench(batch, heads, groups, head_dim, seq, dtype):
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    shape = (batch, heads, seq, head_dim)
    q = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn((batch, groups, seq, head_dim), device="cuda", dtype=dtype,
                        requires_grad=True) for _ in range(2))
    upstream = torch.randn(shape, device="cuda", dtype=dtype)
    gqa = {"enable_gqa": True} if groups != heads else {}
    backends = [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
    if dtype == torch.float32:
        backends = [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]

    def step():
        with torch.nn.attention.sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        out.backward(upstream)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        q.grad = k.grad = v.grad = None
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / REPEATS
    flops = 3.0 * 4.0 * seq * seq * head_dim * batch * heads / 2.0
    print(json.dumps({
        "bench": "attention", "impl": "torch-sdpa", "device": "cuda:0", "batch": batch,
        "heads": heads, "groups": groups, "head_dim": head_dim, "seq": seq, "dtype": name, "causal": True,
        "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
        "peak_bytes_held": torch.cuda.max_memory_allocated() - before,
    }))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqs", default="1024,4096")
    parser.add_argument("--dtypes", default="bf16,f32")
    args = parser.parse_args()
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for seq in map(int, args.seqs.split(",")):
        for dtype in args.dtypes.split(","):
            bench(args.batch, args.heads, args.groups or args.heads, args.head_dim, seq,
                  dtypes[dtype])


if __name__ == "__main__":
    main()
