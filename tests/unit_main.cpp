// The unit test program's main: GoogleTest's, plus a crash report. A test that crashes (SIGSEGV,
// SIGBUS, SIGFPE, SIGILL, SIGABRT) writes its name and a backtrace of the crashing thread to stderr,
// then dies of the same signal, so a crash on a machine we reach only through logs (the GPU machine's
// scripts/device-check) says where it happened.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
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

void write_text(const char* text) { (void)!write(STDERR_FILENO, text, std::strlen(text)); }

const char* signal_name(int signal) {  // strsignal is not async-signal-safe
  switch (signal) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
    default:
      return "?";
  }
}

std::atomic_flag reporting = ATOMIC_FLAG_INIT;

void on_crash(int signal) {
  if (!reporting.test_and_set()) {  // the first thread to crash reports; SA_RESETHAND makes the next one die
    write_text("\n*** crashed with ");
    write_text(signal_name(signal));
    if (current_test[0] != '\0') {
      write_text(" in test ");
      write_text(current_test);
    }
    write_text("; backtrace:\n");
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  }
  raise(signal);  // the default action now (SA_RESETHAND)
}

void report_crashes() {
  void* warm[1];
  backtrace(warm, 1);                    // loads libgcc now, not inside the handler
  static char alternate_stack[1 << 16];  // a stack overflow of the main thread can still report
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_handler = on_crash;
  action.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(signal, &action, nullptr);
  testing::UnitTest::GetInstance()->listeners().Append(new NameKeeper);  // gtest owns it
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  report_crashes();
  return RUN_ALL_TESTS();
}
