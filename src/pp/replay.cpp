// Replaying a schedule: the one engine behind validate() (zero costs: does it finish?) and
// simulate() (given costs: when does each action run?).
#include <algorithm>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"

namespace hp::pp {
namespace {

constexpr double kNotYet = -1.0;

// Completion times of what other actions wait for, by (what, stage, micro-batch).
enum class Event { kForward, kGradInput, kInputGradSent, kOutputSent, kRecvForward, kRecvBackward };
using Key = std::tuple<Event, int, int>;

void check_complete(const Schedule& s) {
  HP_CHECK(static_cast<int>(s.programs.size()) == s.ranks && static_cast<int>(s.stage_rank.size()) == s.stages,
           "pp: schedule '", s.name, "' has ", s.programs.size(), " programs for ", s.ranks, " ranks and ",
           s.stage_rank.size(), " stage placements for ", s.stages, " stages");
  std::map<std::tuple<ActionKind, int, int>, int> count;
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.programs[r]) {
      HP_CHECK(a.stage >= 0 && a.stage < s.stages && a.micro_batch >= 0 && a.micro_batch < s.micro_batches,
               "pp: ", s.name, ": action ", a.str(), " on rank ", r, " is outside ", s.stages, " stages x ",
               s.micro_batches, " micro-batches");
      HP_CHECK(s.stage_rank[a.stage] == r, "pp: ", s.name, ": action ", a.str(), " is on rank ", r, " but stage ",
               a.stage, " runs on rank ", s.stage_rank[a.stage]);
      ++count[{a.kind, a.stage, a.micro_batch}];
    }
  const auto n = [&](ActionKind k, int stage, int mb) {
    const auto it = count.find({k, stage, mb});
    return it == count.end() ? 0 : it->second;
  };
  for (int stage = 0; stage < s.stages; ++stage)
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      const std::string where = "stage " + std::to_string(stage) + " micro-batch " + std::to_string(mb);
      HP_CHECK(n(ActionKind::kForward, stage, mb) == 1, "pp: ", s.name, ": ", where, " has ",
               n(ActionKind::kForward, stage, mb), " forwards (needs exactly one)");
      const int full = n(ActionKind::kBackward, stage, mb), input = n(ActionKind::kBackwardInput, stage, mb),
                weight = n(ActionKind::kBackwardWeight, stage, mb);
      HP_CHECK((full == 1 && input == 0 && weight == 0) || (full == 0 && input == 1 && weight == 1), "pp: ", s.name,
               ": ", where, " has ", full, " full backward(s), ", input, " I and ", weight,
               " W (needs one B, or one I and one W)");
      // Messages exactly where a neighbouring stage lives on another rank, nowhere else.
      const bool next_remote = stage + 1 < s.stages && s.stage_rank[stage + 1] != s.stage_rank[stage];
      const bool prev_remote = stage > 0 && s.stage_rank[stage - 1] != s.stage_rank[stage];
      for (const auto& [kind, wanted] : {std::pair<ActionKind, bool>{ActionKind::kSendForward, next_remote},
                                         {ActionKind::kRecvBackward, next_remote},
                                         {ActionKind::kRecvForward, prev_remote},
                                         {ActionKind::kSendBackward, prev_remote}})
        HP_CHECK(n(kind, stage, mb) == (wanted ? 1 : 0), "pp: ", s.name, ": ", where, " has ", n(kind, stage, mb), " ",
                 Action{kind, stage, mb}.str(), " (needs ", wanted ? "exactly one" : "none",
                 ": the neighbouring stage is ", wanted ? "on another rank" : "on this rank or absent", ")");
    }
}

}  // namespace

