// hp-pp-viz: draw a pipeline schedule and report its simulated makespan and bubble.
//
//   hp-pp-viz --schedule 1f1b --ranks 4 --micro-batches 8 -o 1f1b.svg
//   hp-pp-viz --csv my_schedule.csv --costs 1,1,1 -o mine.svg
#include <hp/core/error.h>
#include <hp/pp/schedule.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace {

int usage(std::ostream& out, int code) {
  out << "usage: hp-pp-viz (--schedule gpipe|1f1b|interleaved|zbv --ranks P --micro-batches M | --csv FILE)\n"
         "                 [--stages-per-rank V] [--costs F,I,W] [--send-cost S] [-o OUT.svg] [--print-csv]\n\n"
         "  --costs F,I,W     forward, backward-input and backward-weight costs (default 1,1,1; B = I + W)\n"
         "  --print-csv       print the schedule's actions as CSV (the format --csv reads)\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind, csv, output;
  int ranks = 0, micro_batches = 0, per_rank = 2;
  bool print_csv = false;
  hp::pp::ActionCosts costs;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const auto value = [&]() -> std::string {
        HP_CHECK(i + 1 < argc, arg, " needs a value");
        return argv[++i];
      };
      if (arg == "-h" || arg == "--help") return usage(std::cout, 0);
      if (arg == "--schedule") kind = value();
      else if (arg == "--ranks") ranks = std::stoi(value());
      else if (arg == "--micro-batches") micro_batches = std::stoi(value());
      else if (arg == "--stages-per-rank") per_rank = std::stoi(value());
      else if (arg == "--csv") csv = value();
      else if (arg == "-o" || arg == "--output") output = value();
      else if (arg == "--print-csv") print_csv = true;
      else if (arg == "--send-cost") costs.send = std::stod(value());
      else if (arg == "--costs") {
        std::istringstream in(value());
        char comma1 = 0, comma2 = 0;
        HP_CHECK(in >> costs.forward >> comma1 >> costs.backward_input >> comma2 >> costs.backward_weight &&
                     comma1 == ',' && comma2 == ',',
                 "--costs takes F,I,W (three numbers)");
      } else {
        std::cerr << "hp-pp-viz: unknown argument '" << arg << "'\n";
        return usage(std::cerr, 2);
      }
    }
    hp::pp::Schedule schedule;
    if (!csv.empty()) {
      std::ifstream in(csv);
      HP_CHECK(in, "cannot read ", csv);
      std::stringstream text;
      text << in.rdbuf();
      schedule = hp::pp::from_csv(text.str(), csv);
    } else {
      HP_CHECK(ranks >= 1 && micro_batches >= 1, "--ranks and --micro-batches are required (or --csv)");
      schedule = hp::pp::schedule_by_name(kind, ranks, micro_batches, per_rank);
    }
    const hp::pp::Simulation sim = hp::pp::simulate(schedule, costs);
    std::cout << schedule.name << ": " << schedule.ranks << " ranks, " << schedule.stages << " stages, "
              << schedule.micro_batches << " micro-batches; makespan " << sim.makespan << ", bubble "
              << 100.0 * sim.bubble << "%\n";
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
