// The tensor-parallel plan of the test Llama, kept outside the model file (torchtitan style).
#pragma once

#include <hp/parallel/tensor_parallel.h>

namespace hp::test {

struct TpOptions {
  bool sequence_parallel = false;
  bool loss_parallel = false;
};

inline ParallelizePlan llama_tp_plan(TpOptions o) {
  // Between blocks the residual stream is replicated, or sharded on the sequence dim with SP.
  const Placement between = o.sequence_parallel ? Shard(1) : Replicate();
  ParallelizePlan plan = {
      {"embed", RowwiseParallel().set_input_layouts(Replicate()).set_output_layouts(between)},
      {"layers.*.attn.q_proj", ColwiseParallel()},
      {"layers.*.attn.k_proj", ColwiseParallel()},
      {"layers.*.attn.v_proj", ColwiseParallel()},
      {"layers.*.attn.o_proj", RowwiseParallel().set_output_layouts(between)},
      {"layers.*.mlp.gate", ColwiseParallel()},
      {"layers.*.mlp.up", ColwiseParallel()},
      {"layers.*.mlp.down", RowwiseParallel().set_output_layouts(between)},
      {"output", ColwiseParallel()
                     .set_input_layouts(between)
                     .set_output_layouts(o.loss_parallel ? Shard(-1) : Replicate())
                     .set_use_local_output(!o.loss_parallel)},
  };
  if (o.sequence_parallel)
    for (const char* norm : {"layers.*.attn_norm", "layers.*.mlp_norm", "norm"}) plan.push_back({norm, SequenceParallel()});
  // Attention and MLP inputs become replicated DTensors once, so q/k/v (gate/up) share them and
  // their input gradients add up as Partial before one all_reduce (or reduce_scatter with SP).
  for (const char* input : {"layers.*.attn", "layers.*.mlp"})
    plan.push_back({input, PrepareModuleInput({between}, {Replicate()})});
  return plan;
}

}  // namespace hp::test
