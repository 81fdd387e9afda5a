// Building a schedule by placing compute actions one at a time at the end of their rank's program,
// each as early as its inputs allow, as the zero-bubble papers' generators do. A builder places an
// action only once the actions it needs are placed, so its start is known exactly when it is
// placed, and so is the gap before it: W passes, which nothing waits for, fill such gaps when they
// finish before the input arrives.
//
// Memory is counted in micro-batch activations of a stage ("chunks"): F adds one, W (or B) frees
// it. A rank at its cap places its oldest W before the next F.
#pragma once

#include <deque>
#include <vector>

#include "hp/pp/schedule.h"

namespace hp::pp {

class Placer {
 public:
  // `cap`: the most chunks a rank may hold.
  Placer(Schedule skeleton, const ActionCosts& costs, int cap);

  // Whether the actions that F / I of (stage, micro-batch) needs are placed, and when its input is
  // there (its own rank's earlier actions aside). Not for W, which needs its own I only.
  bool placeable(ActionKind kind, int stage, int micro_batch) const;
  double input_ready(ActionKind kind, int stage, int micro_batch) const;

  // Places F or I of (stage, micro-batch); an F at the cap places the rank's oldest W first.
  void place(ActionKind kind, int stage, int micro_batch);
  // Places the rank's oldest pending W.
  void place_weight(int rank);
  // Places the rank's oldest W passes while it is at its cap.
  void make_room(int rank);
  // Places the rank's pending W passes, oldest first, while the next one and its overhead end by
  // `until`.
  void fill_weights(int rank, double until);

  int rank_of(int stage) const { return schedule_.stage_rank[stage]; }
  // When the rank can start its next action (after the last one's overhead).
  double clock(int rank) const { return clock_[rank]; }
  bool pending_weights(int rank) const { return !pending_w_[rank].empty(); }
  int in_flight(int rank) const { return in_flight_[rank]; }
  int cap() const { return cap_; }
  bool placed(ActionKind kind, int stage, int micro_batch) const { return ends_at(kind, stage, micro_batch) >= 0; }
  // Time rank `rank` has idled since its first action.
  double idle(int rank) const { return idle_[rank]; }
  double cost(ActionKind kind, int stage) const;
  double overhead() const { return costs_.overhead; }
  // When a placed F, I or W ends (-1: not placed): simulate() of finish()'s schedule agrees.
  double ends_at(ActionKind kind, int stage, int micro_batch) const;

  // The programs so far, every pending W placed at the end, with communication added. Validated.
  Schedule finish();

 private:
  void put(ActionKind kind, int stage, int micro_batch, double ready);
  Schedule schedule_;
  ActionCosts costs_;
  int cap_;
  std::vector<int> in_flight_;
  std::vector<double> clock_, idle_;
  std::vector<bool> started_;
  std::vector<std::deque<Action>> pending_w_;
  // Ends of placed F, I and W by [kind][stage][micro-batch]; -1 until placed.
  std::vector<std::vector<std::vector<double>>> ends_;
};

}  // namespace hp::pp
