// hprun: HyperParallel's torchrun. Spawns the local ranks of a job with the rendezvous environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes every line
// they print with their rank, and fails fast: when one rank exits non-zero or by a signal, the
// others are killed and hprun exits non-zero naming that rank. A signal to hprun is forwarded to
// the ranks, which get --stop-timeout seconds to save and exit. With --max-restarts it starts the job again after a
// failure, in a fresh rendezvous, and sums up what each failure cost; with --recover-processes it
// starts only a rank whose process died again, while the others wait in theirs. Plain POSIX C++; it
// does not link LibTorch.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/flags.h"
#include "hp/core/job.h"
#include "hp/core/store_wire.h"
#include "hprun/cpu_layout.h"
#include "hprun/rendezvous_server.h"

namespace {

constexpr int kUsageError = 2;     // hprun's own, and a rank's that no restart can fix
constexpr int kInterrupted = 130;  // hprun got a signal
// How long to wait for the cause after a rank exits with hp::job::kExitOtherRankFailed.
constexpr auto kCauseGrace = std::chrono::seconds(2);
// Wait before restart K (1-based): 1 s, doubling, at most 30 s; a failure that repeats at once
// (a bad node, a full disk) does not spin.
std::chrono::seconds restart_backoff(int restart) {
  return std::chrono::seconds(std::min(30, 1 << std::min(restart - 1, 5)));
}

struct Config {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port (single node) or 29500 (several nodes)
  int max_restarts = 0;
  bool recover_processes = false;         // restart only a rank whose process died
  std::chrono::seconds stop_timeout{30};  // after forwarding a signal, until SIGKILL
  bool cpu_layout_auto = false;           // --cpu-layout auto
  std::string secret_file;                // --secret-file
  std::string secret;                     // read from it; never printed
  std::vector<std::string> command;
};

const std::vector<hp::tools::Flag<Config>>& flags() {
  using hp::tools::parse_int;
  static const std::vector<hp::tools::Flag<Config>> table = {
      {{"--nproc-per-node"},
       "N",
       "ranks to start on this node (default 1)",
       [](Config& c, const std::string& v) { c.nproc_per_node = parse_int("--nproc-per-node", v, 1, 4096); }},
      {{"--nnodes"},
       "K",
       "nodes in the job (default 1); start hprun once per node",
       [](Config& c, const std::string& v) { c.nnodes = parse_int("--nnodes", v, 1, 65536); }},
      {{"--node-rank"},
       "I",
       "this node's index in [0, K) (default 0); rank = I * N + local rank",
       [](Config& c, const std::string& v) { c.node_rank = parse_int("--node-rank", v, 0, 65535); }},
      {{"--master-addr"},
       "A",
       "host of global rank 0, where the rendezvous store listens (default 127.0.0.1)",
       [](Config& c, const std::string& v) { c.master_addr = v; }},
      {{"--master-port"},
       "P",
       "rendezvous port (default: a free port on one node, 29500 on several)",
       [](Config& c, const std::string& v) { c.master_port = parse_int("--master-port", v, 1, 65535); }},
      {{"--max-restarts"},
       "N",
       "after a failure, start every rank again up to N times (default 0; one node only)",
       [](Config& c, const std::string& v) { c.max_restarts = parse_int("--max-restarts", v, 0, 1000); }},
      {{"--recover-processes"},
       "",
       "when a rank's process dies (killed by a signal), start only that process again and let the others wait "
       "in theirs (process-level recovery, counted against --max-restarts); the program must recover in place, "
       "as hp-train does with resilience.in_memory_checkpoint_interval. Other failures restart every rank",
       [](Config& c, const std::string&) { c.recover_processes = true; }},
      {{"--stop-timeout"},
       "S",
       "after forwarding a signal, the seconds ranks have to save their last words and exit before SIGKILL "
       "(default 30)",
       [](Config& c, const std::string& v) {
         c.stop_timeout = std::chrono::seconds(parse_int("--stop-timeout", v, 0, 86400));
       }},
      {{"--secret-file"},
       "FILE",
       "a job on several nodes: a file readable only by you (mode 0600), the same on every node, whose content "
       "is the job's secret; node 0's hprun serves the rendezvous on the master address's interface to ranks "
       "that present it, and refuses others. Required with --nnodes > 1",
       [](Config& c, const std::string& v) { c.secret_file = v; }},
      {{"--cpu-layout"},
       "even|auto",
       "even (default): each rank gets cores / ranks threads unless OMP_NUM_THREADS is set, and the environment's "
       "ATEN_CPU_CAPABILITY; auto: "
       "threads per rank and ATEN_CPU_CAPABILITY chosen by timing a few steps of the job under each (the program "
       "must answer HP_LAYOUT_PROBE, as hp-train does), remembered in ~/.cache/hyperparallel/cpu_layout.json",
       [](Config& c, const std::string& v) {
         if (v != "even" && v != "auto")
           throw hp::tools::UsageError("--cpu-layout takes even or auto, got '" + v + "'");
         c.cpu_layout_auto = v == "auto";
       }},
  };
  return table;
}

void print_help() {
  std::cout << "usage: hprun [options] [--] PROGRAM [ARGS...]\n\n"
               "Starts PROGRAM as the local ranks of a distributed job. Each rank gets RANK, WORLD_SIZE,\n"
               "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT in its environment;\n"
               "hp::comm::init_process_group() reads them. Every output line is prefixed with \"[rank R] \".\n"
               "If a rank exits non-zero or is killed by a signal, the other ranks are killed (SIGKILL)\n"
               "and hprun exits non-zero naming that rank. SIGINT/SIGTERM/SIGHUP sent\n"
               "to hprun are forwarded to every rank (exit code 130). With --max-restarts N, a failed job is\n"
               "started again (after 1, 2, 4, ... s) in a fresh rendezvous with HP_RESTART_COUNT set, unless a\n"
               "rank exited with code 2 (a usage or config error); hp-train then resumes from the job's latest\n"
               "checkpoint. The ranks share a private directory, HP_JOB_DIR, removed at the end.\n"
               "\noptions:\n"
            << hp::tools::flag_help(flags()) << "\nexample: hprun --nproc-per-node 4 build/bin/collectives_demo\n";
}

// The job's secret in `path`: a regular file of at least 16 bytes that only its owner can read.
std::string read_secret(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
    throw hp::tools::UsageError("--secret-file " + path + " is not a readable file");
  if ((info.st_mode & 077) != 0)
    throw hp::tools::UsageError("--secret-file " + path + " can be read by others than its owner: chmod 600 it");
  std::ifstream in(path);
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
  if (secret.size() < 16) throw hp::tools::UsageError("--secret-file " + path + " holds fewer than 16 bytes");
  // It travels in the ranks' environment, which ends at a NUL byte.
  for (const char c : secret)
    if (!std::isprint(static_cast<unsigned char>(c)))
      throw hp::tools::UsageError("--secret-file " + path +
                                  " must hold printable text (for example base64: head -c 32 /dev/urandom | base64)");
  return secret;
}

// Returns nullopt after printing help.
std::optional<Config> parse(int argc, char** argv) {
  Config config;
  if (!hp::tools::parse_flags(argc, argv, flags(), config, config.command, hp::tools::Positionals::kEndOptions)) {
    print_help();
    return std::nullopt;
  }
  if (config.command.empty()) throw hp::tools::UsageError("no PROGRAM given");
  if (config.node_rank >= config.nnodes)
    throw hp::tools::UsageError("--node-rank " + std::to_string(config.node_rank) + " must be below --nnodes " +
                                std::to_string(config.nnodes));
  // Every node would have to restart together, into a new rendezvous they agree on: that needs an
  // agent spanning the nodes, which hprun is not yet.
  if (config.max_restarts > 0 && config.nnodes > 1)
    throw hp::tools::UsageError("--max-restarts works on one node only (--nnodes " + std::to_string(config.nnodes) +
                                ")");
  if (config.recover_processes && config.max_restarts == 0)
    throw hp::tools::UsageError("--recover-processes needs --max-restarts N (N >= 1): each recovery counts as one");
  // Each node would time and choose on its own, and the ranks of one job could differ.
  if (config.cpu_layout_auto && config.nnodes > 1)
    throw hp::tools::UsageError("--cpu-layout auto works on one node only (--nnodes " + std::to_string(config.nnodes) +
                                ")");
  if (config.nnodes > 1) {
    if (config.secret_file.empty())
      throw hp::tools::UsageError(
          "a job on several nodes needs --secret-file FILE (the same on every node, mode 0600), so that only "
          "its ranks can join its rendezvous; for example: head -c 32 /dev/urandom | base64 > ~/job.secret && "
          "chmod 600 ~/job.secret");
    config.secret = read_secret(config.secret_file);
  } else if (!config.secret_file.empty()) {
    throw hp::tools::UsageError("--secret-file is for a job on several nodes (one node meets in a private file)");
  }
  return config;
}

int pick_free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    throw std::runtime_error(std::string("could not find a free port: ") + std::strerror(errno));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// One output stream of one rank, split into lines.
struct Stream {
  int fd = -1;
  FILE* sink = nullptr;
  std::string partial;
};

struct Rank {
  int global = 0;
  pid_t pid = -1;
  bool running = true;
  Stream out, err;
};

void emit(const Rank& rank, Stream& s, const char* data, size_t n) {
  s.partial.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    std::fprintf(s.sink, "[rank %d] %.*s\n", rank.global, static_cast<int>(nl - start), s.partial.data() + start);
  s.partial.erase(0, start);
  std::fflush(s.sink);
}

void drain(const Rank& rank, Stream& s) {  // at EOF: print an unterminated last line
  if (!s.partial.empty()) emit(rank, s, "\n", 1);
  close(s.fd);
  s.fd = -1;
}

// What differs between two runs of the job's ranks: its attempts, and the short runs that time a
// CPU layout.
struct Attempt {
  int index = 0;  // restarts before this one
  int port = 0;
  std::string job_dir;
  std::vector<std::pair<std::string, std::string>> env;  // set in each rank, over everything else
  std::vector<std::string> unset_env;
  FILE* out = stdout;  // where the ranks' prefixed lines go
  FILE* err = stderr;
};

pid_t spawn(const Config& c, const Attempt& attempt, int local_rank, int global_rank, Rank& rank) {
  int out[2], err[2];
  if (pipe(out) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  if (pipe(err) != 0) {
    const int error = errno;
    close(out[0]), close(out[1]);
    throw std::runtime_error(std::string("pipe: ") + std::strerror(error));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(out[0]), close(out[1]), close(err[0]), close(err[1]);
    throw std::runtime_error(std::string("fork: ") + std::strerror(error));
  }
  if (pid == 0) {
    setpgid(0, 0);  // own process group: stopping a rank also stops what it started
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    close(out[0]), close(out[1]), close(err[0]), close(err[1]);
    const int world = c.nnodes * c.nproc_per_node;
    setenv("RANK", std::to_string(global_rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
    setenv("LOCAL_WORLD_SIZE", std::to_string(c.nproc_per_node).c_str(), 1);
    setenv("GROUP_RANK", std::to_string(c.node_rank).c_str(), 1);
    setenv("MASTER_ADDR", c.master_addr.c_str(), 1);
    setenv("MASTER_PORT", std::to_string(attempt.port).c_str(), 1);
    setenv(hp::job::kDirEnv, attempt.job_dir.c_str(), 1);
    setenv(hp::job::kRestartEnv, std::to_string(attempt.index).c_str(), 1);
    // One node: the ranks meet in a store file that only the job's user can reach, instead of a
    // TCP port that anyone reaching the host could write to.
    if (c.nnodes == 1)
      setenv(hp::job::kRendezvousFileEnv, (attempt.job_dir + "/" + hp::job::rendezvous_file(attempt.index)).c_str(), 1);
    else
      unsetenv(hp::job::kRendezvousFileEnv);
    // Several nodes: the ranks present the job's secret to node 0's hprun, which serves the store.
    if (c.nnodes > 1)
      setenv(hp::store_wire::kSecretEnv, c.secret.c_str(), 1);
    else
      unsetenv(hp::store_wire::kSecretEnv);
    // Ranks on one node share its cores: without a limit every rank's BLAS and OpenMP pools would
    // start one thread per core and fight over them. The user's own settings win.
    const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
    const std::string per_rank = std::to_string(std::max(1L, cores / c.nproc_per_node));
    for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) setenv(var, per_rank.c_str(), /*overwrite=*/0);
    for (const auto& [name, value] : attempt.env) setenv(name.c_str(), value.c_str(), 1);
    for (const std::string& name : attempt.unset_env) unsetenv(name.c_str());
    std::vector<char*> args;
    for (const std::string& a : c.command) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "hprun: could not start '%s': %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(out[1]);
  close(err[1]);
  rank.global = global_rank;
  rank.pid = pid;
  rank.out = {out[0], attempt.out, {}};
  rank.err = {err[0], attempt.err, {}};
  return pid;
}

volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) { g_forward_signal = sig; }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "stopped with status " + std::to_string(status);
}

// How one attempt ended.
struct Outcome {
  int exit_code = 0;
  bool interrupted = false;  // by a signal to hprun: no restart
  int failed_rank = -1;
  pid_t failed_pid = -1;
  std::string failure;                              // "was killed by signal 9 (Killed)"
  double failed_after = 0;                          // seconds into the attempt
  std::chrono::system_clock::time_point failed_at;  // comparable with file times
  // --recover-processes: the ranks whose process was started again alone during the attempt.
  struct Recovery {
    int number = 0;  // 1, 2, ... in the attempt
    int rank = 0;
    pid_t old_pid = -1, new_pid = -1;
    std::string failure;
    double failed_after = 0;
    std::chrono::system_clock::time_point failed_at;
    std::optional<int64_t> reached;  // the last step the attempt had finished
  };
  std::vector<Recovery> recoveries;
};

// Converts a steady-clock instant to the system clock, to compare with file times.
std::chrono::system_clock::time_point system_time(std::chrono::steady_clock::time_point t) {
  return std::chrono::system_clock::now() -
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::steady_clock::now() - t);
}

class Job {
 public:
  // `restarts_used`: with --recover-processes, the restarts spent so far, which each recovery adds
  // to while fewer than --max-restarts (null: no recovery).
  Job(const Config& config, const Attempt& attempt, int* restarts_used = nullptr)
      : config_(config), attempt_(attempt), restarts_used_(restarts_used), stop_timeout_(config.stop_timeout) {
    try {
      for (int local = 0; local < config.nproc_per_node; ++local) {
        Rank rank;  // kept only once started: the cleanup below signals every rank kept
        spawn(config, attempt, local, config.node_rank * config.nproc_per_node + local, rank);
        ranks_.push_back(std::move(rank));
      }
      if (restarts_used_ != nullptr) {  // what a recovery keeps: every process but the dead one's
        std::string pids;
        for (const Rank& r : ranks_)
          pids += (pids.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r.global) + " pid " +
                  std::to_string(r.pid);
        std::fprintf(stderr, "hprun: the ranks' processes: %s\n", pids.c_str());
      }
    } catch (...) {
      // Ranks already started would wait for the missing ones until their rendezvous timeout.
      signal_all(SIGKILL);
      for (const Rank& r : ranks_)
        if (r.running) waitpid(r.pid, nullptr, 0);
      throw;
    }
  }

