#include "hp/train/stop.h"

#include <signal.h>

#include <atomic>
#include <string>

#include "train/stop_internal.h"

namespace hp::train {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "read and written by a signal handler");

// The first signal asks. A second Ctrl-C means "now": SIGINT's default action ends the process. A
// repeated SIGTERM or SIGHUP does not: a batch system signals every process of a job at once, so a
// rank gets the launcher's forwarded copy too; the launcher's SIGKILL is what says "now".
void on_stop_signal(int signal_number) {
  if (g_stop_signal.exchange(signal_number) == 0 || signal_number != SIGINT) return;
  signal(SIGINT, SIG_DFL);
  raise(SIGINT);
}

}  // namespace

void request_stop(int signal_number) { g_stop_signal.store(signal_number); }

int stop_requested() { return g_stop_signal.load(); }

void stop_on_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // a blocking call the signal lands in carries on
  sigemptyset(&action.sa_mask);
  for (const int signal_number : {SIGTERM, SIGINT, SIGHUP}) sigaction(signal_number, &action, nullptr);
}

namespace detail {

void clear_stop_request() { g_stop_signal.store(0); }

std::string signal_name(int signal_number) {
  switch (signal_number) {
    case SIGTERM:
      return "SIGTERM (a preemption notice)";
    case SIGINT:
      return "SIGINT (Ctrl-C)";
    case SIGHUP:
      return "SIGHUP (the terminal closed)";
    default:
      return "stop request " + std::to_string(signal_number);
  }
}

}  // namespace detail

}  // namespace hp::train
