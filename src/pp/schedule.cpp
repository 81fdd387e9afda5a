// The schedule builders, communication insertion and the CSV form.
#include "hp/pp/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include "hp/core/error.h"

namespace hp::pp {
namespace {

const std::vector<std::pair<ActionKind, std::string>>& kind_names() {
  // Longest names first, so parsing finds "SEND_F" before "F".
  static const std::vector<std::pair<ActionKind, std::string>> names = {
      {ActionKind::kSendForward, "SEND_F"},  {ActionKind::kRecvForward, "RECV_F"},
      {ActionKind::kSendBackward, "SEND_B"}, {ActionKind::kRecvBackward, "RECV_B"},
      {ActionKind::kForward, "F"},           {ActionKind::kBackward, "B"},
      {ActionKind::kBackwardInput, "I"},     {ActionKind::kBackwardWeight, "W"}};
  return names;
}

Schedule skeleton(std::string name, int ranks, int stages, int micro_batches) {
  HP_CHECK(ranks >= 1 && micro_batches >= 1, "pp: ", name, " needs ranks >= 1 and micro_batches >= 1, got ", ranks,
           " and ", micro_batches);
  Schedule s;
  s.name = std::move(name);
  s.ranks = ranks;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.programs.resize(ranks);
  return s;
}

Action act(ActionKind kind, int stage, int micro_batch) { return Action{kind, stage, micro_batch}; }

}  // namespace

std::string Action::str() const {
  for (const auto& [k, name] : kind_names())
    if (k == kind) return std::to_string(stage) + name + std::to_string(micro_batch);
  return "?";
}

Action Action::parse(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  HP_CHECK(i > 0 && i < text.size(), "pp: '", text, "' is not an action (e.g. 0F3, 1B2, 2SEND_F0)");
  for (const auto& [kind, name] : kind_names()) {
    if (text.compare(i, name.size(), name) != 0) continue;
    const std::string mb = text.substr(i + name.size());
    HP_CHECK(!mb.empty() && mb.find_first_not_of("0123456789") == std::string::npos, "pp: '", text,
             "' has no micro-batch number after ", name);
    return Action{kind, std::stoi(text.substr(0, i)), std::stoi(mb)};
  }
  HP_FAIL("pp: '", text, "' has an unknown action kind (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)");
}

Schedule gpipe(int ranks, int micro_batches) {
  Schedule s = skeleton("GPipe", ranks, ranks, micro_batches);
  for (int r = 0; r < ranks; ++r) {
    s.stage_rank.push_back(r);
    for (int m = 0; m < micro_batches; ++m) s.programs[r].push_back(act(ActionKind::kForward, r, m));
    for (int m = 0; m < micro_batches; ++m) s.programs[r].push_back(act(ActionKind::kBackward, r, m));
  }
  add_communication(s);
  return s;
}

Schedule one_f_one_b(int ranks, int micro_batches) {
  Schedule s = skeleton("1F1B", ranks, ranks, micro_batches);
  for (int r = 0; r < ranks; ++r) {
    s.stage_rank.push_back(r);
    auto& program = s.programs[r];
    const int warmup = std::min(ranks - 1 - r, micro_batches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) program.push_back(act(ActionKind::kForward, r, f));
    for (; f < micro_batches; ++f, ++b) {
      program.push_back(act(ActionKind::kForward, r, f));
      program.push_back(act(ActionKind::kBackward, r, b));
    }
    for (; b < micro_batches; ++b) program.push_back(act(ActionKind::kBackward, r, b));
  }
  add_communication(s);
  return s;
}

Schedule interleaved_1f1b(int ranks, int stages_per_rank, int micro_batches) {
  HP_CHECK(stages_per_rank >= 1, "pp: interleaved 1F1B needs stages_per_rank >= 1");
  const int p = ranks, v = stages_per_rank;
  Schedule s = skeleton("Interleaved1F1B", ranks, p * v, micro_batches);
  for (int stage = 0; stage < p * v; ++stage) s.stage_rank.push_back(stage % p);
  // Megatron's order: micro-batches in groups of `ranks`; each group runs through the rank's
  // stages (chunks) in turn, forward in chunk order and backward in reverse chunk order.
  const int groups = (micro_batches + p - 1) / p;
  for (int r = 0; r < p; ++r) {
    std::vector<Action> forwards, backwards;
    for (int k = 0; k < groups * p * v; ++k) {
      const int group = k / (p * v), within = k % (p * v), chunk = within / p, mb = group * p + within % p;
      if (mb >= micro_batches) continue;
      forwards.push_back(act(ActionKind::kForward, chunk * p + r, mb));
      backwards.push_back(act(ActionKind::kBackward, (v - 1 - chunk) * p + r, mb));
    }
    const size_t warmup = std::min<size_t>(static_cast<size_t>((p - r - 1) * 2 + (v - 1) * p), forwards.size());
    auto& program = s.programs[r];
    size_t f = 0, b = 0;
    for (; f < warmup; ++f) program.push_back(forwards[f]);
    for (; f < forwards.size(); ++f, ++b) {
      program.push_back(forwards[f]);
      program.push_back(backwards[b]);
    }
    for (; b < backwards.size(); ++b) program.push_back(backwards[b]);
  }
  add_communication(s);
  return s;
}

void add_communication(Schedule& s) {
  HP_CHECK(static_cast<int>(s.stage_rank.size()) == s.stages, "pp: schedule '", s.name, "' places ",
           s.stage_rank.size(), " stages but has ", s.stages);
  std::vector<std::vector<Action>> out(s.ranks);
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.programs[r]) {
      if (!a.is_compute()) continue;
      const bool grad = a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
      const auto on = [&](int stage) { return stage >= 0 && stage < s.stages ? s.stage_rank[stage] : -1; };
      if (a.kind == ActionKind::kForward && a.stage > 0 && on(a.stage - 1) != r)
        out[r].push_back(act(ActionKind::kRecvForward, a.stage, a.micro_batch));
      if (grad && a.stage + 1 < s.stages && on(a.stage + 1) != r)
        out[r].push_back(act(ActionKind::kRecvBackward, a.stage, a.micro_batch));
      out[r].push_back(a);
      if (a.kind == ActionKind::kForward && a.stage + 1 < s.stages && on(a.stage + 1) != r)
        out[r].push_back(act(ActionKind::kSendForward, a.stage, a.micro_batch));
      if (grad && a.stage > 0 && on(a.stage - 1) != r)
        out[r].push_back(act(ActionKind::kSendBackward, a.stage, a.micro_batch));
    }
  s.programs = std::move(out);
}