  Outcome run() {
    const auto started = std::chrono::steady_clock::now();
    Outcome outcome;
    bool stopping = false;      // a signal forwarded; SIGKILL follows at kill_at
    bool any_finished = false;  // a rank exited 0
    std::chrono::steady_clock::time_point kill_at, failed_at;
    int exit_code = 0;
    // `exited`: when hprun saw the rank exit.
    const auto fail = [&](const Rank& r, int status, std::chrono::steady_clock::time_point exited) {
      std::fprintf(stderr, "hprun: rank %d (pid %d) %s; stopping the other ranks\n", r.global, r.pid,
                   describe_status(status).c_str());
      exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      failed_at = exited;
      outcome.failed_rank = r.global;
      outcome.failed_pid = r.pid;
      outcome.failure = describe_status(status);
      outcome.failed_after = std::chrono::duration<double>(failed_at - started).count();
      outcome.failed_at = system_time(exited);
      // At once: with a peer gone they can save nothing, and a SIGTERM would read as a
      // preemption notice to a program that saves its last words on one (hp-train).
      signal_all(SIGKILL);
    };
    const Rank* consequence = nullptr;  // the first rank that exited hp::job::kExitOtherRankFailed
    int consequence_status = 0;
    std::chrono::steady_clock::time_point consequence_at;
    while (any_running()) {
      pump_output(100);
      if (g_forward_signal != 0) {
        std::fprintf(stderr, "hprun: got signal %d, forwarding it to every rank\n", static_cast<int>(g_forward_signal));
        signal_all(g_forward_signal);
        g_forward_signal = 0;
        // The ranks may save their last words (hp/train/stop.h) first.
        if (!stopping) kill_at = std::chrono::steady_clock::now() + stop_timeout_;
        stopping = true;
        outcome.interrupted = true;
        if (exit_code == 0) exit_code = kInterrupted;
      }
      reap([&](Rank& r, int status) {
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (!failed) any_finished = true;       // a rank started again would wait for it in vain
        if (!failed || exit_code != 0) return;  // later failures are consequences of the first
        if (WIFSIGNALED(status) && !stopping && consequence == nullptr && !any_finished && can_recover(outcome)) {
          recover(r, status, started, outcome);
          return;
        }
        if (WIFEXITED(status) && WEXITSTATUS(status) == hp::job::kExitOtherRankFailed) {
          if (consequence == nullptr) {
            consequence = &r;
            consequence_status = status;
            consequence_at = std::chrono::steady_clock::now();
          }
          return;
        }
        fail(r, status, std::chrono::steady_clock::now());
      });
      if (consequence != nullptr && exit_code == 0 && std::chrono::steady_clock::now() - consequence_at >= kCauseGrace)
        fail(*consequence, consequence_status, consequence_at);
      if (stopping && std::chrono::steady_clock::now() >= kill_at && any_running()) {
        std::fprintf(stderr, "hprun: ranks still running after %lld s, sending SIGKILL\n",
                     static_cast<long long>(stop_timeout_.count()));
        signal_all(SIGKILL);
        stopping = false;
      }
    }
    if (consequence != nullptr && exit_code == 0) fail(*consequence, consequence_status, consequence_at);  // no other
    if (exit_code != 0 && !last_recovery_done(outcome)) {
      // It never trained again (a failure while the ranks met): a restart of every rank may.
      --*restarts_used_;
      std::fprintf(stderr, "hprun: recovery %d did not train again; its restart is given back\n",
                   outcome.recoveries.back().number);
    }
    if (outcome.failed_rank >= 0)
      std::fprintf(stderr, "hprun: every rank stopped %.2f s after rank %d failed\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count(),
                   outcome.failed_rank);
    // Collect what the ranks printed last; a grandchild holding a pipe open must not keep us here.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (any_open() && std::chrono::steady_clock::now() < deadline) pump_output(50);
    for (Rank& r : ranks_) {
      if (r.out.fd >= 0) drain(r, r.out);
      if (r.err.fd >= 0) drain(r, r.err);
    }
    outcome.exit_code = exit_code;
    return outcome;
  }

