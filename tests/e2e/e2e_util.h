// Helpers of the multi-process tests: where the built programs are, and running a command line
// with its exit code and output captured.
#pragma once

#include <limits.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <string>

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

// Runs hprun with `args`.
inline Result run_job(const std::string& args) { return run_command(bin_dir() + "/hprun " + args); }

}  // namespace hp::e2e
