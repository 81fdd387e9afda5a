#!/usr/bin/python3
# The peer of bench_fsdp: the same test Llama (tests/tp/llama_model.h), batch and step under
# PyTorch's own DistributedDataParallel with Gloo, ranks as processes, one CPU thread each.
# Prints "ddp_step_ms <median>" from rank 0. Run by bench/fsdp_vs_ddp; needs bench/setup_peer.
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ, BATCH = 2048, 256, 4, 8, 4, 768, 128, 4


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.q = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.o = nn.Linear(HEADS * self.hd, DIM, bias=False)
        inv = 10000.0 ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        ang = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv).repeat(1, 2)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def rotate(self, t):
        s, half = t.size(1), self.hd // 2
        cos, sin = self.cos[:s].view(1, s, 1, self.hd), self.sin[:s].view(1, s, 1, self.hd)
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    def forward(self, x):
        b, s, _ = x.shape
        q = self.rotate(self.q(x).view(b, s, -1, self.hd)).transpose(1, 2)
        k = self.rotate(self.k(x).view(b, s, -1, self.hd)).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.hd).transpose(1, 2)
        rep = q.size(1) // k.size(1)
        k = k.unsqueeze(2).expand(b, k.size(1), rep, s, self.hd).reshape(b, -1, s, self.hd)
        v = v.unsqueeze(2).expand(b, v.size(1), rep, s, self.hd).reshape(b, -1, s, self.hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1)).div(math.sqrt(self.hd)).masked_fill(causal, float("-inf"))
        return self.o((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = RMSNorm(DIM), Attention(), RMSNorm(DIM)
        self.gate, self.up, self.down = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        y = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm, self.output = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.layers(self.embed(tokens))))


def run(rank, world, port, rounds, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data[:, :SEQ]).reshape(-1, VOCAB), data[:, 1:].reshape(-1)).backward()
        opt.step()

    step()
    times = []
    for _ in range(rounds * steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        times.sort()
        out.put(times[len(times) // 2])
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, world, port, rounds, 5, out)) for r in range(world)]
    for p in procs:
        p.start()
    median = out.get()
    for p in procs:
        p.join()
    print(f"ddp_step_ms {median * 1e3:.2f}")
