#include "kernels/per_capability/loops.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "hp/core/cpu_capabilities.h"
#include "hp/kernels/capability.h"

namespace hp::kernels {
namespace {

#define HP_LOOPS_OF(cap, name)                                                                      \
  Loops {                                                                                           \
    name, cap::swiglu_forward, cap::swiglu_backward, cap::rms_norm_forward, cap::rms_norm_backward, \
        cap::softmax_forward, cap::softmax_backward, cap::rope, cap::cross_entropy_forward,         \
        cap::cross_entropy_backward                                                                 \
  }

// LibTorch 1.13's rule (aten/src/ATen/native/DispatchStub.cpp): ATEN_CPU_CAPABILITY if set, else
// AVX2 where the CPU has it (AVX512 is opt-in there: it can run slower). Unlike ATen, a capability
// the CPU lacks falls back to the best it has rather than faulting.
Loops pick_loops() {
  const std::vector<Loops> runnable = runnable_loops();
  const auto runnable_at = [&](const std::string& capability) {
    for (const Loops& l : runnable)
      if (l.capability == capability) return &l;
    return static_cast<const Loops*>(nullptr);
  };
  const char* env = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string asked = env != nullptr ? env : "";
  if (asked == "default") return runnable.front();
  if (asked == "avx512" && runnable_at("avx512")) return *runnable_at("avx512");
  return runnable_at("avx2") ? *runnable_at("avx2") : runnable.front();
}

}  // namespace

std::vector<Loops> runnable_loops() {
  std::vector<Loops> out;
  for (const std::string& capability : runnable_cpu_capabilities()) {
    if (capability == "default") out.push_back(HP_LOOPS_OF(DEFAULT, "default"));
    if (capability == "avx2") out.push_back(HP_LOOPS_OF(AVX2, "avx2"));
    if (capability == "avx512") out.push_back(HP_LOOPS_OF(AVX512, "avx512"));
  }
  return out;
}

const Loops& loops() {
  static const Loops picked = pick_loops();
  return picked;
}

const char* kernel_capability() { return loops().capability; }

namespace {
std::atomic<int> composed_scopes{0};  // a count, so that scopes of several threads may close in any order
}  // namespace

bool fused_kernels_enabled() { return composed_scopes.load() == 0; }

ComposedKernelsScope::ComposedKernelsScope() { composed_scopes.fetch_add(1); }
ComposedKernelsScope::~ComposedKernelsScope() { composed_scopes.fetch_sub(1); }

}  // namespace hp::kernels
