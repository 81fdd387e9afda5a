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
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "hp_build_paths.h"

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

// The arguments of one hp-train process training examples/tiny_llama.yaml's model resized to
// `layers` x `dim` (ffn `ffn`) on one rank: one micro-batch of `batch` sequences a step, 2 steps,
// fp32, one thread, no checkpoint, evaluation or sample; the run in dir/name, then `settings`
// (each a --set).
inline std::vector<std::string> one_rank_training(const std::string& dir, const std::string& name, int64_t layers,
                                                  int64_t dim, int64_t ffn, int64_t batch,
                                                  const std::vector<std::string>& settings) {
  std::vector<std::string> argv = {bin_dir() + "/hp-train", "--config",
                                   std::string(HP_SOURCE_DIR) + "/examples/tiny_llama.yaml", "--no-progress"};
  std::vector<std::string> all = {"run_dir=" + dir + "/" + name,
                                  "data.cache_dir=" + dir + "/data",
                                  "parallel.dp_shard=1",
                                  "parallel.tp=1",
                                  "model.layers=" + std::to_string(layers),
                                  "model.dim=" + std::to_string(dim),
                                  "model.ffn_hidden=" + std::to_string(ffn),
                                  "train.global_batch=" + std::to_string(batch),
                                  "train.micro_batch=" + std::to_string(batch),
                                  "train.steps=2",
                                  "schedule.warmup_steps=1",
                                  "train.dtype=fp32",
                                  "train.cpu_threads=1",
                                  "checkpoint.interval=0",
                                  "eval.interval=0",
                                  "eval.batches=1",
                                  "sample.tokens=0"};
  all.insert(all.end(), settings.begin(), settings.end());
  for (const std::string& setting : all) {
    argv.push_back("--set");
    argv.push_back(setting);
  }
  return argv;
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
