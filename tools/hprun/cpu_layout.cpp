#include "hprun/cpu_layout.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hp/core/cpu_capabilities.h"

namespace hp::hprun {
namespace fs = std::filesystem;
namespace {

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// FNV-1a, 64 bits: a stable digest of the key's text (not a security measure).
uint64_t fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ULL) {
  for (const unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

nlohmann::json read_cache(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  nlohmann::json cached = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return cached.is_object() ? cached : nlohmann::json::object();
}

}  // namespace

std::string CpuLayout::text() const {
  return std::to_string(threads) + (threads == 1 ? " thread" : " threads") + " per rank, " + capability;
}

std::vector<CpuLayout> layout_candidates(int cores, int ranks) {
  std::vector<int> threads;
  if (const std::optional<std::string> fixed = env("OMP_NUM_THREADS")) {
    threads = {std::max(1, std::atoi(fixed->c_str()))};
  } else {
    const int most = std::max(1, cores / std::max(1, ranks));
    threads = {most};
    for (int t = 1; t < most; t *= 2) threads.push_back(t);
  }
  std::vector<std::string> capabilities = runnable_cpu_capabilities();
  if (const std::optional<std::string> fixed = env("ATEN_CPU_CAPABILITY")) capabilities = {*fixed};
  std::vector<CpuLayout> out;
  for (const int t : threads)
    for (const std::string& capability : capabilities) out.push_back({t, capability});
  return out;
}

std::string layout_cache_key(int cores, int ranks, const std::vector<std::string>& command) {
  std::string text = host_cpu_model() + "|cores " + std::to_string(cores) + "|ranks " + std::to_string(ranks);
  for (const char* fixed :
       {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ATEN_CPU_CAPABILITY", "OMP_WAIT_POLICY", "OMP_PROC_BIND"})
    text += std::string("|") + fixed + "=" + env(fixed).value_or("");
  for (const std::string& arg : command) {
    text += "|" + arg;
    // A file named by the argument, or by its value (--config=FILE).
    const size_t equals = arg.find('=');
    for (const std::string& path : {arg, equals == std::string::npos ? std::string() : arg.substr(equals + 1)}) {
      std::error_code error;
      if (path.empty() || !fs::is_regular_file(path, error)) continue;
      std::ifstream in(path, std::ios::binary);
      uint64_t hash = fnv1a("");
      char buffer[65536];
      while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0)
        hash = fnv1a(std::string(buffer, static_cast<size_t>(in.gcount())), hash);
      text += "|" + std::to_string(hash);
    }
  }
  std::ostringstream key;
  key << std::hex << fnv1a(text);
  return key.str();
}

fs::path layout_cache_path() {
  const std::optional<std::string> home = env("HOME");
  return fs::path(home.value_or("/tmp")) / ".cache/hyperparallel/cpu_layout.json";
}

std::optional<CachedLayout> cached_layout(const fs::path& cache, const std::string& key) {
  const nlohmann::json cached = read_cache(cache);
  const auto hit = cached.find(key);
  if (hit == cached.end() || !hit->is_object()) return std::nullopt;
  const nlohmann::json& e = *hit;
  if (!e.contains("threads") || !e["threads"].is_number_integer() || e["threads"].get<int>() < 1 ||
      e["threads"].get<int>() > 4096 || !e.contains("capability") || !e["capability"].is_string() ||
      !e.contains("throughput") || !e["throughput"].is_number() || !e.contains("measured") ||
      !e["measured"].is_string())
    return std::nullopt;
  return CachedLayout{{e["threads"].get<int>(), e["capability"].get<std::string>()},
                      e["throughput"].get<double>(),
                      e["measured"].get<std::string>()};
}

void cache_layout(const fs::path& cache, const std::string& key, const CpuLayout& layout, double throughput) {
  nlohmann::json cached = read_cache(cache);
  cached[key] = {{"threads", layout.threads},
                 {"capability", layout.capability},
                 {"throughput", throughput},
                 {"measured", utc_now()}};
  std::error_code ignored;
  fs::create_directories(cache.parent_path(), ignored);
  const fs::path aside = cache.string() + "." + std::to_string(::getpid()) + ".tmp";
  std::ofstream out(aside, std::ios::trunc);
  out << cached.dump(2) << "\n";
  out.close();
  // A file not written whole must not replace the cache (it would read back as empty).
  std::error_code renamed;
  if (out) fs::rename(aside, cache, renamed);
  if (!out || renamed) fs::remove(aside, ignored);
}

}  // namespace hp::hprun
