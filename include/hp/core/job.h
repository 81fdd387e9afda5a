// What hprun tells the programs it starts besides the rendezvous variables, and what they tell it
// back. hprun makes a job directory private to the user (mode 0700) that lives as long as hprun,
// across restarts; in it:
//
//   rendezvous-K          the store of attempt K (single-node jobs): only the job's user can reach it
//   attempt-K.first-step  the step attempt K started from (0, or the checkpoint it resumed)
//   attempt-K.last-step   the last step attempt K finished
//   fault-I.fired         fault I of HP_FAULT has fired (faults are one-shot per job)
//   attempt-K.recovery-G  with hprun --recover-processes: recovery G (1, 2, ...) of attempt K has
//                         begun; holds the world rank whose process hprun started again
//   rendezvous-K.G        the store in which the ranks of recovery G meet again
//   attempt-K.recovery-G.first-step  the step recovery G continued from (its in-memory checkpoint)
//
// hprun reads the step files for its restart summary (how many steps a failure cost). Header-only
// and plain POSIX C++: hprun, which does not link LibTorch, and the library share it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>

namespace hp::job {

inline constexpr char kDirEnv[] = "HP_JOB_DIR";                     // the job directory
inline constexpr char kRestartEnv[] = "HP_RESTART_COUNT";           // 0 for the first attempt
inline constexpr char kRendezvousFileEnv[] = "HP_RENDEZVOUS_FILE";  // the attempt's store file
// Set by hprun --cpu-layout auto for the short runs that measure a layout: the program runs a few
// steps of its job, leaves no results behind, and its rank 0 writes its throughput (a positive
// number, higher is faster; hp-train's tokens/s) to this file, or kLayoutProbeSkip when the job
// does no work worth timing (hp-train --dry-run): hprun then runs it without choosing.
inline constexpr char kLayoutProbeEnv[] = "HP_LAYOUT_PROBE";
inline constexpr char kLayoutProbeSkip[] = "skip";
// Set to "1" by hprun --recover-processes: when a rank's process dies, hprun starts only that
// process again and the others wait for it (hp-train: docs/resilience.md#process-level-recovery).
inline constexpr char kProcessRecoveryEnv[] = "HP_PROCESS_RECOVERY";
// In a process hprun started again: the recovery it joins (1, 2, ...).
inline constexpr char kRecoveryEnv[] = "HP_RECOVERY";
// A rank's exit code for "another rank's error ended this one" (hp-train: hp::train::OtherRankError).
// That rank, the cause, exits moments later (they save their last words together): hprun names it.
inline constexpr int kExitOtherRankFailed = 4;

// The job directory, when the process runs under hprun.
inline std::optional<std::string> dir() {
  const char* d = std::getenv(kDirEnv);
  if (d == nullptr || *d == '\0') return std::nullopt;
  return std::string(d);
}

// How many times hprun restarted the job before this attempt (0 without hprun).
inline int restart_count() {
  const char* n = std::getenv(kRestartEnv);
  return n == nullptr ? 0 : std::atoi(n);
}

// How the names of the job's shared-memory segments (/dev/shm/<prefix><random>) begin: "hp-" and,
// under hprun, the job directory's name, so that hprun can remove what a killed rank left behind.
inline std::string shm_prefix(const std::optional<std::string>& job_dir = dir()) {
  if (!job_dir) return "hp-";
  const size_t slash = job_dir->find_last_of('/');
  return "hp-" + (slash == std::string::npos ? *job_dir : job_dir->substr(slash + 1)) + "-";
}

// Whether hprun restarts only a process that dies (kProcessRecoveryEnv).
inline bool process_recovery() {
  const char* on = std::getenv(kProcessRecoveryEnv);
  return on != nullptr && std::string(on) == "1";
}

// The recovery a restarted process joins (kRecoveryEnv); 0 for a process hprun started with the job.
inline int recovery_count() {
  const char* n = std::getenv(kRecoveryEnv);
  return n == nullptr ? 0 : std::atoi(n);
}

inline std::string rendezvous_file(int attempt) { return "rendezvous-" + std::to_string(attempt); }
inline std::string first_step_file(int attempt) { return "attempt-" + std::to_string(attempt) + ".first-step"; }
inline std::string last_step_file(int attempt) { return "attempt-" + std::to_string(attempt) + ".last-step"; }
inline std::string recovery_file(int attempt, int recovery) {
  return "attempt-" + std::to_string(attempt) + ".recovery-" + std::to_string(recovery);
}
inline std::string recovery_rendezvous_file(int attempt, int recovery) {
  return rendezvous_file(attempt) + "." + std::to_string(recovery);
}
inline std::string recovery_first_step_file(int attempt, int recovery) {
  return recovery_file(attempt, recovery) + ".first-step";
}
// Whether hprun began recovery `recovery` of this attempt (it started a dead rank's process again).
inline bool recovery_begun(int recovery) {
  const std::optional<std::string> job = dir();
  return job && ::access((*job + "/" + recovery_file(restart_count(), recovery)).c_str(), F_OK) == 0;
}
inline std::string fault_fired_file(int index) { return "fault-" + std::to_string(index) + ".fired"; }

// Replaces `path` with `text` so that a reader sees the old or the new content, never a part.
inline bool write_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!(out << text)) return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

inline std::optional<int64_t> read_number(const std::string& path) {
  std::ifstream in(path);
  int64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

// Creates `path` unless it exists: true for the one caller that created it, false when it
// existed (an atomic claim shared by every process of the job). Any other failure throws: a claim
// that cannot be recorded must not pass for one made earlier.
inline bool claim(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  if (errno == EEXIST) return false;
  throw std::system_error(errno, std::generic_category(), "cannot create " + path);
}

}  // namespace hp::job
