// Action costs: what the simulator and the cost-aware builders charge, and how a measured step
// gives them.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

double ActionCosts::of(ActionKind kind, int stage) const {
  const bool own = !by_stage.empty();
  HP_CHECK(!own || (stage >= 0 && stage < static_cast<int>(by_stage.size())), "pp: costs for ", by_stage.size(),
           " stages asked for stage ", stage);
  const StageCosts& c = own ? by_stage[stage] : StageCosts{forward, backward_input, backward_weight};
  switch (kind) {
    case ActionKind::kForward:
      return c.forward;
    case ActionKind::kBackward:
      return c.backward_input + c.backward_weight;
    case ActionKind::kBackwardInput:
      return c.backward_input;
    case ActionKind::kBackwardWeight:
      return c.backward_weight;
    default:
      return 0.0;
  }
}

void ActionCosts::check(int stages, const std::string& who) const {
  HP_CHECK(send >= 0 && overhead >= 0, who, " needs a send cost and an overhead >= 0, got ", send, " and ", overhead);
  HP_CHECK(by_stage.empty() || static_cast<int>(by_stage.size()) == stages, who, " has costs for ", by_stage.size(),
           " stages but ", stages, " stages");
  std::vector<StageCosts> all = by_stage;
  all.push_back({forward, backward_input, backward_weight});
  for (size_t s = 0; s < all.size(); ++s)
    HP_CHECK(all[s].forward > 0 && all[s].backward_input > 0 && all[s].backward_weight > 0, who,
             " needs positive F, I and W costs, got F ", all[s].forward, ", I ", all[s].backward_input, ", W ",
             all[s].backward_weight, s < by_stage.size() ? " for stage " + std::to_string(s) : std::string());
}

namespace {

// Time spent in F, I, W and full B actions, and how many ran.
struct Spent {
  double time[4] = {0, 0, 0, 0};
  int count[4] = {0, 0, 0, 0};
  void add(ActionKind kind, double took) {
    const int k = static_cast<int>(kind);
    time[k] += took, ++count[k];
  }
  double mean(ActionKind kind) const {
    const int k = static_cast<int>(kind);
    return count[k] > 0 ? time[k] / count[k] : 0.0;
  }
  // Mean F, I and W; full backwards count half to each of I and W when there are no split ones.
  StageCosts costs() const {
    if (count[int(ActionKind::kBackwardInput)] > 0 && count[int(ActionKind::kBackwardWeight)] > 0)
      return {mean(ActionKind::kForward), mean(ActionKind::kBackwardInput), mean(ActionKind::kBackwardWeight)};
    const double half = mean(ActionKind::kBackward) / 2;
    return {mean(ActionKind::kForward), half, half};
  }
};

struct RankTime {
  double first = std::numeric_limits<double>::infinity(), last = -std::numeric_limits<double>::infinity();
  double accounted = 0.0;  // in compute actions and in receives (waits the simulator models)
  int computes = 0;
};

}  // namespace

std::optional<ActionCosts> parse_costs(const std::string& text) {
  std::vector<double> values;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string field = text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    if (field.empty() || field.find_first_not_of("0123456789.eE+-") != std::string::npos) return std::nullopt;
    char* end = nullptr;
    const double value = std::strtod(field.c_str(), &end);
    if (end != field.c_str() + field.size() || !std::isfinite(value) || value < 0 || value > 1e9) return std::nullopt;
    values.push_back(value);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (values.size() != 3 && values.size() != 4) return std::nullopt;
  if (values[0] <= 0 || values[1] <= 0 || values[2] <= 0) return std::nullopt;
  return ActionCosts{values[0], values[1], values[2], values.size() == 4 ? values[3] : 0.0};
}

ActionCosts measured_costs(const Simulation& measured) {
  Spent all;
  std::vector<Spent> stage;
  std::map<int, RankTime> ranks;
  // Sends by what they carry (forward?, receiving stage, micro-batch).
  std::map<std::tuple<bool, int, int>, double> sent;
  for (const TimedAction& t : measured.timeline) {
    const Action& a = t.action;
    const double took = t.end - t.start;
    RankTime& rank = ranks[t.rank];
    rank.first = std::min(rank.first, t.start), rank.last = std::max(rank.last, t.end);
    if (a.is_compute()) {
      all.add(a.kind, took);
      if (a.stage >= static_cast<int>(stage.size())) stage.resize(a.stage + 1);
      stage[a.stage].add(a.kind, took);
      rank.accounted += took, ++rank.computes;
    } else if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) {
      rank.accounted += took;
    } else {
      sent[{a.kind == ActionKind::kSendForward, a.stage + (a.kind == ActionKind::kSendForward ? 1 : -1),
            a.micro_batch}] = t.start;
    }
  }
  const bool split = all.count[int(ActionKind::kBackwardInput)] > 0 && all.count[int(ActionKind::kBackwardWeight)] > 0;
  HP_CHECK(all.count[int(ActionKind::kForward)] > 0 && (split || all.count[int(ActionKind::kBackward)] > 0),
           "pp: a measured step needs forward and backward actions (full B, or both I and W)");
  const StageCosts mean = all.costs();
  ActionCosts costs;
  costs.forward = mean.forward, costs.backward_input = mean.backward_input,
  costs.backward_weight = mean.backward_weight;
  for (const Spent& s : stage) {
    StageCosts own = s.costs();
    // A stage whose actions the step did not show takes the means.
    if (!(own.forward > 0)) own.forward = mean.forward;
    if (!(own.backward_input > 0)) own.backward_input = mean.backward_input;
    if (!(own.backward_weight > 0)) own.backward_weight = mean.backward_weight;
    costs.by_stage.push_back(own);
  }
  // Overhead: each rank's time outside compute actions and receives, per compute action.
  double outside = 0.0;
  int computes = 0;
  for (const auto& [rank, time] : ranks) outside += std::max(0.0, time.last - time.first - time.accounted);
  for (const auto& [rank, time] : ranks) computes += time.computes;
  costs.overhead = computes > 0 ? outside / computes : 0.0;
  std::vector<double> latencies;
  for (const TimedAction& t : measured.timeline) {
    const bool forward_message = t.action.kind == ActionKind::kRecvForward;
    if (!forward_message && t.action.kind != ActionKind::kRecvBackward) continue;
    const auto it = sent.find({forward_message, t.action.stage, t.action.micro_batch});
    if (it != sent.end() && t.start <= it->second) latencies.push_back(t.end - it->second);
  }
  if (!latencies.empty()) {
    std::nth_element(latencies.begin(), latencies.begin() + latencies.size() / 2, latencies.end());
    costs.send = std::max(0.0, latencies[latencies.size() / 2]);
  }
  return costs;
}

}  // namespace hp::pp
