// LibTorch must run its matmuls on OpenBLAS, not Debian's reference BLAS (~30x slower here:
// 6 vs 200 GFLOP/s for fp32 1024x1024). scripts/bootstrap installs and selects OpenBLAS; this
// test fails when the BLAS actually loaded into the process is a different one. A LibTorch that
// links its own BLAS into itself (the 2.x wheels') has nothing to select: the test skips.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <string>

namespace {

// Which shared object provides the Fortran BLAS sgemm_ that LibTorch calls.
TEST(Blas, LibTorchUsesOpenBlas) {
  at::mm(at::ones({64, 64}), at::ones({64, 64}));  // make sure the BLAS is loaded and used
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  ASSERT_NE(sgemm, nullptr) << "no sgemm_ symbol in the process: LibTorch is not using a BLAS library";
  Dl_info info{};
  ASSERT_NE(dladdr(sgemm, &info), 0);
  char resolved[PATH_MAX];
  const std::string path = realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
  if (path.find("libtorch") != std::string::npos)
    GTEST_SKIP() << "this LibTorch carries its own BLAS (sgemm_ from " << path << ", a LibTorch 2.x wheel's)";
  EXPECT_NE(path.find("openblas"), std::string::npos)
      << "sgemm_ comes from " << path << ", not OpenBLAS: run scripts/bootstrap (it installs libopenblas0-pthread "
      << "and points libblas.so.3 at it with update-alternatives)";
}

}  // namespace
