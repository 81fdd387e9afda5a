// The zero-bubble family (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): ZB-H1 and ZB-H2 with
// one stage per rank, and ZB-V with two stages per rank in a V, each built for given F / I / W
// (and send) costs by placing actions in the papers' pattern (src/pp/placer.h).
#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <set>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"
#include "pp/candidates.h"
#include "pp/placer.h"

namespace hp::pp {
namespace {

constexpr ActionKind kF = ActionKind::kForward;
constexpr ActionKind kI = ActionKind::kBackwardInput;

// ZB-H1 / ZB-H2: 1F1B's order with the backward split, a longer warm-up for H2, and each rank's W
// passes placed where they end before the next input arrives, or where the cap forces them.
Schedule place_h(const std::string& name, int ranks, int micro_batches, const ActionCosts& costs, int cap,
                 const std::function<int(int)>& warmup) {
  const int p = ranks, m = micro_batches;
  Placer placer(empty_schedule(name, p, m, false), costs, cap);
  std::vector<int> forwards(p, 0), inputs(p, 0);
  const auto forward = [&](int r) {
    placer.make_room(r);
    placer.fill_weights(r, placer.input_ready(kF, r, forwards[r]));
    placer.place(kF, r, forwards[r]++);
  };
  for (int k = 0; k < m; ++k)
    for (int r = 0; r < p; ++r)
      if (forwards[r] < std::min(warmup(r), m)) forward(r);
  for (int left = p * m; left > 0;) {
    int placed = 0;
    for (int r = p - 1; r >= 0; --r)
      if (inputs[r] < forwards[r] && placer.placeable(kI, r, inputs[r])) {
        placer.fill_weights(r, placer.input_ready(kI, r, inputs[r]));
        placer.place(kI, r, inputs[r]++);
        ++placed, --left;
      }
    for (int r = 0; r < p; ++r)
      if (forwards[r] < m && placer.placeable(kF, r, forwards[r])) forward(r), ++placed;
    HP_CHECK(placed > 0, "pp: ", name, " generation stalled");
  }
  return placer.finish();
}

// ZB-V: rank r holds stage r (going down) and stage 2p-1-r (coming back up). The paper's order:
// a warm-up of forwards sized to the memory cap, then rounds in which every rank places one I and
// one F, each preceded by the W passes that end before its input arrives; a rank whose idle time
// is below the worst rank's may also place one W that ends after (it has slack to spend), as the
// paper's generator does.
struct VRound {
  bool fill_before_forward = true;
  bool fill_before_input = true;
  std::vector<double> approved;  // a previous try's idle per rank (empty on the first try)
};

class VBuilder {
 public:
  VBuilder(int ranks, int micro_batches, const ActionCosts& costs)
      : p_(ranks), m_(micro_batches), placer_(empty_schedule("ZBV", ranks, micro_batches, true), costs, 2 * ranks) {}

  Schedule build(const VRound& options) {
    options_ = options;
    warm_up();
    for (int round = 0; round < 2 * m_; ++round) {
      input_step();
      forward_step();
    }
    drain();
    for (int r = 0; r < p_; ++r) idle_.push_back(placer_.idle(r));
    return placer_.finish();
  }
  const std::vector<double>& idle() const { return idle_; }

 private:
  int down(int r) const { return r; }             // the stage going down
  int up(int r) const { return 2 * p_ - 1 - r; }  // the stage coming back up
  bool try_place(ActionKind kind, int stage, std::vector<int>& count, int r, bool fill, bool spend_slack) {
    if (count[r] >= m_ || !placer_.placeable(kind, stage, count[r])) return false;
    // At the cap with nothing to free yet (the warm-up's forwards only): not now.
    if (kind == kF && placer_.in_flight(r) >= placer_.cap() && !placer_.pending_weights(r)) return false;
    if (kind == kF) placer_.make_room(r);
    if (fill) {
      const double arrives = placer_.input_ready(kind, stage, count[r]);
      placer_.fill_weights(r, arrives);
      if (spend_slack && placer_.pending_weights(r) && arrives - placer_.clock(r) > slack(r)) placer_.place_weight(r);
    }
    placer_.place(kind, stage, count[r]++);
    return true;
  }
  bool forward(int r, bool down_stage, bool fill = false) {
    return down_stage ? try_place(kF, down(r), f_down_, r, fill && r > 0, options_.fill_before_forward)
                      : try_place(kF, up(r), f_up_, r, fill && r < p_ - 1, options_.fill_before_forward);
  }
  // The idle time rank r may still spend: how far it is below the worst rank (of this try, or of
  // the approved previous one).
  double slack(int r) const {
    double worst = 0.0;
    for (int q = 0; q < p_; ++q) worst = std::max(worst, placer_.idle(q));
    if (!options_.approved.empty()) {
      const double most = *std::max_element(options_.approved.begin(), options_.approved.end());
      worst = std::max(worst, most - options_.approved[r]);
    }
    return worst - placer_.idle(r);
  }

