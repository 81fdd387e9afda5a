#include "train/peak_breakdown.h"

#include <algorithm>
#include <cctype>
#include <sstream>

namespace hp::train::detail {
namespace {

// "layers.3.attention.wq" -> "layers.3": up to the first numbered component, else the first one.
std::string block_of(const std::string& fqn) {
  size_t start = 0;
  while (start <= fqn.size()) {
    const size_t dot = fqn.find('.', start);
    const std::string part = fqn.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c); }))
      return fqn.substr(0, dot);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return fqn.substr(0, fqn.find('.'));
}

// The category of allocation `id`, and the block that made it ("" but for activations).
std::pair<std::string, std::string> category_of(int64_t id, const MemoryTimeline::Allocation& a,
                                                const TimelineNames& names) {
  if (const auto it = names.held.find(id); it != names.held.end()) return {it->second, ""};
  if (a.kind == MemoryLabel::kCommunication) return {kCommunicationBuffers, ""};
  if (a.kind == MemoryLabel::kModule) {
    const auto it = names.modules.find(a.module);
    if (it == names.modules.end()) return {kActivations, "(a module outside the model)"};
    return {kActivations, it->second.empty() ? std::string("(model)") : block_of(it->second)};
  }
  return {kTemporaries, ""};
}

bool lives_at(const MemoryTimeline::Allocation& a, int64_t event) {
  return a.allocated_at <= event && (a.freed_at < 0 || a.freed_at > event);
}

}  // namespace

PeakBreakdown break_down_peak(const std::vector<MemoryTimeline::Allocation>& allocations, int64_t events, int64_t from,
                              int64_t to, const TimelineNames& names, size_t top) {
  std::vector<int64_t> delta(static_cast<size_t>(events) + 1, 0);
  for (const MemoryTimeline::Allocation& a : allocations) {
    delta[static_cast<size_t>(a.allocated_at)] += a.bytes;
    if (a.freed_at >= 0) delta[static_cast<size_t>(a.freed_at)] -= a.bytes;
  }
  // The total after each event; the step's largest (ties: the first), from the total it starts
  // with (after event from - 1), where a tracker's reset_peak at the step's start begins.
  int64_t total = 0, peak = -1, peak_event = from - 1;
  for (int64_t e = 0; e < std::min(to, events); ++e) {
    if (e == from) peak = total;
    total += delta[static_cast<size_t>(e)];
    if (e >= from && total > peak) peak = total, peak_event = e;
  }
  PeakBreakdown out;
  for (const char* category :
       {kParameters, kGradients, kOptimizerState, kActivations, kCommunicationBuffers, kTemporaries})
    out.by_category[category] = 0;
  std::map<std::string, int64_t> contributors;
  for (size_t id = 0; id < allocations.size(); ++id) {
    const MemoryTimeline::Allocation& a = allocations[id];
    if (!lives_at(a, peak_event)) continue;
    const auto [category, block] = category_of(static_cast<int64_t>(id), a, names);
    out.bytes += a.bytes;
    out.by_category[category] += a.bytes;
    contributors[block.empty() ? category : category + " " + block] += a.bytes;
  }
  out.top.assign(contributors.begin(), contributors.end());
  std::stable_sort(out.top.begin(), out.top.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (out.top.size() > top) out.top.resize(top);
  return out;
}

std::string lifetimes_csv(const std::vector<MemoryTimeline::Allocation>& allocations, int64_t from, int64_t to,
                          const TimelineNames& names) {
  std::ostringstream out;
  out << "id,bytes,category,block,allocated_at,freed_at\n";
  for (size_t id = 0; id < allocations.size(); ++id) {
    const MemoryTimeline::Allocation& a = allocations[id];
    if (a.allocated_at >= to || (a.freed_at >= 0 && a.freed_at < from)) continue;
    const auto [category, block] = category_of(static_cast<int64_t>(id), a, names);
    out << id << "," << a.bytes << "," << category << "," << block << "," << a.allocated_at - from << ",";
    if (a.freed_at >= 0) out << a.freed_at - from;
    out << "\n";
  }
  return out.str();
}

}  // namespace hp::train::detail
