// hp-pp-viz as a user runs it: a named schedule's simulated bubble (1F1B's formula), its drawing,
// the CSV it prints read back, and bad arguments refused with exit 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "e2e/e2e_util.h"
#include "scratch_dir.h"

namespace {
namespace fs = std::filesystem;

std::string viz(const std::string& args) { return hp::e2e::bin_dir() + "/hp-pp-viz " + args; }

// The first line: "<name>: P ranks, S stages, M micro-batches; makespan X, bubble Y%".
std::string summary(const std::string& output) { return output.substr(0, output.find('\n')); }

// 1F1B on 4 ranks with 8 micro-batches idles (p - 1) / (m + p - 1) = 3/11 of its makespan at equal
// costs; the SVG is written; --print-csv's schedule, read back with --csv, simulates the same.
TEST(HpPpViz, DrawsASchedulePrintsItsBubbleAndReadsItsOwnCsv) {
  const std::string dir = hp::test::scratch_dir("hp_pp_viz");
  const hp::e2e::Result drawn =
      hp::e2e::run_command(viz("--schedule 1f1b --ranks 4 --micro-batches 8 -o " + dir + "/1f1b.svg --print-csv"));
  ASSERT_EQ(drawn.exit_code, 0) << drawn.output;
  EXPECT_NE(summary(drawn.output).find("4 ranks, 4 stages, 8 micro-batches; makespan 33, bubble 27.2727%"),
            std::string::npos)
      << drawn.output;
  std::stringstream svg;
  svg << std::ifstream(dir + "/1f1b.svg").rdbuf();
  EXPECT_NE(svg.str().find("<svg"), std::string::npos);
  EXPECT_NE(svg.str().find("</svg>"), std::string::npos);
  // The CSV is everything between the summary line and "wrote ...".
  const size_t begin = drawn.output.find('\n') + 1, end = drawn.output.find("wrote ");
  std::ofstream(dir + "/1f1b.csv") << drawn.output.substr(begin, end - begin);
  const hp::e2e::Result read = hp::e2e::run_command(viz("--csv " + dir + "/1f1b.csv"));
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const std::string want = summary(drawn.output);
  EXPECT_EQ(summary(read.output).substr(summary(read.output).find(':')), want.substr(want.find(':')));
}

// --max-memory chooses the schedule: on 4 ranks with 8 micro-batches at equal costs, ZBV within
// 1F1B's memory (4 stages), V-Half within 3, V-Min within 2.5 (it holds 2); none within 1.5 (exit
// 2, naming the least).
TEST(HpPpViz, MaxMemoryChoosesTheScheduleThatFits) {
  for (const auto& [limit, chosen] : std::vector<std::pair<std::string, std::string>>{
           {"4", "ZBV: 4 ranks, 8 stages"}, {"3", "V-Half: 4 ranks, 8 stages"}, {"2.5", "V-Min: 4 ranks, 8 stages"}}) {
    const hp::e2e::Result r = hp::e2e::run_command(viz("--max-memory " + limit + " --ranks 4 --micro-batches 8"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(summary(r.output).rfind(chosen, 0), 0u) << limit << ": " << r.output;
  }
  const hp::e2e::Result none = hp::e2e::run_command(viz("--max-memory 1.5 --ranks 4 --micro-batches 8"));
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("holds at most 1.5 micro-batches of a 1F1B stage per rank; the least is 2"),
            std::string::npos)
      << none.output;
}

// Bad arguments: exit 2 with a one-line reason.
TEST(HpPpViz, BadArgumentsAreRefusedWithExit2) {
  for (const auto& [args, reason] : std::vector<std::pair<std::string, std::string>>{
           {"--schedule nope --ranks 4 --micro-batches 8", "hp-pp-viz: error: "},
           {"--schedule 1f1b --ranks 0 --micro-batches 8", "--ranks"},
           {"--schedule 1f1b --ranks 4 --micro-batches 8 --costs 1,2", "--costs takes F,I,W"},
           {"--schedule 1f1b", "--ranks and --micro-batches are required"},
           {"--schedule zbv --max-memory 2 --ranks 4 --micro-batches 8", "give one"},
           {"--csv mine.csv --max-memory 2", "give one"},
           {"--max-memory 0 --ranks 4 --micro-batches 8", "--max-memory takes a positive number"},
           {"--csv /nonexistent/mine.csv", "cannot read /nonexistent/mine.csv"}}) {
    const hp::e2e::Result r = hp::e2e::run_command(viz(args));
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(reason), std::string::npos) << args << "\n" << r.output;
  }
}

}  // namespace
