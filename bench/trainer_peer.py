#!/usr/bin/python3
# The peer of bench/trainer_vs_python: the main job's model, batch and step (micro-batch
# accumulation, gradient clipping, AdamW) in plain PyTorch eager on one process, fp32 or bf16
# autocast, at a given thread count and CPU capability (ATEN_CPU_CAPABILITY, set by the caller).
# Random tokens of the batch's shape: throughput does not depend on their values.
#   bench/trainer_peer.py VOCAB DIM LAYERS HEADS KV_HEADS FFN SEQ GLOBAL_BATCH MICRO_BATCH fp32|bf16 THREADS STEPS
# Prints "peer_tokens_per_s <mean over the steps after the first>" (as hp-train's throughput).
# Needs bench/setup_peer.
import os
import sys
import time

threads = int(sys.argv[11])
os.environ["OMP_NUM_THREADS"] = str(threads)
os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from peer_llama import Llama, LlamaSizes  # noqa: E402

vocab, dim, layers, heads, kv_heads, ffn, seq, global_batch, micro_batch = map(int, sys.argv[1:10])
dtype, steps = sys.argv[10], int(sys.argv[12])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = Llama(LlamaSizes(vocab, dim, layers, heads, kv_heads, ffn, seq))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
data = torch.randint(0, vocab, (global_batch, seq + 1), generator=torch.Generator().manual_seed(3))


def step():
    opt.zero_grad()
    for first in range(0, global_batch, micro_batch):
        rows = data[first:first + micro_batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(rows[:, :seq])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), rows[:, 1:].reshape(-1))
        (loss * (micro_batch / global_batch)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


step()
start = time.perf_counter()
for _ in range(steps):
    step()
print(f"peer_tokens_per_s {global_batch * seq * steps / (time.perf_counter() - start):.0f}")
