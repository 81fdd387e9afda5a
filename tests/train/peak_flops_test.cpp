// The peak MFU divides by: the best of several trials (a slow trial, as on a busy machine, is not
// what gets cached), the best layout of ranks x threads within a time budget, measured again when
// the CPU model (or anything else in the cache key) changes; and the HP_PEAK_FLOPS override.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "hp/train/peak_flops.h"
#include "scratch_dir.h"
#include "test_util.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

// HP_PEAK_FLOPS unset for the test's scope, as it was after.
class NoPeakOverride {
 public:
  NoPeakOverride() {
    if (const char* v = std::getenv("HP_PEAK_FLOPS")) saved_ = v, had_ = true;
    unsetenv("HP_PEAK_FLOPS");
  }
  ~NoPeakOverride() {
    if (had_) setenv("HP_PEAK_FLOPS", saved_.c_str(), 1);
  }

 private:
  std::string saved_;
  bool had_ = false;
};

// A fake clock: 1 TFLOP/s on one thread, `speedup` times faster on two; every `slow_every`-th
// trial (counting from the first) ten times slower, as when another process had the cores.
struct FakeMatmul {
  double speedup = 2.0;
  int slow_every = 0;
  int calls = 0;
  double operator()(const MatmulShape& shape, at::ScalarType, int threads) {
    const double seconds = shape.flops() / 1e12 / (threads == 2 ? speedup : 1.0);
    const bool slow = slow_every > 0 && calls % slow_every == 0;
    ++calls;
    return slow ? 10 * seconds : seconds;
  }
};

PeakFlopsOptions options(const fs::path& dir, FakeMatmul& fake) {
  PeakFlopsOptions o;
  o.dtype = at::kBFloat16;
  o.shapes = {{256, 64, 128}, {256, 128, 64}};
  o.cores = 2;
  o.cache = dir / "peak.json";
  o.cpu_model = "CPU A";
  o.time_matmul = [&fake](const MatmulShape& s, at::ScalarType d, int t) { return fake(s, d, t); };
  return o;
}

TEST(PeakFlops, ASlowTrialIsNotCachedAsThePeak) {
  const fs::path dir = test::scratch_dir("peak_flops_slow");
  FakeMatmul fake;
  fake.speedup = 3.0;
  fake.slow_every = 5;  // the first of each shape's five trials
  const PeakFlops p = measure_peak_flops(options(dir, fake));
  EXPECT_EQ(fake.calls, 2 * 2 * 5);  // 2 layouts x 2 shapes x 5 trials
  EXPECT_DOUBLE_EQ(p.flops, 3e12);   // one rank of 2 threads at 3 TFLOP/s, not 0.3
  EXPECT_EQ(p.ranks, 1);
  EXPECT_EQ(p.threads, 2);
  EXPECT_NE(p.source.find("measured now"), std::string::npos) << p.source;
  // The cached value is that best, and the next call reads it without measuring.
  FakeMatmul unused;
  const PeakFlops again = measure_peak_flops(options(dir, unused));
  EXPECT_EQ(unused.calls, 0);
  EXPECT_DOUBLE_EQ(again.flops, 3e12);
  EXPECT_NE(again.source.find("cached in"), std::string::npos) << again.source;
}

// fp32 matmul that does not speed up with threads: two one-thread ranks reach twice what one
// two-thread rank does, and that is the host's peak.
TEST(PeakFlops, TheBestLayoutOfRanksAndThreadsCounts) {
  FakeMatmul fake;
  fake.speedup = 1.0;
  const PeakFlops p = measure_peak_flops(options(test::scratch_dir("peak_flops_layout"), fake));
  EXPECT_DOUBLE_EQ(p.flops, 2e12);
  EXPECT_EQ(p.ranks, 2);
  EXPECT_EQ(p.threads, 1);
}

TEST(PeakFlops, AnotherCpuModelIsMeasuredAgain) {
  const fs::path dir = test::scratch_dir("peak_flops_cpu");
  FakeMatmul fast;
  measure_peak_flops(options(dir, fast));
  FakeMatmul other;
  other.speedup = 4.0;
  PeakFlopsOptions o = options(dir, other);
  o.cpu_model = "CPU B";
  const PeakFlops p = measure_peak_flops(o);
  EXPECT_EQ(other.calls, 20);
  EXPECT_DOUBLE_EQ(p.flops, 4e12);
  // Both stay cached, each under its own CPU.
  FakeMatmul unused;
  EXPECT_DOUBLE_EQ(measure_peak_flops(options(dir, unused)).flops, 2e12);
  o.time_matmul = [&unused](const MatmulShape& s, at::ScalarType d, int t) { return unused(s, d, t); };
  EXPECT_DOUBLE_EQ(measure_peak_flops(o).flops, 4e12);
  EXPECT_EQ(unused.calls, 0);
  // So is another dtype, and a corrupt cache.
  o.dtype = at::kFloat;
  measure_peak_flops(o);
  EXPECT_EQ(unused.calls, 20);
  std::ofstream(dir / "peak.json") << "{not json";
  measure_peak_flops(o);
  EXPECT_EQ(unused.calls, 40);
}

// The real timer (ATen matmuls) on small shapes, into a scratch cache.
TEST(PeakFlops, MeasuresWithAten) {
  PeakFlopsOptions o;
  o.dtype = at::kFloat;
  o.shapes = {{64, 64, 64}, {32, 64, 128}};
  o.trials = 2;
  o.cache = test::scratch_dir("peak_flops_aten") + "/peak.json";
  const PeakFlops p = measure_peak_flops(o);
  EXPECT_GT(p.flops, 1e8);  // any CPU of this century
  EXPECT_LT(p.flops, 1e15);
  EXPECT_TRUE(fs::exists(o.cache));
}

// Past the time budget no further layout is measured; what was measured gives the peak.
TEST(PeakFlops, StopsAtItsTimeBudget) {
  FakeMatmul fake;
  PeakFlopsOptions o = options(test::scratch_dir("peak_flops_budget"), fake);
  o.cores = 4;
  o.budget_seconds = 0.0;
  const PeakFlops p = measure_peak_flops(o);
  EXPECT_EQ(fake.calls, 2 * 5);  // one layout (4 ranks x 1 thread), 2 shapes x 5 trials
  EXPECT_EQ(p.threads, 1);
  EXPECT_DOUBLE_EQ(p.flops, 4e12);
}

TEST(PeakFlops, TheOverrideIsAPositiveNumberAndBadInputIsRefused) {
  NoPeakOverride no_override;
  EXPECT_FALSE(peak_flops_override().has_value());
  setenv("HP_PEAK_FLOPS", "1.5e11", 1);
  EXPECT_EQ(peak_flops_override(), 1.5e11);
  for (const char* bad : {"fast", "0", "-3", "inf", "1e11x"}) {
    setenv("HP_PEAK_FLOPS", bad, 1);
    test::expect_error([] { peak_flops_override(); },
                       std::string("HP_PEAK_FLOPS must be a positive number of FLOP/s, got '") + bad + "'");
  }
  unsetenv("HP_PEAK_FLOPS");
  FakeMatmul fake;
  PeakFlopsOptions o = options(test::scratch_dir("peak_flops_bad"), fake);
  o.shapes.clear();
  test::expect_error([&] { measure_peak_flops(o); }, "no matmul shapes");
  o.shapes = {{1, 1, 1}};
  o.dtype = at::kHalf;
  test::expect_error([&] { measure_peak_flops(o); }, "no measurement for");
}

}  // namespace
}  // namespace hp::train