// Replays with `costs`; throws naming each rank's blocked action when no rank can go on.
std::vector<TimedAction> replay(const Schedule& s, const ActionCosts& costs) {
  check_complete(s);
  costs.check(s.stages, "pp: simulating schedule '" + s.name + "'");
  std::map<Key, double> done;
  const auto when = [&](Event e, int stage, int mb) {
    const auto it = done.find({e, stage, mb});
    return it == done.end() ? kNotYet : it->second;
  };
  std::vector<size_t> pc(s.ranks, 0);
  std::vector<double> clock(s.ranks, 0.0);
  std::vector<TimedAction> timeline;
  // Each rank advances while its next action's inputs exist; a full pass without progress is a deadlock.
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      for (; pc[r] < s.programs[r].size(); ++pc[r]) {
        const Action& a = s.programs[r][pc[r]];
        const int st = a.stage, mb = a.micro_batch;
        const bool prev_here = st > 0 && s.stage_rank[st - 1] == r,
                   next_here = st + 1 < s.stages && s.stage_rank[st + 1] == r;
        double ready = 0.0;
        switch (a.kind) {
          case ActionKind::kForward:
            ready =
                st == 0 ? 0.0 : when(prev_here ? Event::kForward : Event::kRecvForward, st - (prev_here ? 1 : 0), mb);
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput: {
            const double fwd = when(Event::kForward, st, mb);
            const double grad = st + 1 == s.stages ? 0.0
                                                   : when(next_here ? Event::kGradInput : Event::kRecvBackward,
                                                          st + (next_here ? 1 : 0), mb);
            ready = fwd == kNotYet || grad == kNotYet ? kNotYet : std::max(fwd, grad);
            break;
          }
          case ActionKind::kBackwardWeight:
            ready = when(Event::kGradInput, st, mb);
            break;
          case ActionKind::kSendForward:
            ready = when(Event::kForward, st, mb);
            break;
          case ActionKind::kSendBackward:
            ready = when(Event::kGradInput, st, mb);
            break;
          case ActionKind::kRecvForward: {
            const double sent = when(Event::kOutputSent, st - 1, mb);
            ready = sent == kNotYet ? kNotYet : sent + costs.send;
            break;
          }
          case ActionKind::kRecvBackward: {
            const double sent = when(Event::kInputGradSent, st + 1, mb);
            ready = sent == kNotYet ? kNotYet : sent + costs.send;
            break;
          }
        }
        if (ready == kNotYet) break;
        const double reached = clock[r];  // a receive waits from here, as the executor records it
        const double start = std::max(clock[r], ready), end = start + costs.of(a.kind, st);
        clock[r] = a.is_compute() ? end + costs.overhead : clock[r];
        switch (a.kind) {
          case ActionKind::kForward:
            done[{Event::kForward, st, mb}] = end;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            done[{Event::kGradInput, st, mb}] = end;
            break;
          case ActionKind::kBackwardWeight:
            break;
          case ActionKind::kSendForward:
            done[{Event::kOutputSent, st, mb}] = start;
            break;
          case ActionKind::kSendBackward:
            done[{Event::kInputGradSent, st, mb}] = start;
            break;
          case ActionKind::kRecvForward:
            done[{Event::kRecvForward, st, mb}] = start;
            break;
          case ActionKind::kRecvBackward:
            done[{Event::kRecvBackward, st, mb}] = start;
            break;
        }
        const bool receive = a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward;
        if (receive) clock[r] = std::max(clock[r], start);
        timeline.push_back({a, r, receive ? reached : start, a.is_compute() ? end : start});
        progress = true;
      }
    }
  }
  std::ostringstream blocked;
  for (int r = 0; r < s.ranks; ++r)
    if (pc[r] < s.programs[r].size()) blocked << " rank " << r << " waits at " << s.programs[r][pc[r]].str() << ";";
  HP_CHECK(blocked.str().empty(), "pp: schedule '", s.name, "' deadlocks:", blocked.str(),
           " (a receive whose send never runs, or a cycle of them)");
  return timeline;
}

void validate(const Schedule& s) { replay(s, ActionCosts{}); }

std::vector<int> peak_in_flight(const Schedule& s) {
  std::vector<int> peak(s.ranks, 0);
  for (int r = 0; r < s.ranks; ++r) {
    int live = 0;
    for (const Action& a : s.programs[r]) {
      if (a.kind == ActionKind::kForward) peak[r] = std::max(peak[r], ++live);
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --live;
    }
  }
  return peak;
}

Simulation simulate(const Schedule& s, const ActionCosts& costs) { return measured(replay(s, costs), s.ranks); }

Simulation measured(std::vector<TimedAction> timeline, int ranks) {
  Simulation sim;
  if (timeline.empty()) return sim;
  double start = timeline.front().start, end = timeline.front().end, busy = 0.0;
  for (const TimedAction& t : timeline) start = std::min(start, t.start), end = std::max(end, t.end);
  for (TimedAction& t : timeline) {
    t.start -= start, t.end -= start;
    if (t.action.is_compute()) busy += t.end - t.start;
  }
  sim.makespan = end - start;
  sim.bubble = sim.makespan > 0 ? 1.0 - busy / (ranks * sim.makespan) : 0.0;
  struct Span {
    double first = std::numeric_limits<double>::infinity(), last = 0.0, busy = 0.0;
  };
  std::vector<Span> spans(ranks);
  for (const TimedAction& t : timeline) {
    if (!t.action.is_compute() || t.rank < 0 || t.rank >= ranks) continue;
    Span& span = spans[t.rank];
    span.first = std::min(span.first, t.start), span.last = std::max(span.last, t.end), span.busy += t.end - t.start;
  }
  for (const Span& span : spans)
    if (span.last > span.first)
      sim.per_stage_bubble = std::max(sim.per_stage_bubble, 1.0 - span.busy / (span.last - span.first));
  sim.timeline = std::move(timeline);
  return sim;
}

}  // namespace hp::pp