std::string to_csv(const Schedule& s) {
  std::ostringstream out;
  out << "rank,actions\n";
  for (int r = 0; r < s.ranks; ++r) {
    out << r << ",";
    for (size_t i = 0; i < s.programs[r].size(); ++i) out << (i ? " " : "") << s.programs[r][i].str();
    out << "\n";
  }
  return out.str();
}

Schedule from_csv(const std::string& csv, const std::string& name) {
  std::istringstream in(csv);
  std::string line;
  HP_CHECK(std::getline(in, line) && line.rfind("rank,actions", 0) == 0, "pp: ", name,
           ": a schedule CSV starts with the header 'rank,actions'");
  Schedule s;
  s.name = name;
  std::map<int, int> stage_rank;
  for (int row = 2; std::getline(in, line); ++row) {
    if (line.empty()) continue;
    const auto comma = line.find(',');
    HP_CHECK(comma != std::string::npos, "pp: ", name, ":", row, ": expected 'rank,actions'");
    const int rank = std::stoi(line.substr(0, comma));
    HP_CHECK(rank == s.ranks, "pp: ", name, ":", row, ": rank ", rank, " out of order (expected ", s.ranks, ")");
    s.programs.emplace_back();
    std::istringstream actions(line.substr(comma + 1));
    for (std::string token; actions >> token;) {
      const Action a = Action::parse(token);
      s.programs.back().push_back(a);
      s.stages = std::max(s.stages, a.stage + 1);
      s.micro_batches = std::max(s.micro_batches, a.micro_batch + 1);
      if (!a.is_compute()) continue;
      const auto [it, fresh] = stage_rank.emplace(a.stage, rank);
      HP_CHECK(fresh || it->second == rank, "pp: ", name, ":", row, ": stage ", a.stage, " runs on ranks ", it->second,
               " and ", rank);
    }
    ++s.ranks;
  }
  for (int stage = 0; stage < s.stages; ++stage) {
    HP_CHECK(stage_rank.count(stage), "pp: ", name, ": stage ", stage, " has no compute action");
    s.stage_rank.push_back(stage_rank.at(stage));
  }
  validate(s);
  return s;
}

