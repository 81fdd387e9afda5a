#include "hp/core/cpu_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "hp/core/error.h"

namespace hp {
namespace {

// OpenBLAS is reached through the BLAS alternative LibTorch links, so its functions are looked up
// at run time; with another BLAS they are absent and only ATen's pool is set.
using SetThreads = void (*)(int);

using GetThreads = int (*)();

SetThreads openblas_set() { return reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")); }
GetThreads openblas_get() { return reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads")); }

// An OpenBLAS with its own pthreads pool (openblas_get_parallel() == 1); an OpenMP one (2) shares
// OpenMP's count with ATen, and a sequential one (0) has no pool.
bool pthreads_openblas() {
  const auto parallel = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  return parallel && parallel() == 1;
}

}  // namespace

int cpu_threads() { return at::get_num_threads(); }

void set_cpu_threads(int threads) {
  HP_CHECK(threads > 0, "set_cpu_threads: need at least one thread, got ", threads);
  at::set_num_threads(threads);
  if (SetThreads set = openblas_set()) set(threads);
}

int blas_threads() {
  const GetThreads get = openblas_get();
  return get && pthreads_openblas() ? get() : 0;
}

void set_blas_threads(int threads) {
  HP_CHECK(threads > 0, "set_blas_threads: need at least one thread, got ", threads);
  if (SetThreads set = openblas_set(); set && pthreads_openblas()) set(threads);
}

}  // namespace hp