  void warm_up() {
    for (int r = 0; r < p_; ++r) forward(r, true);
    // From the bottom of the V up: before rank r's first up-stage forward arrives, its down stage
    // (and those above it) run as many forwards as fit in the wait and in memory.
    for (int r = p_ - 1; r >= 0; --r) {
      if (r < p_ - 1) {
        const double arrives = placer_.input_ready(kF, up(r), f_up_[r]);
        while (placer_.in_flight(r) + 2 + 2 * r <= placer_.cap() &&
               placer_.clock(r) + placer_.cost(kF, down(r)) + placer_.overhead() <= arrives && f_down_[r] < m_ - r)
          for (int j = 0; j <= r; ++j) forward(j, true);
      }
      forward(r, false);
    }
    // Then every rank catches up with the one above it, alternating the two stages.
    bool down_stage = true;
    for (int r = 1; r < p_; ++r)
      while (f_down_[r] + f_up_[r] < f_down_[r - 1] + f_up_[r - 1] || (f_up_[r] <= f_up_[r - 1] && f_up_[r - 1] < m_)) {
        bool any = false;
        for (int j = p_ - 1; j >= r; --j) any = forward(j, down_stage) || any;
        down_stage = !down_stage;
        if (!any && !forward_possible(r)) break;
      }
  }
  bool forward_possible(int r) const {
    return (f_down_[r] < m_ && placer_.placeable(kF, down(r), f_down_[r])) ||
           (f_up_[r] < m_ && placer_.placeable(kF, up(r), f_up_[r]));
  }

  void input_step() {
    // Which stage's I each rank runs next: the up stage's (the backward reaches it first) unless
    // the down stage's input gradient is already there.
    std::vector<int> down_ranks, up_ranks;
    for (int r = 0; r < p_; ++r) {
      const bool down_ready =
          i_down_[r] < i_up_[r] && (r == p_ - 1 || placer_.placed(kI, down(r + 1), i_down_[r]) || i_up_[r] >= m_);
      (down_ready ? down_ranks : up_ranks).push_back(r);
    }
    for (auto it = down_ranks.rbegin(); it != down_ranks.rend(); ++it)
      try_place(kI, down(*it), i_down_, *it, *it < p_ - 1, true);
    for (int r : up_ranks) try_place(kI, up(r), i_up_, r, r > 0, options_.fill_before_input);
  }

  void forward_step() {
    for (int r = 0; r < p_; ++r) {
      if (f_up_[r] >= m_) continue;
      if (f_up_[r] >= f_down_[r]) {
        forward(r, true, true);
      } else if (r == p_ - 1 || placer_.placed(kF, up(r + 1), f_up_[r])) {
        forward(r, false, true);
      } else {
        forward(r, true, true);
      }
    }
  }

  // Whatever the rounds left (a shape the pattern does not cover), in dependency order.
  void drain() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = p_ - 1; r >= 0; --r) progress = try_place(kI, down(r), i_down_, r, false, false) || progress;
      for (int r = 0; r < p_; ++r) progress = try_place(kI, up(r), i_up_, r, false, false) || progress;
      for (int r = 0; r < p_; ++r) progress = forward(r, true) || progress;
      for (int r = p_ - 1; r >= 0; --r) progress = forward(r, false) || progress;
    }
  }

  int p_, m_;
  Placer placer_;
  VRound options_;
  std::vector<int> f_down_ = std::vector<int>(p_, 0), f_up_ = f_down_, i_down_ = f_down_, i_up_ = f_down_;
  std::vector<double> idle_;
};

