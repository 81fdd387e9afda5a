#include "pp/placer.h"

#include <algorithm>

#include "hp/core/error.h"

namespace hp::pp {
namespace {

int slot(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return 0;
    case ActionKind::kBackwardInput:
      return 1;
    case ActionKind::kBackwardWeight:
      return 2;
    default:
      HP_FAIL("pp: the placer places F, I and W only, not ", Action{kind, 0, 0}.str());
  }
}

}  // namespace

Placer::Placer(Schedule skeleton, const ActionCosts& costs, int cap)
    : schedule_(std::move(skeleton)), costs_(costs), cap_(cap) {
  const int ranks = schedule_.ranks;
  costs.check(schedule_.stages, "pp: schedule " + schedule_.name);
  HP_CHECK(cap_ >= 1, "pp: a rank's activation cap must be at least one micro-batch, got ", cap_);
  in_flight_.assign(ranks, 0);
  clock_.assign(ranks, 0.0);
  idle_.assign(ranks, 0.0);
  started_.assign(ranks, false);
  pending_w_.resize(ranks);
  schedule_.programs.assign(ranks, {});
  ends_.assign(3, std::vector<std::vector<double>>(schedule_.stages, std::vector<double>(schedule_.micro_batches, -1)));
}

double Placer::cost(ActionKind kind, int stage) const { return costs_.of(kind, stage); }

double Placer::ends_at(ActionKind kind, int stage, int micro_batch) const {
  return ends_[slot(kind)][stage][micro_batch];
}

bool Placer::placeable(ActionKind kind, int stage, int micro_batch) const {
  if (placed(kind, stage, micro_batch)) return false;
  if (kind == ActionKind::kForward) return stage == 0 || placed(kind, stage - 1, micro_batch);
  return placed(ActionKind::kForward, stage, micro_batch) &&
         (stage + 1 == schedule_.stages || placed(kind, stage + 1, micro_batch));
}

double Placer::input_ready(ActionKind kind, int stage, int micro_batch) const {
  const int from = kind == ActionKind::kForward ? stage - 1 : stage + 1;
  double ready = kind == ActionKind::kForward ? 0.0 : ends_at(ActionKind::kForward, stage, micro_batch);
  if (from >= 0 && from < schedule_.stages) {
    const double sent = ends_at(kind, from, micro_batch);
    // From another rank: the send goes after the producing action's overhead, as simulate() has it.
    ready = std::max(ready, sent + (rank_of(from) == rank_of(stage) ? 0.0 : costs_.overhead + costs_.send));
  }
  return ready;
}

void Placer::put(ActionKind kind, int stage, int micro_batch, double ready) {
  const int r = rank_of(stage);
  const double start = std::max(clock_[r], ready);
  if (started_[r]) idle_[r] += start - clock_[r];
  started_[r] = true;
  ends_[slot(kind)][stage][micro_batch] = start + cost(kind, stage);
  clock_[r] = start + cost(kind, stage) + costs_.overhead;
  schedule_.programs[r].push_back(Action{kind, stage, micro_batch});
}

void Placer::place(ActionKind kind, int stage, int micro_batch) {
  HP_CHECK(kind == ActionKind::kForward || kind == ActionKind::kBackwardInput, "pp: place() takes F or I");
  HP_CHECK(placeable(kind, stage, micro_batch), "pp: ", Action{kind, stage, micro_batch}.str(),
           " placed before its inputs (a schedule builder's bug)");
  const int r = rank_of(stage);
  if (kind == ActionKind::kForward) {
    make_room(r);
    ++in_flight_[r];
  } else {
    pending_w_[r].push_back(Action{ActionKind::kBackwardWeight, stage, micro_batch});
  }
  put(kind, stage, micro_batch, input_ready(kind, stage, micro_batch));
}

void Placer::place_weight(int rank) {
  HP_CHECK(!pending_w_[rank].empty(), "pp: rank ", rank, " has no pending W");
  const Action w = pending_w_[rank].front();
  pending_w_[rank].pop_front();
  --in_flight_[rank];
  put(ActionKind::kBackwardWeight, w.stage, w.micro_batch, ends_at(ActionKind::kBackwardInput, w.stage, w.micro_batch));
}

void Placer::make_room(int rank) {
  while (in_flight_[rank] >= cap_) {
    HP_CHECK(!pending_w_[rank].empty(), "pp: rank ", rank, " holds ", in_flight_[rank],
             " micro-batches, its cap, with no W to free one (a schedule builder's bug)");
    place_weight(rank);
  }
}

void Placer::fill_weights(int rank, double until) {
  while (!pending_w_[rank].empty() &&
         clock_[rank] + cost(ActionKind::kBackwardWeight, pending_w_[rank].front().stage) + costs_.overhead <= until)
    place_weight(rank);
}

Schedule Placer::finish() {
  for (int r = 0; r < schedule_.ranks; ++r)
    while (!pending_w_[r].empty()) place_weight(r);
  Schedule s = schedule_;
  add_communication(s);
  validate(s);
  return s;
}

}  // namespace hp::pp
