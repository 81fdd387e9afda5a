#include "hp/core/cpu_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "hp/core/error.h"

namespace hp {
namespace {

// OpenBLAS is reached through the BLAS alternative LibTorch links, so its functions are looked up
// at run time (once: hp-train sets the BLAS count around every step); with another BLAS they are
// absent and only ATen's pool is set.
using SetThreads = void (*)(int);
using GetThreads = int (*)();

struct OpenBlas {
  SetThreads set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  GetThreads get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  // An OpenBLAS with its own pthreads pool (openblas_get_parallel() == 1); an OpenMP one (2) shares
  // OpenMP's count with ATen, and a sequential one (0) has no pool.
  bool own_pool = [] {
    const auto parallel = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
    return parallel && parallel() == 1;
  }();
};

const OpenBlas& openblas() {
  static const OpenBlas functions;
  return functions;
}

}  // namespace

int cpu_threads() { return at::get_num_threads(); }

void set_cpu_threads(int threads) {
  HP_CHECK(threads > 0, "set_cpu_threads: need at least one thread, got ", threads);
  at::set_num_threads(threads);
  if (openblas().set) openblas().set(threads);
}

int blas_threads() { return openblas().get && openblas().own_pool ? openblas().get() : 0; }

void set_blas_threads(int threads) {
  HP_CHECK(threads > 0, "set_blas_threads: need at least one thread, got ", threads);
  if (openblas().set && openblas().own_pool) openblas().set(threads);
}

}  // namespace hp
