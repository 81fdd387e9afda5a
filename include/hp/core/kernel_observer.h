// hp's own CPU kernels (loops over a tensor's data, such as the fused SwiGLU) run no ATen op, so
// dispatch modes do not see their work. They announce it to the thread's kernel observer instead,
// which the cost model's recorders set: a profile times them, a dry run counts their bytes.
//
//   hp::run_kernel("swiglu_forward", bytes, [&] { loops().swiglu_forward(g, u, out); });
//
// With no observer set, run_kernel runs the body and nothing else.
#pragma once

#include <chrono>
#include <cstdint>

namespace hp {

class KernelObserver {
 public:
  virtual ~KernelObserver() = default;
  // Kernel `name` ran over `bytes` of inputs and outputs in `seconds` (its body's wall time).
  virtual void kernel_ran(const char* name, int64_t bytes, double seconds) = 0;
};

// This thread's observer (nullptr: none).
KernelObserver* kernel_observer();

// Sets this thread's observer for the guard's lifetime (the previous one is restored after).
class KernelObserverGuard {
 public:
  explicit KernelObserverGuard(KernelObserver* observer);
  ~KernelObserverGuard();
  KernelObserverGuard(const KernelObserverGuard&) = delete;
  KernelObserverGuard& operator=(const KernelObserverGuard&) = delete;

 private:
  KernelObserver* previous_;
};

template <class Body>
void run_kernel(const char* name, int64_t bytes, Body&& body) {
  KernelObserver* observer = kernel_observer();
  if (observer == nullptr) return body();
  const auto start = std::chrono::steady_clock::now();
  body();
  observer->kernel_ran(name, bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace hp
