// How many threads this process's CPU compute uses: ATen's intra-op pool and OpenBLAS's own pool
// (which ATen's setting does not reach). Ranks sharing a machine should split its cores, else each
// rank's pools start a thread per core and they fight over them: hprun does it for processes
// (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS), hp::testing::run_ranks for threads.
#pragma once

namespace hp {

int cpu_threads();
void set_cpu_threads(int threads);

// OpenBLAS's pool alone (ATen's fp32 matmuls), where LibTorch's BLAS is a pthreads OpenBLAS; else
// a no-op and 0 (an OpenMP OpenBLAS sets OpenMP's count, which is ATen's too). A run whose fp32
// matmuls are few and small is faster with one BLAS thread: its threads and ATen's spinning OpenMP
// workers fight over the cores (docs/performance.md).
int blas_threads();
void set_blas_threads(int threads);

// Sets the thread count for a scope and restores the previous ones (ATen's and OpenBLAS's, each
// as it was).
class CpuThreadsGuard {
 public:
  explicit CpuThreadsGuard(int threads) : previous_(cpu_threads()), previous_blas_(blas_threads()) {
    set_cpu_threads(threads);
  }
  ~CpuThreadsGuard() {
    set_cpu_threads(previous_);
    if (previous_blas_ > 0) set_blas_threads(previous_blas_);
  }
  CpuThreadsGuard(const CpuThreadsGuard&) = delete;
  CpuThreadsGuard& operator=(const CpuThreadsGuard&) = delete;

 private:
  int previous_, previous_blas_;
};

// Sets OpenBLAS's thread count for a scope and restores the previous one. Process-wide: thread-ranks
// of one process share it (a rank ending first restores it for all; speed only, not results).
class BlasThreadsGuard {
 public:
  explicit BlasThreadsGuard(int threads) : previous_(blas_threads()) { set_blas_threads(threads); }
  ~BlasThreadsGuard() {
    if (previous_ > 0) set_blas_threads(previous_);
  }
  BlasThreadsGuard(const BlasThreadsGuard&) = delete;
  BlasThreadsGuard& operator=(const BlasThreadsGuard&) = delete;

 private:
  int previous_;
};

}  // namespace hp
