#include "hp/train/peak_flops.h"

#include <ATen/ATen.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "hp/core/cpu_capabilities.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/error.h"

namespace hp::train {
namespace fs = std::filesystem;

std::string dtype_name(at::ScalarType dtype) {
  HP_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "peak FLOP/s: no measurement for ", dtype);
  return dtype == at::kBFloat16 ? "bf16" : "fp32";
}

namespace {

std::string env_or(const char* name, const char* otherwise) {
  const char* value = std::getenv(name);
  return value ? value : otherwise;
}

fs::path default_cache() {
  const char* home = std::getenv("HOME");
  return fs::path(home ? home : "/tmp") / ".cache/hyperparallel/peak_flops.json";
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[16];
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(text, sizeof text, "%Y-%m-%d", &utc);
  return text;
}

// Seconds per matmul: after a warm-up, one timed call if it takes 10 ms, else enough repetitions
// for about 10 ms.
double time_with_aten(const MatmulShape& shape, at::ScalarType dtype, int threads) {
  CpuThreadsGuard guard(threads);
  const auto options = at::TensorOptions().dtype(dtype);
  const at::Tensor x = at::ones({shape.m, shape.k}, options), w = at::ones({shape.n, shape.k}, options);
  at::Tensor out = at::linear(x, w);
  using clock = std::chrono::steady_clock;
  const auto seconds_of = [&](int reps) {
    const auto t0 = clock::now();
    for (int i = 0; i < reps; ++i) out = at::linear(x, w);
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  const double once = seconds_of(1);
  if (once >= 0.01) return once;
  const int reps = std::clamp(static_cast<int>(0.01 / std::max(once, 1e-9)), 1, 1000);
  return seconds_of(reps) / reps;
}

// The key of one measurement: everything that changes the answer.
std::string cache_key(const PeakFlopsOptions& o, int cores, const std::string& cpu) {
  std::ostringstream key;
  key << cpu << " | libtorch " << TORCH_VERSION << " | " << cores << " cores | ATEN_CPU_CAPABILITY "
      << env_or("ATEN_CPU_CAPABILITY", "unset") << " | OMP_WAIT_POLICY " << env_or("OMP_WAIT_POLICY", "unset") << " | "
      << dtype_name(o.dtype) << " |";
  for (const MatmulShape& s : o.shapes) key << ' ' << s.m << 'x' << s.k << 'x' << s.n;
  return key.str();
}

PeakFlops measure(const PeakFlopsOptions& o, int cores) {
  const auto time_matmul = o.time_matmul ? o.time_matmul : time_with_aten;
  const auto start = std::chrono::steady_clock::now();
  PeakFlops best;
  best.dtype = o.dtype;
  for (int threads = 1; threads <= cores; ++threads) {
    if (cores % threads != 0) continue;
    if (best.flops > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > o.budget_seconds)
      break;  // the layouts measured so far give the peak
    const int ranks = cores / threads;
    for (const MatmulShape& shape : o.shapes) {
      double fastest = time_matmul(shape, o.dtype, threads);
      for (int trial = 1; trial < o.trials; ++trial) fastest = std::min(fastest, time_matmul(shape, o.dtype, threads));
      const double flops = ranks * shape.flops() / fastest;
      if (flops > best.flops) best.flops = flops, best.ranks = ranks, best.threads = threads, best.shape = shape;
    }
  }
  return best;
}

// The cached peak under `key`, or nullopt (none, or an entry that is not what this code writes).
std::optional<PeakFlops> cached_peak(const nlohmann::json& cached, const std::string& key) {
  const auto hit = cached.find(key);
  if (hit == cached.end() || !hit->is_object()) return std::nullopt;
  try {
    PeakFlops p;
    p.flops = hit->at("flops").get<double>();
    p.ranks = hit->at("ranks").get<int>();
    p.threads = hit->at("threads").get<int>();
    p.shape = {hit->at("m").get<int64_t>(), hit->at("k").get<int64_t>(), hit->at("n").get<int64_t>()};
    p.source = hit->at("date").get<std::string>();
    if (p.flops > 0 && std::isfinite(p.flops)) return p;
  } catch (const nlohmann::json::exception&) {
  }
  return std::nullopt;
}

nlohmann::json read_cache(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  nlohmann::json cached = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return cached.is_object() ? cached : nlohmann::json::object();
}

std::string layout_text(const PeakFlops& p) {
  std::ostringstream text;
  text << p.ranks << " rank" << (p.ranks > 1 ? "s" : "") << " x " << p.threads << " thread"
       << (p.threads > 1 ? "s" : "") << ", " << p.shape.m << 'x' << p.shape.k << 'x' << p.shape.n;
  return text.str();
}

}  // namespace

PeakFlops measure_peak_flops(const PeakFlopsOptions& o) {
  HP_CHECK(!o.shapes.empty(), "measure_peak_flops: no matmul shapes");
  HP_CHECK(o.trials >= 1, "measure_peak_flops: trials must be at least 1, got ", o.trials);
  dtype_name(o.dtype);  // checks it
  const int cores = o.cores > 0 ? o.cores : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const fs::path cache = o.cache.empty() ? default_cache() : o.cache;
  const std::string key = cache_key(o, cores, o.cpu_model.empty() ? host_cpu_model() : o.cpu_model);
  nlohmann::json cached = read_cache(cache);
  if (std::optional<PeakFlops> p = cached_peak(cached, key)) {
    p->dtype = o.dtype;
    p->source = layout_text(*p) + ", measured " + p->source + ", cached in " + cache.string();
    return *p;
  }
  PeakFlops p = measure(o, cores);
  p.source = layout_text(p) + ", best of " + std::to_string(o.trials) + " trials, measured now";
  cached[key] = {{"flops", p.flops}, {"ranks", p.ranks}, {"threads", p.threads}, {"m", p.shape.m},
                 {"k", p.shape.k},   {"n", p.shape.n},   {"date", today()}};
  // Written aside and renamed, so that a process reading it meanwhile sees the old file or the new
  // (two writing at once: the last one's keys stay, the other's are measured again next time). An
  // unwritable cache costs a measurement next time, nothing else.
  std::error_code ignored;
  fs::create_directories(cache.parent_path(), ignored);
  char host[256] = "host";
  gethostname(host, sizeof host - 1);
  const fs::path aside = cache.string() + "." + host + "." + std::to_string(::getpid()) + ".tmp";
  std::ofstream(aside) << cached.dump(1);
  fs::rename(aside, cache, ignored);
  if (ignored) fs::remove(aside, ignored);
  return p;
}

std::optional<double> peak_flops_override() {
  const char* env = std::getenv("HP_PEAK_FLOPS");
  if (env == nullptr) return std::nullopt;
  char* end = nullptr;
  const double flops = std::strtod(env, &end);
  HP_CHECK(end != env && *end == '\0' && flops > 0 && std::isfinite(flops),
           "HP_PEAK_FLOPS must be a positive number of FLOP/s, got '", env, "'");
  return flops;
}

}  // namespace hp::train