// The first ZBV order: a greedy list schedule in time (at time 0 and every completion, each free
// rank starts a ready I, deepest stage first; else a forward while under the cap; else a W).
// Kept as a candidate: for a few shapes it is the better one. Its own clock leaves out send and
// overhead (the candidates are compared by simulate(), which has them). It can fill a rank's cap of
// 2 x ranks with forwards that wait on a backward the cap holds back; then it has no order
// (nullopt).
std::optional<Schedule> greedy_v(int ranks, int micro_batches, const ActionCosts& costs) {
  const int stages = 2 * ranks, cap = 2 * ranks;
  Schedule s = empty_schedule("ZBV", ranks, micro_batches, true);
  s.programs.resize(ranks);
  const double never = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> f_done(stages, std::vector<double>(micro_batches, never)), i_done = f_done,
                                                                                              w_done = f_done;
  std::vector<int> in_flight(ranks, 0), remaining(ranks, 3 * 2 * micro_batches);
  std::vector<double> free_at(ranks, 0.0);
  std::set<double> events = {0.0};
  int total = ranks * 3 * 2 * micro_batches;
  while (total > 0) {
    if (events.empty()) return std::nullopt;
    const double t = *events.begin();
    events.erase(events.begin());
    for (int r = 0; r < ranks; ++r) {
      if (remaining[r] == 0 || free_at[r] > t) continue;
      const int mine[2] = {r, stages - 1 - r};
      std::optional<Action> pick;
      for (int k = 1; k >= 0 && !pick; --k)
        for (int m = 0; m < micro_batches && !pick; ++m) {
          const int st = mine[k];
          if (i_done[st][m] != never || f_done[st][m] > t) continue;
          if (st + 1 < stages && i_done[st + 1][m] > t) continue;
          pick = Action{kI, st, m};
        }
      for (int k = 1; k >= 0 && !pick && in_flight[r] < cap; --k)
        for (int m = 0; m < micro_batches && !pick; ++m) {
          const int st = mine[k];
          if (f_done[st][m] != never) continue;
          if (st > 0 && f_done[st - 1][m] > t) break;  // micro-batches reach a stage in order
          pick = Action{kF, st, m};
        }
      for (int m = 0; m < micro_batches && !pick; ++m)
        for (int k = 1; k >= 0 && !pick; --k) {
          const int st = mine[k];
          if (w_done[st][m] == never && i_done[st][m] <= t) pick = Action{ActionKind::kBackwardWeight, st, m};
        }
      if (!pick) continue;
      const Action a = *pick;
      const double end = t + costs.of(a.kind, a.stage);
      if (a.kind == kF) f_done[a.stage][a.micro_batch] = end, ++in_flight[r];
      if (a.kind == kI) i_done[a.stage][a.micro_batch] = end;
      if (a.kind == ActionKind::kBackwardWeight) w_done[a.stage][a.micro_batch] = end, --in_flight[r];
      s.programs[r].push_back(a);
      free_at[r] = end + costs.overhead;
      events.insert(end);
      events.insert(free_at[r]);
      --remaining[r];
      --total;
    }
  }
  add_communication(s);
  return s;
}

// The V orders the builder's variants give when built for `costs`.
void v_candidates(int ranks, int micro_batches, const ActionCosts& costs, std::vector<Schedule>& out) {
  if (std::optional<Schedule> greedy = greedy_v(ranks, micro_batches, costs)) out.push_back(*greedy);
  for (const bool before_input : {true, false})
    for (const bool before_forward : {true, false}) {
      // Each try that lowers the worst rank's idle time is tried again with the ranks' idle times
      // as their allowance, as the paper's generator does.
      VRound round{before_forward, before_input, {}};
      double worst = std::numeric_limits<double>::infinity();
      for (int attempt = 0; attempt < 16; ++attempt) {
        VBuilder builder(ranks, micro_batches, costs);
        out.push_back(builder.build(round));
        const double now = *std::max_element(builder.idle().begin(), builder.idle().end());
        if (now >= worst) break;
        worst = now;
        round.approved = builder.idle();
      }
    }
}

Schedule zero_bubble_h(const std::string& name, int ranks, int micro_batches, const ActionCosts& costs, int cap,
                       const std::function<int(int)>& warmup) {
  costs.check(ranks, "pp: " + name);
  return for_costs(
      [&](const ActionCosts& c, std::vector<Schedule>& out) {
        out.push_back(place_h(name, ranks, micro_batches, c, cap, warmup));
      },
      costs);
}

}  // namespace

Schedule zero_bubble_h1(int ranks, int micro_batches, const ActionCosts& costs) {
  return zero_bubble_h("ZB-H1", ranks, micro_batches, costs, ranks, [ranks](int r) { return ranks - r; });
}

Schedule zero_bubble_h2(int ranks, int micro_batches, const ActionCosts& costs) {
  return zero_bubble_h("ZB-H2", ranks, micro_batches, costs, 2 * ranks - 1,
                       [ranks](int r) { return 2 * (ranks - r) - 1; });
}

Schedule zero_bubble_v(int ranks, int micro_batches) { return zero_bubble_v(ranks, micro_batches, ActionCosts{}); }

Schedule zero_bubble_v(int ranks, int micro_batches, const ActionCosts& costs) {
  costs.check(2 * ranks, "pp: ZBV");
  return for_costs(
      [&](const ActionCosts& c, std::vector<Schedule>& out) { v_candidates(ranks, micro_batches, c, out); }, costs);
}

}  // namespace hp::pp
