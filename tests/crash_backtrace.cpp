// A test program that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes the test it was in
// and a backtrace of the crashing thread to stderr, then dies of the same signal: a crash on a machine
// we reach only through logs (the GPU machine's scripts/device-check) says where it happened.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>

namespace {

// The running test's name, kept by a listener: the handler must not call into gtest (it locks).
char current_test[512] = "";

class NameKeeper : public testing::EmptyTestEventListener {
  void OnTestStart(const testing::TestInfo& test) override {
    std::snprintf(current_test, sizeof current_test, "%s.%s", test.test_suite_name(), test.name());
  }
  void OnTestEnd(const testing::TestInfo&) override { current_test[0] = '\0'; }
};

void write_text(const char* text) {
  if (text != nullptr) (void)!write(STDERR_FILENO, text, std::strlen(text));
}

void on_crash(int signal) {
  static volatile std::sig_atomic_t entered = 0;
  if (entered++) _exit(128 + signal);  // a second crash while reporting the first
  write_text("\n*** crashed with signal ");
  write_text(strsignal(signal));
  if (current_test[0] != '\0') {
    write_text(" in test ");
    write_text(current_test);
  }
  write_text("; backtrace:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

const bool installed = [] {
  void* warm[1];
  backtrace(warm, 1);                                                    // loads libgcc now, not inside the handler
  testing::UnitTest::GetInstance()->listeners().Append(new NameKeeper);  // gtest owns it
  for (int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(signal, on_crash);
  return true;
}();

}  // namespace