namespace {

struct Named {
  const char* name;
  int stages_per_rank;  // 0: the interleaved schedule's argument
  bool zero_bubble;     // orders for costs
  bool v_shape;         // rank r holds stages r and 2 ranks - 1 - r
  Schedule (*build)(int ranks, int micro_batches, int stages_per_rank, const ActionCosts& costs);
};
constexpr Named kNamed[] = {
    {"gpipe", 1, false, false, [](int p, int m, int, const ActionCosts&) { return gpipe(p, m); }},
    {"1f1b", 1, false, false, [](int p, int m, int, const ActionCosts&) { return one_f_one_b(p, m); }},
    {"interleaved", 0, false, false, [](int p, int m, int v, const ActionCosts&) { return interleaved_1f1b(p, v, m); }},
    {"zbv", 2, true, true, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_v(p, m, c); }},
    {"zbh1", 1, true, false, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_h1(p, m, c); }},
    {"zbh2", 1, true, false, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_h2(p, m, c); }},
    {"vhalf", 2, true, true, [](int p, int m, int, const ActionCosts& c) { return v_half(p, m, c); }},
    {"vmin", 2, true, true, [](int p, int m, int, const ActionCosts& c) { return v_min(p, m, c); }},
};

const Named* named(const std::string& name) {
  for (const Named& n : kNamed)
    if (name == n.name) return &n;
  return nullptr;
}

std::string names_where(bool (*keep)(const Named&)) {
  std::string all;
  for (const Named& n : kNamed)
    if (keep(n)) all += (all.empty() ? "" : ", ") + std::string(n.name);
  return all;
}

}  // namespace

const std::string& schedule_names() {
  static const std::string names = names_where([](const Named&) { return true; });
  return names;
}

const std::string& cost_ordered_schedule_names() {
  static const std::string names = names_where([](const Named& n) { return n.zero_bubble; });
  return names;
}

bool places_in_a_v(const std::string& name) {
  const Named* n = named(name);
  return n && n->v_shape;
}

int64_t schedule_stages(const std::string& name, int64_t ranks, int64_t stages_per_rank) {
  const Named* n = named(name);
  return n ? ranks * (n->stages_per_rank ? n->stages_per_rank : stages_per_rank) : 0;
}

bool orders_for_costs(const std::string& name) {
  const Named* n = named(name);
  return n && n->zero_bubble;
}

double peak_memory_in_1f1b_stages(const Schedule& schedule) {
  const std::vector<int> peaks = peak_in_flight(schedule);
  return *std::max_element(peaks.begin(), peaks.end()) * static_cast<double>(schedule.ranks) / schedule.stages;
}

Schedule lowest_bubble_within(int ranks, int micro_batches, double max_stages, const ActionCosts& costs) {
  HP_CHECK(costs.by_stage.empty(), "pp: lowest_bubble_within compares schedules of different stage counts, so it ",
           "takes costs without per-stage values");
  std::optional<Schedule> best;
  double lowest = 0.0, least = std::numeric_limits<double>::infinity();
  for (const Named& n : kNamed) {
    Schedule s = n.build(ranks, micro_batches, 2, costs);
    const double held = peak_memory_in_1f1b_stages(s);
    least = std::min(least, held);
    if (held > max_stages + 1e-9) continue;
    const double bubble = simulate(s, costs).bubble;
    if (!best || bubble < lowest - 1e-12) best = std::move(s), lowest = bubble;
  }
  HP_CHECK(best, "pp: no schedule of ", ranks, " ranks and ", micro_batches, " micro-batches holds at most ",
           max_stages, " micro-batches of a 1F1B stage per rank; the least is ", least);
  return std::move(*best);
}

Schedule schedule_by_name(const std::string& name, int ranks, int micro_batches, int stages_per_rank) {
  return schedule_by_name(name, ranks, micro_batches, stages_per_rank, ActionCosts{});
}

Schedule schedule_by_name(const std::string& name, int ranks, int micro_batches, int stages_per_rank,
                          const ActionCosts& costs) {
  const Named* n = named(name);
  HP_CHECK(n, "pipeline schedule '", name, "' is unknown (available: ", schedule_names(), ")");
  return n->build(ranks, micro_batches, stages_per_rank, costs);
}

}  // namespace hp::pp
