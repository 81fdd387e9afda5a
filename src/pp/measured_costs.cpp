// Action costs from a measured step, for building a schedule for them.
#include <algorithm>
#include <map>
#include <tuple>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

ActionCosts measured_costs(const Simulation& measured) {
  double forward = 0, input = 0, weight = 0, full = 0;
  int forwards = 0, inputs = 0, weights = 0, fulls = 0;
  // Sends by what they carry (kind, stage, micro-batch): the receive names the sending stage.
  std::map<std::tuple<bool, int, int>, double> sent;
  for (const TimedAction& t : measured.timeline) {
    const Action& a = t.action;
    const double took = t.end - t.start;
    switch (a.kind) {
      case ActionKind::kForward:
        forward += took, ++forwards;
        break;
      case ActionKind::kBackwardInput:
        input += took, ++inputs;
        break;
      case ActionKind::kBackwardWeight:
        weight += took, ++weights;
        break;
      case ActionKind::kBackward:
        full += took, ++fulls;
        break;
      case ActionKind::kSendForward:
        sent[{true, a.stage + 1, a.micro_batch}] = t.start;
        break;
      case ActionKind::kSendBackward:
        sent[{false, a.stage - 1, a.micro_batch}] = t.start;
        break;
      default:
        break;
    }
  }
  HP_CHECK(forwards > 0 && (inputs > 0 || fulls > 0), "pp: a measured step without forward and backward actions");
  ActionCosts costs;
  costs.forward = forward / forwards;
  if (inputs > 0 && weights > 0) {
    costs.backward_input = input / inputs;
    costs.backward_weight = weight / weights;
  } else {  // full backwards only: half each
    HP_CHECK(fulls > 0, "pp: a measured step with I actions but no W, or W but no I");
    costs.backward_input = costs.backward_weight = full / fulls / 2;
  }
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
