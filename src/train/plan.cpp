#include "train/plan.h"

#include <ATen/ATen.h>

#include <iomanip>
#include <iostream>

#include "hp/models/model_spec.h"
#include "hp/nn/init.h"

namespace hp::train::detail {

void print_plan(const TrainConfig& c, const comm::ProcessGroup& world, const DeviceMesh& mesh,
                const models::ModelParts& parts) {
  // Per rank: parameters (local elements), parameter bytes, and an estimate of training memory:
  // parameters + gradients + AdamW's two moments, plus the activations the model family estimates
  // one micro-batch keeps for backward.
  int64_t param_bytes = 0;
  for (const auto& module : parts.modules) param_bytes += nn::local_parameter_bytes(*module);
  // A context-parallel rank keeps its 1/cp of each sequence.
  const double activations = static_cast<double>(c.train.micro_batch * c.data.seq_len / c.parallel.cp) *
                             c.model->activation_bytes_per_token(c.parallel);
  at::Tensor mine = at::tensor(
      {static_cast<double>(param_bytes / 4), static_cast<double>(param_bytes), 4.0 * param_bytes + activations},
      at::kDouble);
  const at::Tensor all = world.all_gather(mine);
  if (world.rank() != 0) return;
  std::cout << "plan: " << c.parallel.str() << " on " << world.size() << " ranks, " << mesh.str() << "\n"
            << "model: " << c.model->describe() << ": " << c.model->parameter_count() << " parameters\n"
            << "batch: " << c.train.global_batch << " sequences x " << c.data.seq_len << " tokens, "
            << c.per_rank_batch() << " per data-parallel rank in " << c.micro_batches() << " micro-batch(es)\n";
  if (c.memory.checkpoint != "none" || c.memory.swap != "none")
    std::cout << "activations: estimated as without memory.checkpoint and memory.swap, which keep less in the "
                 "compute allocator (an upper bound)\n";
  for (int r = 0; r < world.size(); ++r) {
    const auto row = all.view({world.size(), 3})[r];
    std::cout << "  rank " << r << ": " << static_cast<int64_t>(row[0].item<double>()) << " parameter elements ("
              << std::fixed << std::setprecision(2) << row[1].item<double>() / 1e6 << " MB), estimated training memory "
              << row[2].item<double>() / 1e6 << " MB\n";
  }
  std::cout << std::defaultfloat;
}

}  // namespace hp::train::detail
