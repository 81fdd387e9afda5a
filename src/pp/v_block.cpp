// V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): ZB-V's V
// placement with less activation memory. Each is one building block repeated per micro-batch: the
// block gives each rank four slots, in unit time, for its down stage's F, its up stage's F, its up
// stage's I and its down stage's I; micro-batch k's slots are the block's plus 6k (four compute
// slots and two for W). How long the block keeps a rank's two stages alive decides the rank's
// peak: a tighter block holds less and idles more.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"
#include "pp/candidates.h"
#include "pp/placer.h"
#include "pp/v_block.h"

namespace hp::pp {
namespace {

constexpr ActionKind kF = ActionKind::kForward;
constexpr ActionKind kI = ActionKind::kBackwardInput;

struct VBlock {
  int down_forward, up_forward, up_input, down_input;
};

struct VFamily {
  std::string name;
  int cap;                     // the most stage micro-batches a rank holds
  std::vector<VBlock> blocks;  // rank r's slots
};

// The paper's two blocks (the offsets of its V-Half and V-Min patterns; the "interval" keeps a
// rank's four slots apart modulo 6). They hold (p + 2) / 2 and (p + 4) / 3 micro-batches of a 1F1B
// stage (rounded down), each two of our half-size stages.
VFamily v_family(bool half, int p) {
  VFamily f{half ? "V-Half" : "V-Min", 2 * (half ? (p + 2) / 2 : (p + 4) / 3), {}};
  for (int r = 0; r < p; ++r) {
    if (half) {
      const int interval = p % 2 == 0 ? 3 : 0;
      f.blocks.push_back({2 * r, 3 * p - 2 - r, 3 * p + interval + 2 * r - 1, 6 * p + interval - r - 2});
    } else {
      const int interval = p % 3 == 0 ? 2 : 0;
      f.blocks.push_back({r, 2 * p - 1 - r, 2 * p + interval + r, 4 * p + interval - 1 - r});
    }
  }
  return f;
}

// The paper's own order for the block (its generator, written here from its description): W passes
// in each rank's spare slots; then the warm-up and the cool-down move into earlier free slots
// where their inputs allow and the rank's memory stays within the block's peak, and the whole is
// squeezed (every action as early as its inputs allow, in unit time); the same again for F and I
// with W in the spare slots, each stage's W passes last in their own queue. Independent of costs.
// Its slot helpers also give the block's own order (place_v_block, below).
namespace generator {

// One rank's slots: [kind][micro-batch]. Kinds: its down stage's F, its up stage's F, its up
// stage's I, its down stage's I; then the W passes, in one queue (the k-th W frees the k-th I's
// activations) or two (the up stage's, then the down stage's).
using Slots = std::vector<std::vector<int>>;
enum Kind { kDownF, kUpF, kUpI, kDownI, kW, kDownW = 5 };

struct Event {
  int slot, kind, micro_batch;
  bool operator<(const Event& o) const {
    return std::tie(slot, kind, micro_batch) < std::tie(o.slot, o.kind, o.micro_batch);
  }
};

// Each rank's F and I slots over `m` micro-batches: the block's, plus 6k for micro-batch k.
std::vector<Slots> block_slots(const VFamily& family, int m) {
  std::vector<Slots> ranks;
  for (const VBlock& b : family.blocks) {
    Slots at(4);
    for (int k = 0; k < m; ++k) {
      at[kDownF].push_back(b.down_forward + 6 * k);
      at[kUpF].push_back(b.up_forward + 6 * k);
      at[kUpI].push_back(b.up_input + 6 * k);
      at[kDownI].push_back(b.down_input + 6 * k);
    }
    ranks.push_back(std::move(at));
  }
  return ranks;
}

// The rank's first `kinds` kinds of actions in slot order; one action per slot.
std::vector<Event> events(const Slots& at, int kinds) {
  std::vector<Event> out;
  for (int kind = 0; kind < kinds; ++kind)
    for (int mb = 0; mb < static_cast<int>(at[kind].size()); ++mb) out.push_back({at[kind][mb], kind, mb});
  std::sort(out.begin(), out.end());
  for (size_t i = 1; i < out.size(); ++i)
    HP_CHECK(out[i].slot != out[i - 1].slot, "pp: a V schedule's slots put two actions of a rank in slot ",
             out[i].slot);
  return out;
}

// Appends the W queue(s): each free slot takes a W of an I placed before it (the up stage's queue
// first when `split`); what is left goes after the last slot.
void put_weights(Slots& at, bool split) {
  const std::vector<Event> fi = events(at, 4);
  const int queues = split ? 2 : 1;
  at.resize(4 + queues);
  std::vector<int> pending(queues, 0);
  size_t next = 0;
  int slot = 0;
  for (; next < fi.size(); ++slot) {
    if (fi[next].slot == slot) {
      if (fi[next].kind == kUpI || fi[next].kind == kDownI) ++pending[split ? fi[next].kind - kUpI : 0];
      ++next;
      continue;
    }
    for (int q = 0; q < queues; ++q)
      if (pending[q] > 0) {
        at[4 + q].push_back(slot), --pending[q];
        break;
      }
  }
  for (int q = 0; q < queues; ++q)
    for (; pending[q] > 0; --pending[q]) at[4 + q].push_back(slot++);
}

// The most activations the rank holds: F adds one, W frees one; without W queues each free slot
// after an I frees one.
int peak(const Slots& at) {
  const bool explicit_weights = at.size() > 4;
  int held = 0, most = 0, pending = 0, previous = -1;
  for (const Event& e : events(at, static_cast<int>(at.size()))) {
    if (!explicit_weights) {
      const int freed = std::min(pending, e.slot - previous - 1);
      held -= freed, pending -= freed;
    }
    if (e.kind == kDownF || e.kind == kUpF) ++held;
    if (e.kind == kUpI || e.kind == kDownI) ++pending;
    if (e.kind >= kW) --held;
    most = std::max(most, held);
    previous = e.slot;
  }
  return most;
}

// The ranks' slots as a schedule: each rank's actions in slot order.
Schedule to_schedule(const std::string& name, const std::vector<Slots>& ranks, int micro_batches) {
  const int p = static_cast<int>(ranks.size());
  Schedule s = empty_schedule(name, p, micro_batches, true);
  s.programs.resize(p);
  for (int r = 0; r < p; ++r) {
    const int down = r, up = 2 * p - 1 - r;
    std::vector<Action> inputs;  // for one W queue: the k-th W is the k-th I's
    for (const Event& e : events(ranks[r], static_cast<int>(ranks[r].size()))) {
      Action a{kF, e.kind == kDownF || e.kind == kDownI ? down : up, e.micro_batch};
      if (e.kind == kUpI || e.kind == kDownI) a.kind = kI, inputs.push_back(a);
      const bool one_queue = ranks[r].size() == kW + 1;
      if (e.kind == kW) a = one_queue ? inputs.at(e.micro_batch) : Action{kI, up, e.micro_batch};
      if (e.kind == kDownW) a = Action{kI, down, e.micro_batch};
      if (e.kind >= kW) a.kind = ActionKind::kBackwardWeight;
      s.programs[r].push_back(a);
    }
  }
  add_communication(s);
  return s;
}

// Every action as early as its inputs allow in unit time (with one W queue).
std::vector<Slots> squeeze(const std::vector<Slots>& ranks, int micro_batches) {
  const int p = static_cast<int>(ranks.size());
  const Schedule s = to_schedule("squeeze", ranks, micro_batches);
  std::vector<Slots> out(p, Slots(5));
  for (Slots& at : out)
    for (int kind = 0; kind < 4; ++kind) at[kind].assign(micro_batches, 0);
  for (const TimedAction& t : simulate(s).timeline) {
    if (!t.action.is_compute()) continue;
    const int r = t.rank, slot = static_cast<int>(std::lround(t.start)), mb = t.action.micro_batch;
    const bool down = t.action.stage == r;
    if (t.action.kind == kF) out[r][down ? kDownF : kUpF][mb] = slot;
    if (t.action.kind == kI) out[r][down ? kDownI : kUpI][mb] = slot;
    if (t.action.kind == ActionKind::kBackwardWeight) out[r][kW].push_back(slot);
  }
  for (Slots& at : out) std::sort(at[kW].begin(), at[kW].end());
  return out;
}

// Moves actions of the warm-up (with W queued: before rank 0's first down-stage I) and of the
// cool-down (after rank 0's last down-stage F) into the earliest free slot their inputs allow that
// keeps the rank within the peak of all ranks; then squeezes.
std::vector<Slots> reorder(std::vector<Slots> ranks, bool with_weights, int micro_batches) {
  const int p = static_cast<int>(ranks.size());
  if (with_weights)
    for (Slots& at : ranks) put_weights(at, false);
  int cap = 0;
  for (const Slots& at : ranks) cap = std::max(cap, peak(at));
  const int kinds = with_weights ? 5 : 4;
  struct Item {
    int slot, rank, kind, micro_batch;
    bool operator<(const Item& o) const {
      return std::tie(slot, rank, kind, micro_batch) < std::tie(o.slot, o.rank, o.kind, o.micro_batch);
    }
  };
  std::vector<Item> items;
  for (int r = 0; r < p; ++r)
    for (const Event& e : events(ranks[r], kinds)) items.push_back({e.slot, r, e.kind, e.micro_batch});
  std::sort(items.begin(), items.end());
  std::vector<std::set<int>> taken(p);
  int phase = 0;  // 0: warm-up, 1: steady (kept), 2: cool-down
  for (const Item& it : items) {
    const int r = it.rank, kind = it.kind, mb = it.micro_batch;
    int& slot = ranks[r][kind][mb];
    if (phase == 0 && kind == kDownI && r == 0) phase = 1;
    const bool kept = phase == 1 || (phase == 0 && !with_weights);
    if (phase == 1 && kind == kDownF && mb == micro_batches - 1) phase = 2;
    if (kept) {
      taken[r].insert(slot);
      continue;
    }
    int after = -1;
    if ((kind == kDownF || kind == kUpI) && r > 0) after = std::max(after, ranks[r - 1][kind][mb]);
    if ((kind == kUpF || kind == kDownI) && r + 1 < p) after = std::max(after, ranks[r + 1][kind][mb]);
    if (kind > kDownF && kind < kW) after = std::max(after, ranks[r][kind - 1][mb]);
    if (kind == kW) {
      std::vector<int> inputs = ranks[r][kUpI];
      inputs.insert(inputs.end(), ranks[r][kDownI].begin(), ranks[r][kDownI].end());
      std::sort(inputs.begin(), inputs.end());
      after = std::max(after, inputs[mb]);
    }
    if (mb > 0) after = std::max(after, ranks[r][kind][mb - 1]);
    const int original = slot;
    for (int candidate = after + 1; candidate < original; ++candidate) {
      if (taken[r].count(candidate)) continue;
      slot = candidate;
      if (peak(ranks[r]) <= cap) break;
      slot = original;
    }
    taken[r].insert(slot);
  }
  if (!with_weights)
    for (Slots& at : ranks) put_weights(at, false);
  return squeeze(ranks, micro_batches);
}

Schedule order(const VFamily& family, int m) {
  std::vector<Slots> moved = reorder(block_slots(family, m), true, m);
  for (Slots& at : moved) at.resize(4);
  moved = reorder(std::move(moved), false, m);
  for (Slots& at : moved) at.resize(4), put_weights(at, true);
  Schedule s = to_schedule(family.name, moved, m);
  validate(s);
  return s;
}

}  // namespace generator

// Places each rank's actions in the order of the block's slots, every action as early as its inputs
// allow (the paper's "squeeze"). With `block_weights` each free slot after an I takes the rank's
// oldest pending W, as the paper lays W out; without, W passes go where the placer puts them: where
// they end before the next input arrives, or where the cap forces them.
Schedule place_v_block(const VFamily& family, int m, const ActionCosts& costs, bool block_weights) {
  const int p = static_cast<int>(family.blocks.size());
  Placer placer(empty_schedule(family.name, p, m, true), costs, family.cap);
  std::vector<generator::Slots> slots = generator::block_slots(family, m);
  if (block_weights)
    for (generator::Slots& at : slots) generator::put_weights(at, false);
  const Schedule listed = generator::to_schedule(family.name, slots, m);
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r)
    for (const Action& a : listed.programs[r])
      if (a.is_compute()) orders[r].push_back(a);
  std::vector<size_t> next(p, 0);
  size_t left = 0;
  for (const std::vector<Action>& order : orders) left += order.size();
  while (left > 0) {
    size_t placed = 0;
    for (int r = 0; r < p; ++r)
      for (; next[r] < orders[r].size(); ++next[r], ++placed) {
        const Action& a = orders[r][next[r]];
        if (a.kind == ActionKind::kBackwardWeight) {
          // The rank's oldest pending W, as the block lists them (the block stays within the cap,
          // so the placer never places one of them earlier).
          HP_CHECK(placer.pending_weights(r), "pp: ", family.name, "'s block lists a W before its I on rank ", r);
          placer.place_weight(r);
          continue;
        }
        if (!placer.placeable(a.kind, a.stage, a.micro_batch)) break;
        if (!block_weights) placer.fill_weights(r, placer.input_ready(a.kind, a.stage, a.micro_batch));
        placer.place(a.kind, a.stage, a.micro_batch);
      }
    HP_CHECK(placed > 0, "pp: ", family.name, " generation stalled");
    left -= placed;
  }
  return placer.finish();
}

// Every candidate: the block in its own order (W in the block's spare slots, or where the placer
// puts them), placed for `costs`, and the paper's generator's order (independent of costs, so
// built once).
Schedule v_block(bool half, int ranks, int micro_batches, const ActionCosts& costs) {
  const VFamily family = v_family(half, ranks);
  costs.check(2 * ranks, "pp: " + family.name);
  return for_costs(
      [&](const ActionCosts& c, std::vector<Schedule>& out) {
        for (const bool block_weights : {true, false})
          out.push_back(place_v_block(family, micro_batches, c, block_weights));
        if (!unit_costs(c)) return;
        // The paper moves actions only within the block's peak, which is the cap.
        Schedule paper = generator::order(family, micro_batches);
        const std::vector<int> peaks = peak_in_flight(paper);
        if (*std::max_element(peaks.begin(), peaks.end()) <= family.cap) out.push_back(std::move(paper));
      },
      costs);
}

}  // namespace

Schedule paper_v_order(bool half, int ranks, int micro_batches) {
  return generator::order(v_family(half, ranks), micro_batches);
}

Schedule v_half(int ranks, int micro_batches, const ActionCosts& costs) {
  return v_block(true, ranks, micro_batches, costs);
}

Schedule v_min(int ranks, int micro_batches, const ActionCosts& costs) {
  return v_block(false, ranks, micro_batches, costs);
}

}  // namespace hp::pp
