// The cost model's arithmetic: a calibration's lines, their JSON, and the step time they predict.
#include "hp/train/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"
#include "hp/train/config.h"

namespace hp::train {
namespace {

// The entry of `by_size` whose key is nearest to `size` (the larger of two as near); `by_size` is
// not empty.
template <typename Value>
typename std::map<int, Value>::const_iterator nearest(const std::map<int, Value>& by_size, int size) {
  auto best = by_size.begin();
  for (auto it = by_size.begin(); it != by_size.end(); ++it)
    if (std::abs(it->first - size) <= std::abs(best->first - size)) best = it;
  return best;
}

// A phase's cost, without (pipelines) its sends and receives, which the schedule simulator plays.
// The classes of its work that the calibration has no timing for go into `unpriced`.
double seconds_of(const Calibration& cal, const PhaseWork& phase, bool with_point_to_point, double* communication,
                  std::set<std::string>* unpriced = nullptr) {
  double seconds = cal.between_ops * static_cast<double>(phase.op_calls());
  for (const auto& [key, work] : phase.ops) {
    seconds += cal.compute_seconds(key.first, key.second, work);
    const auto profiled = cal.compute.find(key.first);
    if (unpriced != nullptr && work.work > 0 && (profiled == cal.compute.end() || profiled->second.empty()))
      unpriced->insert(key.first);
  }
  double comm = 0.0;
  for (const auto& [key, work] : phase.collectives) {
    if (is_point_to_point(key.first)) {
      if (with_point_to_point) comm += cal.collective_seconds(key.first, key.second, work);
    } else {
      comm +=
          cal.collective_seconds(key.first, key.second, work) + cal.collective_wait * static_cast<double>(work.calls);
    }
  }
  if (communication != nullptr) *communication += comm;
  return seconds + comm;
}

// Two finite numbers >= 0, as [a, b].
std::pair<double, double> pair_from(const nlohmann::json& j, const std::string& where, const char* names) {
  HP_CHECK(j.is_array() && j.size() == 2 && j[0].is_number() && j[1].is_number(), "calibration: ", where, " must be ",
           names, ", got ", j.dump());
  const double a = j[0].get<double>(), b = j[1].get<double>();
  HP_CHECK(a >= 0 && b >= 0 && std::isfinite(a) && std::isfinite(b), "calibration: ", where,
           " must be two finite numbers >= 0, got ", j.dump());
  return {a, b};
}

// The step of a pipeline: its micro-batches' F and B actions per position, in the schedule's order.
StepTimeEstimate pipeline_step(const TrainConfig& c, const std::vector<StepWork>& positions, const Calibration& cal) {
  const int ranks = static_cast<int>(positions.size());
  const int m = static_cast<int>(c.micro_batches());
  StepTimeEstimate estimate;
  std::vector<double> forward(ranks), backward(ranks);
  double send_calls = 0, send_bytes = 0, slowest_optimizer = 0;
  for (int r = 0; r < ranks; ++r) {
    const StepWork& w = positions[r];
    double comm = 0.0;
    forward[r] = seconds_of(cal, w.forward, false, &comm, &estimate.unpriced) / m;
    backward[r] = seconds_of(cal, w.backward, false, &comm, &estimate.unpriced) / m;
    const double optimizer = seconds_of(cal, w.optimizer, true, &comm, &estimate.unpriced);
    slowest_optimizer = std::max(slowest_optimizer, optimizer);
    estimate.communication = std::max(estimate.communication, comm);
    estimate.compute = std::max(estimate.compute, (forward[r] + backward[r]) * m + optimizer - comm);
    for (const PhaseWork* phase : {&w.forward, &w.backward})
      for (const auto& [key, work] : phase->collectives)
        if (key.first == "send") {
          send_calls += static_cast<double>(work.calls);
          send_bytes += work.bytes;
        }
  }
  pp::ActionCosts costs;
  if (send_calls > 0)
    costs.send = cal.collective_seconds(
        "send", ranks, CollectiveWork{1, send_bytes / send_calls});  // one activation (or its gradient)
  const int per_rank = static_cast<int>(c.pp_stages_per_rank);
  const pp::Schedule unit_order = pp::schedule_by_name(c.pp_schedule, ranks, m, per_rank);
  std::vector<int> stages_on(ranks, 0);
  for (int rank : unit_order.stage_rank) ++stages_on[rank];
  for (size_t s = 0; s < unit_order.stage_rank.size(); ++s) {
    const int r = unit_order.stage_rank[s];
    const double f = std::max(forward[r] / stages_on[r], 1e-9), b = std::max(backward[r] / stages_on[r], 2e-9);
    costs.by_stage.push_back({f, b / 2, b / 2});  // a full backward is I + W; zero-bubble orders split it
  }
  // A zero-bubble schedule runs the order built for parallel.pp_costs: with "measured", the steps
  // after the profiled ones run the order built for what they measured (here: these costs).
  pp::Schedule schedule = unit_order;
  if (pp::orders_for_costs(c.pp_schedule) && c.pp_costs != "unit") {
    const std::optional<pp::ActionCosts> given = pp::parse_costs(c.pp_costs);
    schedule = pp::schedule_by_name(c.pp_schedule, ranks, m, per_rank, given ? *given : costs);
  }
  const pp::Simulation sim = pp::simulate(schedule, costs);
  estimate.bubble = sim.bubble;
  // Ranks idle in the bubble leave their share of the cores to the busy ones.
  const double contention = cal.contention(cal.ranks * (1.0 - sim.bubble));
  estimate.seconds = (sim.makespan + slowest_optimizer) * contention + cal.step_overhead;
  estimate.compute *= contention;
  return estimate;
}

}  // namespace

bool is_point_to_point(const std::string& collective) { return collective == "send" || collective == "recv"; }

int work_size(double work) { return work >= 1.0 ? static_cast<int>(std::floor(std::log2(work))) : -1; }

int64_t PhaseWork::op_calls() const {
  int64_t calls = 0;
  for (const auto& [key, work] : ops) calls += work.calls;
  return calls;
}

double Calibration::compute_seconds(const std::string& cost_class, int size, const OpWork& work) const {
  const auto it = compute.find(cost_class);
  if (it == compute.end() || it->second.empty() || work.calls == 0) return 0.0;
  const std::map<int, Point>& sizes = it->second;
  const auto profiled = nearest(sizes, size);
  const Point& p = profiled->second;
  const double calls = static_cast<double>(work.calls), per_call = work.work / calls;
  double each = p.work > 0 ? p.seconds * per_call / p.work : p.seconds;
  if (profiled->first != size) {  // a size the profile did not see: no quicker than its quickest call
    double quickest = std::numeric_limits<double>::infinity();
    for (const auto& [s, point] : sizes) quickest = std::min(quickest, point.seconds);
    each = std::max(each, quickest);
  }
  return compute_scale * calls * each;
}

double Calibration::collective_seconds(const std::string& op, int group_size, const CollectiveWork& work) const {
  // The fused ops (hp/comm/fused_matmul.h) move what their collective moves (their matmuls are
  // recorded as compute).
  const std::string name = op == "all_gather_matmul"       ? "all_gather"
                           : op == "matmul_reduce_scatter" ? "reduce_scatter"
                                                           : op;
  const auto it = collectives.find(name);
  if (it == collectives.end() || it->second.empty()) {
    std::string have;
    for (const auto& [n, sizes] : collectives)
      for (const auto& [size, line] : sizes) have += (have.empty() ? "" : ", ") + n + " on " + std::to_string(size);
    HP_FAIL("cost model: the calibration has no line for collective ", name, " (it has ",
            have.empty() ? std::string("none: it was measured on one rank") : have,
            "); calibrate on as many ranks as the job's groups have");
  }
  const Line& line = nearest(it->second, group_size)->second;
  return line.latency * static_cast<double>(work.calls) + line.per_byte * work.bytes;
}

double Calibration::phase_seconds(const PhaseWork& phase) const { return seconds_of(*this, phase, true, nullptr); }

double Calibration::contention(double busy) const {
  const double threads = static_cast<double>(threads_per_rank);
  return std::max(1.0, busy * threads / cores) / std::max(1.0, ranks * threads / cores);
}

std::string Calibration::json() const {
  nlohmann::json j = {{"compute", nlohmann::json::object()}, {"collectives", nlohmann::json::object()}};
  j["ranks"] = ranks;
  j["cores"] = cores;
  j["threads_per_rank"] = threads_per_rank;
  j["collective_wait"] = collective_wait;
  j["step_overhead"] = step_overhead;
  j["compute_scale"] = compute_scale;
  j["between_ops"] = between_ops;
  for (const auto& [cost_class, sizes] : compute)
    for (const auto& [size, p] : sizes) j["compute"][cost_class][std::to_string(size)] = {p.work, p.seconds};
  for (const auto& [name, by_size] : collectives)
    for (const auto& [size, line] : by_size)
      j["collectives"][name][std::to_string(size)] = {line.latency, line.per_byte};
  j["profile"] = nlohmann::json::array();
  for (const ProfiledStep& p : profile)
    j["profile"].push_back({{"layout", p.layout}, {"seconds", p.seconds}, {"predicted", p.predicted}});
  return j.dump(1);
}

Calibration Calibration::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("calibration: not JSON: ", e.what());
  }
  for (const char* key : {"ranks", "cores", "threads_per_rank", "compute_scale", "between_ops", "collective_wait",
                          "step_overhead", "compute", "collectives"})
    HP_CHECK(j.is_object() && j.contains(key), "calibration: no '", key,
             "' (hp-plan --calibrate writes a calibration)");
  Calibration cal;
  // A size or group size: a whole number.
  const auto whole = [](const std::string& key, const std::string& where) {
    size_t end = 0;
    int v = 0;
    try {
      v = std::stoi(key, &end);
    } catch (const std::exception&) {
    }
    HP_CHECK(end == key.size() && !key.empty(), "calibration: ", where, ": '", key, "' is not a whole number");
    return v;
  };
  try {
    cal.ranks = j.at("ranks").get<int>();
    cal.cores = j.at("cores").get<int>();
    cal.threads_per_rank = j.at("threads_per_rank").get<int>();
    cal.collective_wait = j.at("collective_wait").get<double>();
    cal.step_overhead = j.at("step_overhead").get<double>();
    cal.compute_scale = j.at("compute_scale").get<double>();
    cal.between_ops = j.at("between_ops").get<double>();
    for (const auto& [cost_class, sizes] : j.at("compute").items())
      for (const auto& [size, point] : sizes.items()) {
        const auto [work, seconds] = pair_from(point, "compute." + cost_class + "." + size, "[work, seconds]");
        cal.compute[cost_class][whole(size, "compute." + cost_class)] = {work, seconds};
      }
    for (const auto& [name, by_size] : j.at("collectives").items())
      for (const auto& [size, line] : by_size.items()) {
        const auto [latency, per_byte] = pair_from(line, "collectives." + name + "." + size, "[latency, per_byte]");
        cal.collectives[name][whole(size, "collectives." + name)] = {latency, per_byte};
      }
    if (j.contains("profile"))
      for (const auto& p : j.at("profile"))
        cal.profile.push_back(
            {p.at("layout").get<std::string>(), p.at("seconds").get<double>(), p.at("predicted").get<double>()});
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("calibration: ", e.what());
  }
  HP_CHECK(cal.ranks >= 1 && cal.cores >= 1 && cal.threads_per_rank >= 1 && cal.compute_scale > 0 &&
               std::isfinite(cal.compute_scale) && cal.between_ops >= 0 && std::isfinite(cal.between_ops) &&
               cal.collective_wait >= 0 && std::isfinite(cal.collective_wait) && cal.step_overhead >= 0 &&
               std::isfinite(cal.step_overhead),
           "calibration: ranks, cores and threads_per_rank must be >= 1, compute_scale > 0, between_ops, "
           "collective_wait and step_overhead >= 0");
  return cal;
}

