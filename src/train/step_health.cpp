#include "train/step_health.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "hp/dtensor/local.h"

namespace hp::train::detail {
namespace {

constexpr int64_t kNameBytes = 256;  // a flag, the FQN (cut at 254 bytes), its terminating zero

// The first parameter whose gradient piece on this rank is not finite, or "".
std::string first_nonfinite_gradient(const models::ModelParts& parts) {
  for (const auto& [fqn, tensor] : parts.named_tensors()) {
    const at::Tensor& grad = tensor.grad();
    if (grad.defined() && !at::isfinite(local_tensor(grad)).all().item<bool>()) return fqn;
  }
  return "";
}

}  // namespace

int gather_rank_numbers(double local_loss, double local_grad_norm, int stop_signal, const comm::ProcessGroup& world,
                        StepRecord& record) {
  const at::Tensor mine = at::tensor({local_loss, local_grad_norm, static_cast<double>(stop_signal)}, at::kDouble);
  const at::Tensor all = world.all_gather(mine.view({1, 3}));
  record.local_losses.clear(), record.local_grad_norms.clear();
  record.largest_local_grad_norm_rank = 0;
  int agreed_stop = 0;
  for (int64_t r = 0; r < all.size(0); ++r) {
    if (agreed_stop == 0) agreed_stop = static_cast<int>(all[r][2].item<double>());
    record.local_losses.push_back(all[r][0].item<double>());
    record.local_grad_norms.push_back(all[r][1].item<double>());
    if (record.local_grad_norms.back() > record.local_grad_norms[record.largest_local_grad_norm_rank])
      record.largest_local_grad_norm_rank = r;
  }
  return agreed_stop;
}

std::string describe_nonfinite(const models::ModelParts& parts, double local_loss, const comm::ProcessGroup& world) {
  // Each rank's report in one byte row: [loss not finite, FQN bytes...].
  const std::string fqn = first_nonfinite_gradient(parts).substr(0, kNameBytes - 2);
  at::Tensor mine = at::zeros({1, kNameBytes}, at::kByte);
  mine[0][0] = std::isfinite(local_loss) ? 0 : 1;
  std::copy(fqn.begin(), fqn.end(), mine.data_ptr<uint8_t>() + 1);
  const at::Tensor all = world.all_gather(mine);
  std::vector<int64_t> bad_loss;
  std::ostringstream gradients;
  for (int64_t r = 0; r < all.size(0); ++r) {
    const uint8_t* row = all[r].data_ptr<uint8_t>();
    if (row[0]) bad_loss.push_back(r);
    const std::string name(reinterpret_cast<const char*>(row + 1));
    if (!name.empty()) gradients << (gradients.tellp() > 0 ? ", " : "") << name << " on rank " << r;
  }
  std::ostringstream out;
  if (!bad_loss.empty()) {
    out << "the loss is not finite on rank" << (bad_loss.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < bad_loss.size(); ++i) out << (i ? ", " : "") << bad_loss[i];
  }
  if (gradients.tellp() > 0)
    out << (bad_loss.empty() ? "" : "; ") << "the first gradient that is not finite: " << gradients.str();
  if (out.tellp() == 0) out << "the gradient norm is not finite (its sum of squares overflowed)";
  return out.str();
}

}  // namespace hp::train::detail
