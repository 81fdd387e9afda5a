#!/usr/bin/env python3
# The Python peer of hp-train on one GPU (scripts/device-check): the main job's Llama (bench/peer_llama.py,
# attention through F.scaled_dot_product_attention) in plain PyTorch eager on CUDA, with the step hp-train
# takes (micro-batch accumulation, gradient clipping, AdamW). Two precisions:
#   autocast  fp32 parameters and optimizer, matmuls in bf16 under torch.autocast (PyTorch's AMP recipe);
#   bf16      bf16 parameters, gradients and optimizer state, loss in fp32.
# Random tokens of the batch's shape: throughput does not depend on their values.
#   bench/gpu_peer.py VOCAB DIM LAYERS HEADS KV_HEADS FFN SEQ GLOBAL_BATCH MICRO_BATCH autocast|bf16 STEPS PEAK_FLOPS
# Prints "gpu_peer <precision> tokens_per_s <mean over the steps after two warm-up steps> mfu <%>", the MFU
# with hp-train's FLOPs per token (6 x parameters but the embedding + 12 x layers x dim x seq) over PEAK_FLOPS.
import sys
import time

import torch
import torch.nn.functional as F

from peer_llama import Llama, LlamaSizes

vocab, dim, layers, heads, kv_heads, ffn, seq, global_batch, micro_batch = map(int, sys.argv[1:10])
precision, steps, peak = sys.argv[10], int(sys.argv[11]), float(sys.argv[12])
torch.manual_seed(0)
model = Llama(LlamaSizes(vocab, dim, layers, heads, kv_heads, ffn, seq, sdpa=True)).cuda()
if precision == "bf16":
    model = model.to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=True)
data = torch.randint(0, vocab, (global_batch, seq + 1), generator=torch.Generator().manual_seed(3)).cuda()


def step():
    opt.zero_grad(set_to_none=True)
    for first in range(0, global_batch, micro_batch):
        rows = data[first:first + micro_batch]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
            logits = model(rows[:, :seq])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), rows[:, 1:].reshape(-1))
        (loss * (micro_batch / global_batch)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


for _ in range(2):
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(steps):
    loss = step()
torch.cuda.synchronize()
tokens_per_s = global_batch * seq * steps / (time.perf_counter() - start)
head = dim // heads
matmul_params = layers * (dim * heads * head * 2 + dim * kv_heads * head * 2 + 3 * dim * ffn + 2 * dim) + vocab * dim + dim
flops_per_token = 6.0 * matmul_params + 12.0 * layers * heads * head * seq
print(f"gpu_peer {precision} tokens_per_s {tokens_per_s:.0f} mfu {100 * flops_per_token * tokens_per_s / peak:.1f}% "
      f"loss {loss.item():.3f} max_memory_gib {torch.cuda.max_memory_allocated() / 2**30:.1f}")
