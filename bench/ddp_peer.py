#!/usr/bin/python3
# The peer of bench_fsdp: the same test Llama (tests/tp/llama_model.h), batch and step under
# PyTorch's own DistributedDataParallel with Gloo, ranks as processes, one CPU thread each.
# Prints "ddp_step_ms <median>" from rank 0. Run by bench/fsdp_vs_ddp; needs bench/setup_peer.
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

from peer_llama import Llama, LlamaSizes  # noqa: E402

SIZES = LlamaSizes(vocab=2048, dim=256, layers=4, heads=8, kv_heads=4, ffn=768, seq=128)
VOCAB, SEQ, BATCH = SIZES.vocab, SIZES.seq, 4


def run(rank, world, port, rounds, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Llama(SIZES))
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
