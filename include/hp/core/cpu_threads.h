// How many threads this process's CPU compute uses: ATen's intra-op pool and OpenBLAS's own pool
// (which ATen's setting does not reach). Ranks sharing a machine should split its cores, else each
// rank's pools start a thread per core and they fight over them: hprun does it for processes
// (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS), hp::testing::run_ranks for threads.
#pragma once

namespace hp {

int cpu_threads();
void set_cpu_threads(int threads);

// Sets the thread count for a scope and restores the previous one.
class CpuThreadsGuard {
 public:
  explicit CpuThreadsGuard(int threads) : previous_(cpu_threads()) { set_cpu_threads(threads); }
  ~CpuThreadsGuard() { set_cpu_threads(previous_); }
  CpuThreadsGuard(const CpuThreadsGuard&) = delete;
  CpuThreadsGuard& operator=(const CpuThreadsGuard&) = delete;

 private:
  int previous_;
};

}  // namespace hp