 private:
  bool any_running() const {
    for (const Rank& r : ranks_)
      if (r.running) return true;
    return false;
  }
  bool any_open() const {
    for (const Rank& r : ranks_)
      if (r.out.fd >= 0 || r.err.fd >= 0) return true;
    return false;
  }

  void signal_all(int sig) {
    for (const Rank& r : ranks_)
      if (r.running) kill(-r.pid, sig);
  }

  void pump_output(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, Stream*>> owners;
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(&r, s);
        }
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    if (poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    char buffer[65536];
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n > 0)
        emit(*owners[i].first, *owners[i].second, buffer, static_cast<size_t>(n));
      else if (n == 0 || errno != EINTR)
        drain(*owners[i].first, *owners[i].second);
    }
  }

  template <typename OnExit>
  void reap(OnExit on_exit) {
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
        r.running = false;
        on_exit(r, status);
      }
    }
  }

  // Starts the process of rank `r`, which died, again as the next recovery, while the others wait
  // in theirs (hp/core/job.h): it meets them in a new rendezvous, which the file naming the rank
  // tells them of.
  void recover(Rank& r, int status, std::chrono::steady_clock::time_point started, Outcome& outcome) {
    Outcome::Recovery recovery;
    recovery.number = static_cast<int>(outcome.recoveries.size()) + 1;
    recovery.rank = r.global;
    recovery.old_pid = r.pid;
    recovery.failure = describe_status(status);
    recovery.failed_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    recovery.failed_at = std::chrono::system_clock::now();
    recovery.reached = hp::job::read_number(attempt_.job_dir + "/" + hp::job::last_step_file(attempt_.index));
    ++*restarts_used_;
    std::fprintf(stderr,
                 "hprun: rank %d (pid %d) %s; starting only its process again (recovery %d, restart %d of at most "
                 "%d); the other ranks wait in theirs\n",
                 r.global, r.pid, recovery.failure.c_str(), recovery.number, *restarts_used_, config_.max_restarts);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while ((r.out.fd >= 0 || r.err.fd >= 0) && std::chrono::steady_clock::now() < deadline) pump_output(20);
    if (r.out.fd >= 0) drain(r, r.out);
    if (r.err.fd >= 0) drain(r, r.err);
    Attempt again = attempt_;
    const std::string job_dir = attempt_.job_dir + "/";
    again.env.emplace_back(hp::job::kRecoveryEnv, std::to_string(recovery.number));
    again.env.emplace_back(hp::job::kRendezvousFileEnv,
                           job_dir + hp::job::recovery_rendezvous_file(attempt_.index, recovery.number));
    const int local = r.global - config_.node_rank * config_.nproc_per_node;
    spawn(config_, again, local, r.global, r);
    r.running = true;
    recovery.new_pid = r.pid;
    if (!hp::job::write_atomically(job_dir + hp::job::recovery_file(attempt_.index, recovery.number),
                                   std::to_string(r.global) + "\n"))
      throw std::runtime_error("could not write " + job_dir + hp::job::recovery_file(attempt_.index, recovery.number));
    outcome.recoveries.push_back(recovery);
  }

  // Whether a rank whose process died can be started again alone: a restart is left, the program
  // is training (the attempt's first step is reported: a failure while the ranks start up ends the
  // attempt), and the last recovery, if any, is training again.
  bool can_recover(const Outcome& outcome) const {
    return restarts_used_ != nullptr && *restarts_used_ < config_.max_restarts &&
           std::filesystem::exists(attempt_.job_dir + "/" + hp::job::first_step_file(attempt_.index)) &&
           last_recovery_done(outcome);
  }
  // Whether the last recovery, if any, is training again (its first step is reported).
  bool last_recovery_done(const Outcome& outcome) const {
    return outcome.recoveries.empty() ||
           std::filesystem::exists(attempt_.job_dir + "/" +
                                   hp::job::recovery_first_step_file(attempt_.index, outcome.recoveries.back().number));
  }

  Config config_;
  Attempt attempt_;
  int* restarts_used_;
  std::chrono::seconds stop_timeout_;
  std::vector<Rank> ranks_;
};

