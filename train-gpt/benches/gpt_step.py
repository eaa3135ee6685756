"""PyTorch twin of the demo's training step, for `scripts/gpu-suite.sh gpt`: the same GPT
as `train-gpt` builds (byte vocabulary of 256, learned positions, pre-norm blocks with
biases, a 4·hidden tanh-GELU MLP, causal attention, final layer norm, the head tied to
the token embedding), the same batch of `--batch` sequences of `--seq` tokens, and the
same step: forward, mean cross-entropy, backward, AdamW (lr 3e-4, weight decay 0.01 on
matrices only, as Megatron groups them). `--precision bf16` is PyTorch's usual mixed
precision: f32 parameters and AdamW state, bf16 compute under autocast, as train-gpt keeps
f32 masters and main gradients beside bf16 weights. Attention is either written out
(matmul, masked softmax, matmul, as train-gpt computes it) or
`scaled_dot_product_attention` (`--attention sdpa`). Prints one JSON line with the median
ms per step after warm-up and tokens/s. Not run in CI (torch is not installed there).

    python train-gpt/benches/gpt_step.py --hidden 768 --layers 12 --heads 12 --seq 1024 \
        --batch 8 --precision bf16 --attention explicit
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

VOCAB = 256


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x, mask):
        seq, batch, hidden = x.shape
        head_dim = hidden // self.heads
        # train-gpt's layout: [s, b, hidden] with qkv as [s, b, heads, 3, head_dim].
        qkv = self.qkv(self.ln1(x)).view(seq, batch, self.heads, 3, head_dim)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        if self.attention == "sdpa":
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            context = probs @ v
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, hidden)
        x = x + self.proj(context)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, args.hidden)
        self.position = torch.nn.Embedding(args.seq, args.hidden)
        self.blocks = torch.nn.ModuleList(
            Block(args.hidden, args.heads, args.attention) for _ in range(args.layers)
        )
        self.ln_f = torch.nn.LayerNorm(args.hidden, eps=1e-5)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, mask):
        seq = tokens.shape[0]
        x = self.embed(tokens) + self.position.weight[:seq, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.embed.weight.t()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = Gpt(args).to(device)
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-4,
    )
    tokens = torch.randint(0, VOCAB, (args.seq + 1, args.batch), device=device)
    inputs, labels = tokens[:-1], tokens[1:]
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(inputs, mask)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        loss.item()  # train-gpt reads its loss every step too
        sync()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    print(json.dumps({
        "bench": "gpt_step", "impl": "torch", "attention": args.attention,
        "precision": args.precision, "hidden": args.hidden, "layers": args.layers,
        "heads": args.heads, "seq": args.seq, "batch": args.batch,
        "ms_per_step": ms, "tokens_per_s": args.batch * args.seq / (ms * 1e-3),
    }))


if __name__ == "__main__":
    main()
