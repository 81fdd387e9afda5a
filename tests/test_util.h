// Helpers shared by the in-process tests: reproducible per-rank data and comparisons that throw
// (inside run_ranks a throw names the rank; an EXPECT in a rank thread would not).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/memory_tracker.h"
#include "hp/dtensor/dtensor.h"
#include "hp/testing/run_ranks.h"
#include "scratch_dir.h"

namespace hp::test {

// Rank `rank`'s input for a test: the same values in every thread that asks, so each rank can
// compute the expected result of a collective locally. `salt` separates different tensors.
inline at::Tensor rank_data(int rank, std::vector<int64_t> shape, at::ScalarType dtype, int salt = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + rank + 1);
  if (dtype == at::kLong) return at::randint(-50, 50, shape, gen, at::TensorOptions().dtype(at::kLong));
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

inline std::string dtype_name(at::ScalarType t) { return c10::toString(t); }

// `tracker.current()` once it stops falling: a finished collective's buffers are released by the
// backend's thread a moment later (nothing else may allocate on this thread meanwhile).
inline int64_t settled_current(const MemoryTracker& tracker) {
  int64_t now = tracker.current();
  for (int steady = 0; steady < 5;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const int64_t later = tracker.current();
    steady = later == now ? steady + 1 : 0;
    now = later;
  }
  return now;
}

// Throws with both tensors printed unless every element has |got - want| <= tol * (1 + |want|),
// tol by dtype (1e-2 for bf16, 1e-5 for the other floating types: a relative tolerance with an
// absolute floor of tol), or equal for integers, or bitwise if `bitwise`.
inline void check_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, bool bitwise = false) {
  std::ostringstream err;
  if (!got.defined() || got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
    err << what << ": got " << (got.defined() ? got.sizes() : at::IntArrayRef{}) << " "
        << (got.defined() ? dtype_name(got.scalar_type()) : "undefined") << ", want " << want.sizes() << " "
        << dtype_name(want.scalar_type());
    throw std::runtime_error(err.str());
  }
  bool ok;
  if (bitwise || !want.is_floating_point()) {
    ok = at::equal(got, want);
  } else {
    const double rtol = want.scalar_type() == at::kBFloat16 ? 1e-2 : 1e-5;
    ok = at::allclose(got.to(at::kDouble), want.to(at::kDouble), rtol, rtol);
  }
  if (!ok) {
    err << what << (bitwise ? " (bitwise)" : "") << ": values differ\ngot  " << got.flatten().slice(0, 0, 16)
        << "\nwant " << want.flatten().slice(0, 0, 16);
    throw std::runtime_error(err.str());
  }
}

// Throws unless every element has |got - want| <= atol + rtol * |want| (torch.allclose), naming the
// largest excess.
inline void check_allclose(const at::Tensor& got, const at::Tensor& want, const std::string& what, double atol,
                           double rtol) {
  if (!got.defined() || got.sizes() != want.sizes())
    throw std::runtime_error(what + ": shape " + (got.defined() ? c10::str(got.sizes()) : "undefined") + " vs " +
                             c10::str(want.sizes()));
  if (want.numel() == 0) return;
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor excess = (g - w).abs() - (w.abs() * rtol + atol);
  const double worst = excess.max().item<double>();
  if (!(worst <= 0.0))
    throw std::runtime_error(what + ": |got - want| exceeds atol " + c10::str(atol) + " + rtol " + c10::str(rtol) +
                             " x |want| by " + c10::str(worst) + " (largest difference " +
                             c10::str((g - w).abs().max().item<double>()) + ")");
}

// Throws unless max |got - want| <= rtol * max |want|: relative in the max norm. For a scalar that
// is the plain relative error; in a tensor, every element must lie within rtol of the largest
// magnitude, so elements that are nearly zero are not each held to a relative tolerance.
inline void check_relative(const at::Tensor& got, const at::Tensor& want, const std::string& what, double rtol) {
  if (got.sizes() != want.sizes())
    throw std::runtime_error(what + ": shape " + c10::str(got.sizes()) + " vs " + c10::str(want.sizes()));
  if (want.numel() == 0) return;
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double largest = w.abs().max().item<double>(), difference = (g - w).abs().max().item<double>();
  if (!(difference <= rtol * largest))
    throw std::runtime_error(what + ": largest difference " + c10::str(difference) + " is " +
                             c10::str(difference / largest) + " of the largest value " + c10::str(largest) + ", > " +
                             c10::str(rtol));
}

// The whole value of a DTensor (gathered), a plain tensor as it is.
inline at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? DTensor(t).full_tensor() : t; }

// Throws unless fn throws an E (hp::Error by default) whose message contains every one of `needles`.
template <typename E = Error>
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needle_list) {
  const std::vector<std::string> needles(needle_list);
  try {
    fn();
  } catch (const E& e) {
    for (const auto& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        throw std::runtime_error("error message lacks '" + n + "': " + e.what());
    return;
  }
  throw std::runtime_error("expected an error mentioning '" + needles.at(0) + "'");
}

template <typename E = Error>
void expect_error(const std::function<void()>& fn, const std::string& needle) {
  expect_error<E>(fn, {needle});
}

// Runs fn on `world` ranks and turns any rank's failure into a test failure naming the rank.
inline void run(int world, const std::function<void(const comm::ProcessGroup&)>& fn,
                testing::RunRanksOptions options = {}) {
  try {
    testing::run_ranks(world, fn, options);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
}

}  // namespace hp::test
