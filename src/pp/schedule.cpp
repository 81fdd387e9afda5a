// The schedule builders, communication insertion and the CSV form.
#include "hp/pp/schedule.h"

#include <algorithm>
#include <map>
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
  Schedule (*build)(int ranks, int micro_batches, int stages_per_rank, const ActionCosts& costs);
};
constexpr Named kNamed[] = {
    {"gpipe", 1, false, [](int p, int m, int, const ActionCosts&) { return gpipe(p, m); }},
    {"1f1b", 1, false, [](int p, int m, int, const ActionCosts&) { return one_f_one_b(p, m); }},
    {"interleaved", 0, false, [](int p, int m, int v, const ActionCosts&) { return interleaved_1f1b(p, v, m); }},
    {"zbv", 2, true, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_v(p, m, c); }},
    {"zbh1", 1, true, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_h1(p, m, c); }},
    {"zbh2", 1, true, [](int p, int m, int, const ActionCosts& c) { return zero_bubble_h2(p, m, c); }},
};

const Named* named(const std::string& name) {
  for (const Named& n : kNamed)
    if (name == n.name) return &n;
  return nullptr;
}

}  // namespace

const std::string& schedule_names() {
  static const std::string names = [] {
    std::string all;
    for (const Named& n : kNamed) all += (all.empty() ? "" : ", ") + std::string(n.name);
    return all;
  }();
  return names;
}

int64_t schedule_stages(const std::string& name, int64_t ranks, int64_t stages_per_rank) {
  const Named* n = named(name);
  return n ? ranks * (n->stages_per_rank ? n->stages_per_rank : stages_per_rank) : 0;
}

bool orders_for_costs(const std::string& name) {
  const Named* n = named(name);
  return n && n->zero_bubble;
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
