// Helpers of the multi-process tests: where the built programs are, running a command line with
// its exit code and output captured (or its peak resident memory), and reading a run's losses.
#pragma once

#include <fcntl.h>
#include <limits.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace hp::e2e {

inline std::string bin_dir() {
  char self[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string path(self, n > 0 ? n : 0);
  return path.substr(0, path.rfind('/'));
}

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// Runs `command` through the shell (stdout and stderr captured together).
inline Result run_command(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  Result result;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  while (fgets(buffer.data(), buffer.size(), pipe) != nullptr) result.output += buffer.data();
  const int status = pclose(pipe);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// A program's run with the most memory it held resident.
struct Measured {
  int exit_code = -1;  // -1: it did not exit normally
  long max_rss_kb = 0;
  std::string output;  // stdout and stderr
};

// Runs the program argv[0] with `argv` itself, not through a shell, so that the resident memory
// measured (wait4's rusage) is the program's own; its output goes through the file `log`.
inline Measured run_measuring_memory(const std::vector<std::string>& argv, const std::string& log) {
  Measured measured;
  std::vector<char*> args;  // made before fork: the child only opens, duplicates and execs
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(127);
    if (fd > 2) close(fd);
    execv(args[0], args.data());
    _exit(127);
  }
  if (pid < 0) return measured;
  int status = 0;
  rusage usage{};
  pid_t waited = -1;
  do {
    waited = wait4(pid, &status, 0, &usage);
  } while (waited < 0 && errno == EINTR);
  if (waited != pid) return measured;
  measured.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  measured.max_rss_kb = usage.ru_maxrss;
  std::ifstream in(log);
  measured.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return measured;
}

// step -> loss of the train records of a run's metrics.jsonl.
inline std::map<int64_t, double> train_losses(const std::string& run_dir) {
  std::map<int64_t, double> losses;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("kind") == "train") losses[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return losses;
}

// Runs hprun with `args`.
inline Result run_job(const std::string& args) { return run_command(bin_dir() + "/hprun " + args); }

}  // namespace hp::e2e
