// The flags of a command-line tool as one table, from which both the parser and --help are made,
// so the help cannot drift from what is parsed. Header-only plain C++: hprun and hp-plot do not
// link LibTorch.
//
//   struct Options { std::string config; bool dry_run = false; };
//   const std::vector<hp::tools::Flag<Options>> flags = {
//       {{"--config"}, "FILE", "the run's YAML config", [](Options& o, const std::string& v) { o.config = v; }},
//       {{"--dry-run"}, "", "print the plan and exit", [](Options& o, const std::string&) { o.dry_run = true; }},
//   };
//   Options options;
//   std::vector<std::string> rest;
//   if (!hp::tools::parse_flags(argc, argv, flags, options, rest)) { print usage + flag_help(flags); return 0; }
//
// Accepted forms: "--name VALUE", "--name=VALUE", "-o VALUE", switches without a value, "-h" and
// "--help" (parse_flags returns false), and "--" (everything after it is positional). A mistake
// throws UsageError, which a tool prints and exits 2 on.
#pragma once

#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hp::tools {

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <typename Options>
struct Flag {
  std::vector<std::string> names;  // e.g. {"-o", "--output"}
  std::string value;               // what the value is, e.g. "FILE"; empty for a switch
  std::string help;
  std::function<void(Options&, const std::string& value)> set;  // throws UsageError for a bad value
};

// Whether positional arguments end the options (hprun: PROGRAM and its ARGS follow) or may stand
// between them (hp-plot INPUT -o OUT).
enum class Positionals { kAnywhere, kEndOptions };

// Parses argv[1..] into `options` and `positionals`. Returns false when -h or --help was given
// (the caller prints its help); throws UsageError naming the problem otherwise.
template <typename Options>
bool parse_flags(int argc, char** argv, const std::vector<Flag<Options>>& flags, Options& options,
                 std::vector<std::string>& positionals, Positionals mode = Positionals::kAnywhere) {
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") return false;
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      if (mode == Positionals::kEndOptions) break;
      positionals.push_back(arg);
      continue;
    }
    std::string value;
    bool inline_value = false;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    const Flag<Options>* flag = nullptr;
    for (const Flag<Options>& f : flags)
      for (const std::string& name : f.names)
        if (name == arg) flag = &f;
    if (flag == nullptr) throw UsageError("unknown option '" + arg + "'");
    if (flag->value.empty()) {
      if (inline_value) throw UsageError(arg + " takes no value");
    } else if (!inline_value) {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value (" + flag->value + ")");
      value = argv[++i];
    }
    flag->set(options, value);
  }
  for (; i < argc; ++i) positionals.emplace_back(argv[i]);
  return true;
}

// The table as help text: one aligned row per flag ("  -o, --output FILE   where to write"), and -h.
template <typename Options>
std::string flag_help(const std::vector<Flag<Options>>& flags, size_t column = 26) {
  std::string out;
  const auto row = [&](const std::string& left, const std::string& help) {
    out += left + std::string(left.size() < column ? column - left.size() : 1, ' ') + help + "\n";
  };
  for (const Flag<Options>& f : flags) {
    std::string left = "  ";
    for (size_t n = 0; n < f.names.size(); ++n) left += (n ? ", " : "") + f.names[n];
    if (!f.value.empty()) left += " " + f.value;
    row(left, f.help);
  }
  row("  -h, --help", "this text");
  return out;
}

// An integer in [lo, hi], or UsageError naming the flag.
inline long parse_int(const std::string& flag, const std::string& text, long lo, long hi) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < lo || v > hi)
    throw UsageError(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                     text + "'");
  return v;
}

// A number, or UsageError naming the flag.
inline double parse_double(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') throw UsageError(flag + " expects a number, got '" + text + "'");
  return v;
}

}  // namespace hp::tools
