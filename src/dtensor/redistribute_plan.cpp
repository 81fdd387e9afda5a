// The redistribute planner: a pure function of (src, dst) placements, memoized.
#include <map>
#include <mutex>

#include "hp/core/error.h"
#include "hp/dtensor/redistribute.h"

namespace hp {
namespace {

using Kind = RedistributeStep::Kind;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kChunk:
      return "chunk";
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllToAll:
      return "all_to_all";
    case Kind::kPartition:
      return "partition";
  }
  return "?";
}

bool touches(const Placement& p, int64_t dim) { return p.is_shard(dim); }

// True when no mesh dim other than `except` shards tensor dim d or e in src or dst, so an
// S(d) -> S(e) change on `except` is a plain all_to_all.
bool nesting_free(const Placements& src, const Placements& dst, size_t except, int64_t d, int64_t e) {
  for (size_t j = 0; j < src.size(); ++j) {
    if (j == except) continue;
    if (touches(src[j], d) || touches(src[j], e) || touches(dst[j], d) || touches(dst[j], e)) return false;
  }
  return true;
}

// One forward transition on mesh dim i, from a placement that is not a Shard needing a gather.
RedistributeStep forward_step(int64_t i, const Placement& from, const Placement& to, const Placements& src,
                              const Placements& dst) {
  auto fail = [&] {
    throw Error("redistribute: no plan for " + from.str() + " -> " + to.str() + " on mesh dim " + std::to_string(i) +
                " (" + to_string(src) + " -> " + to_string(dst) + "); go through Replicate");
  };
  if (from.is_replicate()) return {to.is_shard() ? Kind::kChunk : Kind::kPartition, i, from, to};
  if (from.is_partial()) {
    if (to.is_partial()) fail();  // a different reduce op
    return {to.is_shard() ? Kind::kReduceScatter : Kind::kAllReduce, i, from, to};
  }
  if (!to.is_shard()) fail();  // unreachable: such shards are gathered in the first phase
  return {Kind::kAllToAll, i, from, to};
}

std::vector<RedistributeStep> plan_uncached(const Placements& src, const Placements& dst) {
  const size_t n = src.size();
  // 1. Which mesh dims must be gathered to Replicate first (from the last backwards).
  std::vector<bool> gather(n, false);
  for (size_t k = 0; k < n; ++k) {
    if (!src[k].is_shard() || src[k] == dst[k]) continue;
    const bool a2a = dst[k].is_shard() && nesting_free(src, dst, k, src[k].dim(), dst[k].dim());
    gather[k] = !a2a;
  }
  for (bool changed = true; changed;) {  // to a fixpoint
    changed = false;
    for (size_t k = 0; k < n; ++k) {
      if (gather[k] || !src[k].is_shard()) continue;
      const int64_t d = src[k].dim();
      for (size_t i = 0; i < n && !gather[k]; ++i) {
        // An earlier mesh dim changes how d is split, or a gathered earlier dim splits d too:
        // k's (inner) split must be undone first.
        const bool earlier_change = i < k && src[i] != dst[i] && (touches(src[i], d) || touches(dst[i], d));
        const bool earlier_gathered = i < k && gather[i] && touches(src[i], d);
        gather[k] = earlier_change || earlier_gathered;
      }
      changed = changed || gather[k];
    }
  }
  std::vector<RedistributeStep> steps;
  Placements current = src;
  for (size_t k = n; k-- > 0;) {
    if (!gather[k]) continue;
    steps.push_back({Kind::kAllGather, static_cast<int64_t>(k), current[k], Replicate()});
    current[k] = Replicate();
  }
  // 2. Every remaining transition, first mesh dim first.
  for (size_t i = 0; i < n; ++i) {
    if (current[i] == dst[i]) continue;
    steps.push_back(forward_step(static_cast<int64_t>(i), current[i], dst[i], src, dst));
    current[i] = dst[i];
  }
  return steps;
}

}  // namespace

std::string RedistributeStep::str() const {
  return "mesh dim " + std::to_string(mesh_dim) + ": " + from.str() + " -> " + to.str() + " (" + kind_name(kind) + ")";
}

std::vector<RedistributeStep> plan_redistribute(const Placements& src, const Placements& dst) {
  HP_CHECK(src.size() == dst.size(), "redistribute: ", to_string(src), " and ", to_string(dst),
           " are for meshes with different numbers of dims");
  // Memoized: plans are pure functions of the two placement lists.
  static std::mutex mu;
  static std::map<std::string, std::vector<RedistributeStep>> cache;
  const std::string key = to_string(src) + "->" + to_string(dst);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  std::vector<RedistributeStep> plan = plan_uncached(src, dst);
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, plan);
  return plan;
}

}  // namespace hp