// The job's private directory (hp/core/job.h): mode 0700, removed with everything in it when hprun ends.
class JobDir {
 public:
  JobDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/hprun-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr)
      throw std::runtime_error("could not create the job directory " + pattern + ": " + std::strerror(errno));
    path_ = pattern;
  }
  ~JobDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    remove_shared_memory();
  }
  JobDir(const JobDir&) = delete;
  JobDir& operator=(const JobDir&) = delete;

  const std::string& path() const { return path_; }
  // Removes the job's shared-memory segments that a rank killed while its group was being set up
  // left behind (the ranks unlink them as soon as every member has mapped them).
  void remove_shared_memory() const {
    const std::string prefix = hp::job::shm_prefix(path_);
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
      if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
      std::error_code ignored;
      std::filesystem::remove(entry.path(), ignored);
    }
  }
  std::optional<int64_t> step(const std::string& file) const { return hp::job::read_number(path_ + "/" + file); }
  // When `file` was last written.
  std::optional<std::chrono::system_clock::time_point> written(const std::string& file) const {
    struct stat info {};
    if (stat((path_ + "/" + file).c_str(), &info) != 0) return std::nullopt;
    return std::chrono::system_clock::time_point(std::chrono::seconds(info.st_mtim.tv_sec) +
                                                 std::chrono::nanoseconds(info.st_mtim.tv_nsec));
  }

 private:
  std::string path_;
};

