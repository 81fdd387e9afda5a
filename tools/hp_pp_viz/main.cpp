// hp-pp-viz: draw a pipeline schedule and report its simulated makespan and bubble.
//
//   hp-pp-viz --schedule 1f1b --ranks 4 --micro-batches 8 -o 1f1b.svg
//   hp-pp-viz --csv my_schedule.csv --costs 1,1,1 -o mine.svg
//   hp-pp-viz --max-memory 2 --ranks 4 --micro-batches 16 --costs 1,1.2,0.7
#include <hp/core/error.h>
#include <hp/pp/schedule.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/flags.h"

namespace {

struct Args {
  std::string kind, csv, output;
  int ranks = 0, micro_batches = 0, per_rank = 2;
  bool print_csv = false;
  hp::pp::ActionCosts costs;
  std::optional<double> send;        // --send-cost, over --costs' S
  std::optional<double> max_memory;  // --max-memory, in place of --schedule
};

const std::vector<hp::tools::Flag<Args>>& flags() {
  using hp::tools::parse_int;
  static const std::vector<hp::tools::Flag<Args>> table = {
      {{"--schedule"}, "NAME", hp::pp::schedule_names(), [](Args& a, const std::string& v) { a.kind = v; }},
      {{"--ranks"},
       "P",
       "pipeline ranks",
       [](Args& a, const std::string& v) { a.ranks = static_cast<int>(parse_int("--ranks", v, 1, 4096)); }},
      {{"--micro-batches"},
       "M",
       "micro-batches per step",
       [](Args& a, const std::string& v) {
         a.micro_batches = static_cast<int>(parse_int("--micro-batches", v, 1, 1 << 20));
       }},
      {{"--stages-per-rank"},
       "V",
       "stages per rank of the interleaved schedule (default 2)",
       [](Args& a, const std::string& v) {
         a.per_rank = static_cast<int>(parse_int("--stages-per-rank", v, 1, 1024));
       }},
      {{"--max-memory"},
       "STAGES",
       "in place of --schedule: of the named schedules, built for --costs, the one with the lowest bubble among "
       "those holding at most STAGES micro-batches of a 1F1B stage per rank (1F1B holds min(P, M); a V stage "
       "counts half; interleaved has 2 stages per rank)",
       [](Args& a, const std::string& v) {
         const double stages = hp::tools::parse_double("--max-memory", v);
         if (!(stages > 0)) throw hp::tools::UsageError("--max-memory takes a positive number, got '" + v + "'");
         a.max_memory = stages;
       }},
      {{"--csv"},
       "FILE",
       "read the schedule from a CSV file (the format --print-csv writes)",
       [](Args& a, const std::string& v) { a.csv = v; }},
      {{"--costs"},
       "F,I,W[,S]",
       "forward, backward-input and backward-weight costs, and a send latency (default 1,1,1,0; B = I + W); " +
           hp::pp::cost_ordered_schedule_names() + " are ordered for them",
       [](Args& a, const std::string& v) {
         const std::optional<hp::pp::ActionCosts> costs = hp::pp::parse_costs(v);
         if (!costs) throw hp::tools::UsageError("--costs takes F,I,W or F,I,W,S (positive numbers), got '" + v + "'");
         a.costs = *costs;
       }},
      {{"--send-cost"},
       "S",
       "latency of a send/receive pair (default 0)",
       [](Args& a, const std::string& v) { a.send = hp::tools::parse_double("--send-cost", v); }},
      {{"-o", "--output"},
       "OUT.svg",
       "draw the schedule and its simulation",
       [](Args& a, const std::string& v) { a.output = v; }},
      {{"--print-csv"},
       "",
       "print the schedule's actions as CSV (the format --csv reads)",
       [](Args& a, const std::string&) { a.print_csv = true; }},
  };
  return table;
}

int usage(std::ostream& out, int code) {
  out << "usage: hp-pp-viz ((--schedule NAME | --max-memory STAGES) --ranks P --micro-batches M | --csv FILE)\n"
         "                 [--stages-per-rank V] [--costs F,I,W[,S]] [--send-cost S] [-o OUT.svg] [--print-csv]\n\n"
      << hp::tools::flag_help(flags());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  std::vector<std::string> positionals;
  try {
    if (!hp::tools::parse_flags(argc, argv, flags(), args, positionals)) return usage(std::cout, 0);
    if (!positionals.empty()) throw hp::tools::UsageError("unexpected argument '" + positionals.front() + "'");
    if (args.max_memory && (!args.kind.empty() || !args.csv.empty()))
      throw hp::tools::UsageError("--schedule, --csv and --max-memory each choose the schedule; give one");
  } catch (const hp::tools::UsageError& e) {
    std::cerr << "hp-pp-viz: " << e.what() << "\n\n";
    return usage(std::cerr, 2);
  }
  const std::string &kind = args.kind, &csv = args.csv, &output = args.output;
  const int ranks = args.ranks, micro_batches = args.micro_batches, per_rank = args.per_rank;
  const bool print_csv = args.print_csv;
  hp::pp::ActionCosts costs = args.costs;
  if (args.send) costs.send = *args.send;
  try {
    hp::pp::Schedule schedule;
    if (!csv.empty()) {
      std::ifstream in(csv);
      HP_CHECK(in, "cannot read ", csv);
      std::stringstream text;
      text << in.rdbuf();
      schedule = hp::pp::from_csv(text.str(), csv);
    } else {
      HP_CHECK(ranks >= 1 && micro_batches >= 1, "--ranks and --micro-batches are required (or --csv)");
      schedule = args.max_memory ? hp::pp::lowest_bubble_within(ranks, micro_batches, *args.max_memory, costs)
                                 : hp::pp::schedule_by_name(kind, ranks, micro_batches, per_rank, costs);
    }
    const hp::pp::Simulation sim = hp::pp::simulate(schedule, costs);
    const std::vector<int> peak = hp::pp::peak_in_flight(schedule);
    std::cout << schedule.name << ": " << schedule.ranks << " ranks, " << schedule.stages << " stages, "
              << schedule.micro_batches << " micro-batches; makespan " << sim.makespan << ", bubble "
              << 100.0 * sim.bubble << "% (per stage " << 100.0 * sim.per_stage_bubble << "%), peak in flight "
              << *std::max_element(peak.begin(), peak.end()) << " (" << hp::pp::peak_memory_in_1f1b_stages(schedule)
              << " 1F1B stages)\n";
    if (print_csv) std::cout << hp::pp::to_csv(schedule);
    if (!output.empty()) {
      std::ofstream(output) << hp::pp::to_svg(schedule, sim);
      std::cout << "wrote " << output << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "hp-pp-viz: error: " << e.what() << "\n";
    return 2;
  }
}
