#include "train/step_rerun.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "hp/core/error.h"

namespace hp::train::detail {
namespace {

// "loss 31.2 is 12.1x the largest of the previous 10 steps' (2.57)", or nullopt.
std::optional<std::string> spike(const char* what, double value, const std::deque<double>& previous, double factor) {
  if (factor <= 0 || previous.size() < AnomalyWatch::kFewest) return std::nullopt;
  const double largest = *std::max_element(previous.begin(), previous.end());
  if (!(value > factor * largest)) return std::nullopt;
  return hp::detail::str_cat(what, " ", value, " is ", value / largest, "x the largest of the previous ",
                             previous.size(), " steps' (", largest, ")");
}

bool same_number(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(double)) == 0;
}

void push(std::deque<double>& window, double value) {
  window.push_back(value);
  if (window.size() > AnomalyWatch::kWindow) window.pop_front();
}

std::string numbers(const StepRecord& r) {
  return hp::detail::str_cat("loss ", r.loss, ", gradient norm ", r.grad_norm);
}

}  // namespace

AnomalyWatch::AnomalyWatch(double spike_factor) : spike_factor_(spike_factor) {}

std::optional<std::string> AnomalyWatch::anomaly(const StepRecord& r) const {
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm))
    return hp::detail::str_cat(std::isfinite(r.loss) ? "gradient norm" : "loss", " not finite");
  if (auto why = spike("loss", r.loss, losses_, spike_factor_)) return why;
  return spike("gradient norm", r.grad_norm, grad_norms_, spike_factor_);
}

void AnomalyWatch::note(const StepRecord& r) {
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) return;
  push(losses_, r.loss);
  push(grad_norms_, r.grad_norm);
}

bool same_numbers(const StepRecord& first, const StepRecord& rerun) {
  return same_number(first.loss, rerun.loss) && same_number(first.grad_norm, rerun.grad_norm);
}

StepRerun::StepRerun(double spike_factor, const DeviceMesh& mesh, models::ModelParts& parts)
    : watch_(spike_factor), mesh_(mesh), parts_(parts) {}

std::optional<std::string> StepRerun::rerun_if_anomalous(StepRecord& record, const MeshRngState& step_start_rng,
                                                         const std::function<void()>& run_again) {
  const std::optional<std::string> why = watch_.anomaly(record);
  if (!why) return std::nullopt;
  const StepRecord first = record;
  set_rng_state(mesh_, step_start_rng);
  if (parts_.forget_step) parts_.forget_step();
  run_again();
  const std::string head = hp::detail::str_cat("step ", record.step, " ran again (", *why, "): ", numbers(first));
  if (same_numbers(first, record)) {
    record.rerun = Rerun::kPersistent;
    return head + " both times: persistent, the data or the model";
  }
  // Other numbers that are an anomaly too (NaN, then infinity) say the same as equal ones.
  if (const std::optional<std::string> again = watch_.anomaly(record)) {
    record.rerun = Rerun::kPersistent;
    return hp::detail::str_cat(head, " the first time, ", numbers(record), " the second, an anomaly again (", *again,
                               "): persistent, the data or the model");
  }
  record.rerun = Rerun::kTransient;
  return hp::detail::str_cat(head, " the first time, ", numbers(record),
                             " the second: a transient fault of the hardware");
}

}  // namespace hp::train::detail
