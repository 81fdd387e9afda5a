// The tools' flag table (tools/common/flags.h): the forms it parses, the errors it names, and the
// help made from the same table.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/flags.h"

namespace hp::tools {
namespace {

struct Options {
  std::string config, output;
  std::vector<std::string> sets;
  bool dry_run = false;
  long count = 0;
};

const std::vector<Flag<Options>> kFlags = {
    {{"--config"}, "FILE", "the config", [](Options& o, const std::string& v) { o.config = v; }},
    {{"--set"}, "KEY=VALUE", "one override", [](Options& o, const std::string& v) { o.sets.push_back(v); }},
    {{"-o", "--output"}, "OUT", "where to write", [](Options& o, const std::string& v) { o.output = v; }},
    {{"--count"}, "N", "how many", [](Options& o, const std::string& v) { o.count = parse_int("--count", v, 1, 9); }},
    {{"--dry-run"}, "", "only plan", [](Options& o, const std::string&) { o.dry_run = true; }},
};

// Parses `args` (argv[0] is added); returns whether parsing went on (false: help was asked for).
bool parse(std::vector<std::string> args, Options& options, std::vector<std::string>& positionals,
           Positionals mode = Positionals::kAnywhere) {
  args.insert(args.begin(), "tool");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return parse_flags(static_cast<int>(argv.size()), argv.data(), kFlags, options, positionals, mode);
}

// Values after a space or an '=', short and long names, repeated flags, switches, positionals.
TEST(Flags, ParseEveryForm) {
  Options o;
  std::vector<std::string> rest;
  ASSERT_TRUE(parse({"in.jsonl", "--config", "a.yaml", "--set=x=1", "--set", "y=2", "-o", "out", "--dry-run",
                     "--count=3", "--", "--not-a-flag"},
                    o, rest));
  EXPECT_EQ(o.config, "a.yaml");
  EXPECT_EQ(o.sets, (std::vector<std::string>{"x=1", "y=2"}));
  EXPECT_EQ(o.output, "out");
  EXPECT_TRUE(o.dry_run);
  EXPECT_EQ(o.count, 3);
  EXPECT_EQ(rest, (std::vector<std::string>{"in.jsonl", "--not-a-flag"}));
  Options help;
  EXPECT_FALSE(parse({"--config", "a", "-h"}, help, rest));
}

// With Positionals::kEndOptions (hprun) the first positional and everything after it are left as
// they are, flags of the program included.
TEST(Flags, PositionalsCanEndTheOptions) {
  Options o;
  std::vector<std::string> rest;
  ASSERT_TRUE(parse({"--count", "2", "prog", "--config", "x"}, o, rest, Positionals::kEndOptions));
  EXPECT_EQ(o.count, 2);
  EXPECT_EQ(o.config, "");
  EXPECT_EQ(rest, (std::vector<std::string>{"prog", "--config", "x"}));
}

// Mistakes are UsageErrors that name the flag and what was wrong.
TEST(Flags, MistakesNameTheFlag) {
  const auto error_of = [](std::vector<std::string> args) -> std::string {
    Options o;
    std::vector<std::string> rest;
    try {
      parse(std::move(args), o, rest);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(error_of({"--nope"}), "unknown option '--nope'");
  EXPECT_EQ(error_of({"--config"}), "--config needs a value (FILE)");
  EXPECT_EQ(error_of({"--dry-run=yes"}), "--dry-run takes no value");
  EXPECT_EQ(error_of({"--count", "12"}), "--count expects an integer in [1, 9], got '12'");
  EXPECT_EQ(error_of({"--count", "two"}), "--count expects an integer in [1, 9], got 'two'");
}

// The help lists every flag of the table with its value and text, and -h.
TEST(Flags, HelpComesFromTheTable) {
  const std::string help = flag_help(kFlags);
  for (const char* row :
       {"  --config FILE", "  --set KEY=VALUE", "  -o, --output OUT", "  --count N", "  --dry-run ", "  -h, --help"})
    EXPECT_NE(help.find(row), std::string::npos) << row << " not in\n" << help;
  for (const Flag<Options>& f : kFlags) EXPECT_NE(help.find(f.help), std::string::npos) << f.help;
}

}  // namespace
}  // namespace hp::tools