// What each process-level recovery of attempt `index` cost: the steps it had finished beyond the one
// the ranks recovered from memory.
// ": 2 steps lost": the steps finished (`reached`) beyond the one training went on from.
std::string steps_lost(int64_t reached, int64_t from) {
  const int64_t lost = std::max<int64_t>(0, reached - from);
  return ": " + std::to_string(lost) + (lost == 1 ? " step lost" : " steps lost");
}

// ", training again 0.7 s after the failure": when the run that went on reported its first step.
std::string training_again(std::chrono::system_clock::time_point training,
                           std::chrono::system_clock::time_point failed) {
  char again[64];
  std::snprintf(again, sizeof(again), ", training again %.1f s after the failure",
                std::chrono::duration<double>(training - failed).count());
  return again;
}

void print_recoveries(const Outcome& o, int index, const JobDir& dir) {
  for (const Outcome::Recovery& r : o.recoveries) {
    char head[256];
    std::snprintf(head, sizeof(head), "hprun:   recovery %d of attempt %d: rank %d (pid %d) %s %.1f s in", r.number,
                  index + 1, r.rank, r.old_pid, r.failure.c_str(), r.failed_after);
    std::string line = head;
    if (r.reached) line += ", after step " + std::to_string(*r.reached);
    line += "; only its process was started again (pid " + std::to_string(r.new_pid) + ")";
    const std::string first_step = hp::job::recovery_first_step_file(index, r.number);
    if (const std::optional<int64_t> from = dir.step(first_step)) {
      line += ", continuing from step " + std::to_string(*from) + " in memory";
      if (r.reached) line += steps_lost(*r.reached, *from);
    }
    if (const auto training = dir.written(first_step)) line += training_again(*training, r.failed_at);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

// What each failure cost: the steps that attempt had finished beyond the one the next attempt
// started from. Steps are known when the program reports them (hp-train does).
void print_restart_summary(const std::vector<Outcome>& attempts, const JobDir& dir) {
  std::fprintf(stderr, "hprun: restart summary (%zu %s):\n", attempts.size(),
               attempts.size() == 1 ? "attempt" : "attempts");
  for (size_t k = 0; k < attempts.size(); ++k) {
    const Outcome& o = attempts[k];
    const int index = static_cast<int>(k);
    print_recoveries(o, index, dir);
    if (o.failed_rank < 0) {
      std::fprintf(stderr, "hprun:   attempt %zu: %s\n", k + 1, o.exit_code == 0 ? "finished" : "interrupted");
      continue;
    }
    char when[32];
    std::snprintf(when, sizeof(when), " %.1f s in", o.failed_after);
    std::string line =
        "rank " + std::to_string(o.failed_rank) + " (pid " + std::to_string(o.failed_pid) + ") " + o.failure + when;
    std::optional<int64_t> reached = dir.step(hp::job::last_step_file(index));
    if (!reached) reached = dir.step(hp::job::first_step_file(index));  // failed within its first step
    if (reached) line += ", after step " + std::to_string(*reached);
    const std::optional<int64_t> next = dir.step(hp::job::first_step_file(index + 1));
    if (reached && next)
      line += "; attempt " + std::to_string(k + 2) + " resumed from step " + std::to_string(*next) +
              steps_lost(*reached, *next);
    // The next attempt wrote its first step when it was about to train.
    if (const auto training = dir.written(hp::job::first_step_file(index + 1)))
      line += training_again(*training, o.failed_at);
    std::fprintf(stderr, "hprun:   attempt %zu: %s\n", k + 1, line.c_str());
  }
}

// Waits `delay`, or returns false at once when hprun gets a signal.
bool wait_unless_signalled(std::chrono::seconds delay) {
  const auto until = std::chrono::steady_clock::now() + delay;
  while (std::chrono::steady_clock::now() < until) {
    if (g_forward_signal != 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return g_forward_signal == 0;
}

// OPENBLAS_NUM_THREADS follows the layout's threads unless the user set it (their settings win).
std::vector<std::pair<std::string, std::string>> layout_env(const hp::hprun::CpuLayout& layout) {
  const std::string threads = std::to_string(layout.threads);
  std::vector<std::pair<std::string, std::string>> env = {{"OMP_NUM_THREADS", threads},
                                                          {"ATEN_CPU_CAPABILITY", layout.capability}};
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) env.emplace_back("OPENBLAS_NUM_THREADS", threads);
  return env;
}

// What a run timing a layout answered (hp/core/job.h): its throughput, that the job does nothing
// to time, or nothing usable.
struct ProbeAnswer {
  std::optional<double> throughput;
  bool skip = false;
};

ProbeAnswer read_probe_answer(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word)) return {};
  if (word == hp::job::kLayoutProbeSkip) return {std::nullopt, true};
  char* end = nullptr;
  const double value = std::strtod(word.c_str(), &end);
  if (end != word.c_str() + word.size() || !std::isfinite(value) || value <= 0.0) return {};
  return {value};
}

// --cpu-layout auto's choice, from the cache or timed now (each candidate by a short run of the job
// in its own rendezvous): the layout, none (the job has nothing to time: cores / ranks threads, as
// --cpu-layout even), or an exit code that ends hprun.
struct LayoutChoice {
  std::optional<hp::hprun::CpuLayout> layout;
  int exit_code = 0;
};

LayoutChoice choose_cpu_layout(const Config& config) {
  namespace hl = hp::hprun;
  const int cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const std::string key = hl::layout_cache_key(cores, config.nproc_per_node, config.command);
  const std::filesystem::path cache = hl::layout_cache_path();
  if (const std::optional<hl::CachedLayout> hit = hl::cached_layout(cache, key)) {
    std::fprintf(stderr, "hprun: --cpu-layout auto: %s (%.0f/s, measured %s; cached in %s)\n",
                 hit->layout.text().c_str(), hit->throughput, hit->measured.c_str(), cache.c_str());
    return {hit->layout};
  }
  const std::vector<hl::CpuLayout> candidates = hl::layout_candidates(cores, config.nproc_per_node);
  std::fprintf(stderr,
               "hprun: --cpu-layout auto: timing %zu layouts of %d ranks on %d cores, a short run of the job each\n",
               candidates.size(), config.nproc_per_node, cores);
  std::optional<hl::CpuLayout> best;
  double best_throughput = 0.0;
  for (const hl::CpuLayout& candidate : candidates) {
    if (g_forward_signal != 0) return {std::nullopt, kInterrupted};  // between two runs: start no other
    const JobDir dir;  // a fresh rendezvous; the probe's run directory goes with it
    Attempt probe{0, config.master_port == 0 ? pick_free_port() : config.master_port, dir.path()};
    const std::string result = dir.path() + "/layout-probe";
    probe.env = layout_env(candidate);
    probe.env.emplace_back(hp::job::kLayoutProbeEnv, result);
    probe.unset_env = {"HP_FAULT"};  // a drill's faults are for the job itself
    std::unique_ptr<FILE, int (*)(FILE*)> log(std::tmpfile(), &std::fclose);
    if (!log) throw std::runtime_error(std::string("tmpfile: ") + std::strerror(errno));
    probe.out = probe.err = log.get();
    const Outcome outcome = Job(config, probe).run();
    if (outcome.interrupted) return {std::nullopt, kInterrupted};
    const ProbeAnswer answer = read_probe_answer(result);
    if (outcome.exit_code == 0 && answer.skip) {
      std::fprintf(stderr, "hprun: --cpu-layout auto: %s has nothing to time; it runs with cores / ranks threads\n",
                   config.command.front().c_str());
      return {};
    }
    const std::optional<double> throughput = answer.throughput;
    if (outcome.exit_code != 0 || !throughput) {
      std::fprintf(stderr, "hprun: --cpu-layout auto: the run timing %s %s; its output:\n", candidate.text().c_str(),
                   outcome.exit_code != 0 ? ("failed (exit code " + std::to_string(outcome.exit_code) + ")").c_str()
                                          : "wrote no result");
      std::rewind(log.get());
      char buffer[4096];
      for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), log.get())) > 0;) std::fwrite(buffer, 1, n, stderr);
      if (outcome.exit_code == 0)
        std::fprintf(stderr,
                     "hprun: %s wrote no throughput to %s: --cpu-layout auto needs a program that answers it "
                     "(hp-train does); run without it\n",
                     config.command.front().c_str(), hp::job::kLayoutProbeEnv);
      return {std::nullopt, outcome.exit_code != 0 ? outcome.exit_code : kUsageError};
    }
    std::fprintf(stderr, "hprun:   %s: %.0f/s\n", candidate.text().c_str(), *throughput);
    if (*throughput > best_throughput) best = candidate, best_throughput = *throughput;
  }
  hl::cache_layout(cache, key, *best, best_throughput);
  std::fprintf(stderr, "hprun: --cpu-layout auto: %s, the fastest (cached in %s)\n", best->text().c_str(),
               cache.c_str());
  return {best};
}

