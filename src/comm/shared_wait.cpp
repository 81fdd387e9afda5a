#include "comm/shared_wait.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <string>
#include <thread>

namespace hp::comm::detail {
namespace {

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word may be shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds at_most) {
  const int64_t ns = std::max<int64_t>(at_most.count(), 0);
  const timespec timeout{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  futex(word, FUTEX_WAIT, seen, &timeout);
}

void wake_all(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

bool process_gone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t end_of_name = line.rfind(')');  // the name may hold spaces and parentheses
  return end_of_name != std::string::npos && line.size() > end_of_name + 2 && line[end_of_name + 2] == 'Z';
}

}  // namespace hp::comm::detail