Calibration Calibration::read(const std::string& path) {
  std::ifstream in(path);
  HP_CHECK(in.good(), "cannot read the calibration ", path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return from_json(text.str());
  } catch (const Error& e) {
    HP_FAIL(path, ": ", e.what());
  }
}

std::string StepTimeEstimate::str() const {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << seconds * 1e3 << " ms (compute " << compute * 1e3
      << " ms, communication " << communication * 1e3 << " ms";
  if (bubble > 0) out << ", bubble " << bubble * 100 << "%";
  out << ")";
  return out.str();
}

std::string unpriced_warning(const std::set<std::string>& unpriced) {
  if (unpriced.empty()) return "";
  std::string out = "the calibration has no timing for ";
  for (const std::string& name : unpriced) out += (name == *unpriced.begin() ? "" : ", ") + name;
  return out + ", so the estimates price that work at the time per op only; calibrate again with this build";
}

StepTimeEstimate estimate_step_time(const TrainConfig& c, const std::vector<StepWork>& positions,
                                    const Calibration& cal) {
  HP_CHECK(!positions.empty(), "estimate_step_time: no ranks' work");
  if (c.parallel.pp > 1) {
    HP_CHECK(static_cast<int64_t>(positions.size()) == c.parallel.pp, "estimate_step_time: ", c.parallel.pp,
             " pipeline positions' work expected, got ", positions.size());
    return pipeline_step(c, positions, cal);
  }
  StepTimeEstimate estimate;
  double comm = 0.0;
  const StepWork& w = positions.front();
  for (const PhaseWork* phase : {&w.forward, &w.backward, &w.optimizer})
    estimate.seconds += seconds_of(cal, *phase, true, &comm, &estimate.unpriced);
  estimate.communication = comm;
  estimate.compute = estimate.seconds - comm;
  estimate.seconds += cal.step_overhead;
  return estimate;
}

}  // namespace hp::train