int run_attempts(const Config& config) {
  std::vector<std::pair<std::string, std::string>> chosen_env;
  if (config.cpu_layout_auto) {
    const LayoutChoice choice = choose_cpu_layout(config);
    if (choice.exit_code != 0) return choice.exit_code;
    if (g_forward_signal != 0) return kInterrupted;  // got during the last timing run's end
    if (choice.layout) chosen_env = layout_env(*choice.layout);
  }
  const JobDir dir;
  // Several nodes: node 0 serves the rendezvous, on the master address's interface only.
  std::optional<hp::hprun::RendezvousServer> rendezvous;
  if (config.nnodes > 1 && config.node_rank == 0)
    rendezvous.emplace(config.master_addr, config.master_port == 0 ? 29500 : config.master_port, config.secret);
  std::vector<Outcome> attempts;
  int restarts_used = 0;  // of --max-restarts: restarts of the job and process-level recoveries
  for (int index = 0;; ++index) {
    Attempt attempt{index, config.master_port, dir.path()};
    attempt.env = chosen_env;
    if (config.recover_processes) attempt.env.emplace_back(hp::job::kProcessRecoveryEnv, "1");
    if (attempt.port == 0) attempt.port = config.nnodes == 1 ? pick_free_port() : 29500;
    attempts.push_back(Job(config, attempt, config.recover_processes ? &restarts_used : nullptr).run());
    Outcome& outcome = attempts.back();
    // A usage or config error (exit code 2) would only be repeated.
    const bool restartable = outcome.exit_code != 0 && outcome.exit_code != kUsageError && !outcome.interrupted;
    const bool restart = restartable && restarts_used < config.max_restarts;
    if (restart) {
      const std::chrono::seconds delay = restart_backoff(index + 1);
      ++restarts_used;
      std::fprintf(stderr, "hprun: restarting every rank in %lld s (restart %d of at most %d)\n",
                   static_cast<long long>(delay.count()), restarts_used, config.max_restarts);
      if (wait_unless_signalled(delay)) continue;
      outcome.interrupted = true;
      outcome.exit_code = kInterrupted;
    }
    if (attempts.size() > 1 || !outcome.recoveries.empty()) print_restart_summary(attempts, dir);
    if (outcome.exit_code != 0) {
      if (config.max_restarts > 0 && outcome.exit_code == kUsageError)
        std::fprintf(stderr,
                     "hprun: not restarting: exit code %d is a usage or config error, which a restart would "
                     "repeat\n",
                     kUsageError);
      else if (config.max_restarts > 0 && restartable)
        std::fprintf(stderr, "hprun: no restarts left (--max-restarts %d)\n", config.max_restarts);
      std::fprintf(stderr, "hprun: job failed (exit code %d)\n", outcome.exit_code);
    }
    return outcome.exit_code;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Config> config;
  try {
    config = parse(argc, argv);
  } catch (const hp::tools::UsageError& e) {
    std::fprintf(stderr, "hprun: %s (see hprun --help)\n", e.what());
    return kUsageError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hprun: %s\n", e.what());
    return kUsageError;
  }
  if (!config) return 0;
  try {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigaction(SIGINT, &action, nullptr);
    sigaction(SIGTERM, &action, nullptr);
    sigaction(SIGHUP, &action, nullptr);  // the terminal went away: stop the ranks rather than orphan them
    signal(SIGPIPE, SIG_IGN);
    return run_attempts(*config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hprun: %s\n", e.what());
    return 1;
  }
}
