# The Llama of hp's models (RMSNorm in fp32, RoPE, GQA, SwiGLU) in plain PyTorch eager: the Python
# peer the benchmarks compare against. No parallel code; the sizes come from the caller.
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaSizes:
    vocab: int = 2048
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 768
    seq: int = 128
    sdpa: bool = False  # attention through F.scaled_dot_product_attention (a fused kernel on GPUs)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: LlamaSizes):
        super().__init__()
        self.hd = c.dim // c.heads
        self.sdpa = c.sdpa
        self.q = nn.Linear(c.dim, c.heads * self.hd, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.o = nn.Linear(c.heads * self.hd, c.dim, bias=False)
        inv = 10000.0 ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        ang = torch.outer(torch.arange(c.seq, dtype=torch.float64), inv).repeat(1, 2)
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
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 is_causal=True)
            return self.o(out.transpose(1, 2).reshape(b, s, -1))
        k = k.unsqueeze(2).expand(b, k.size(1), rep, s, self.hd).reshape(b, -1, s, self.hd)
        v = v.unsqueeze(2).expand(b, v.size(1), rep, s, self.hd).reshape(b, -1, s, self.hd)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-2, -1)).div(math.sqrt(self.hd)).masked_fill(causal, float("-inf"))
        return self.o((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, c: LlamaSizes):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = RMSNorm(c.dim), Attention(c), RMSNorm(c.dim)
        self.gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.up = nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        y = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self, c: LlamaSizes):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.Sequential(*[Block(c) for _ in range(c.layers)])
        self.norm, self.output = RMSNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.layers(self.embed(tokens))))
