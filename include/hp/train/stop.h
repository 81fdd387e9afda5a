// Stopping a run early with last words (docs/resilience.md#last-words). A preemption notice
// (SIGTERM), Ctrl-C or the program itself asks hp::train::train to stop; the ranks agree on the
// step to stop after (the request travels with the numbers they already exchange after each
// step's backward, so they agree at no extra cost), save that step's checkpoint synchronously,
// marked as last words, and train() returns with TrainResult::stop_signal set.
#pragma once

namespace hp::train {

// Asks the runs of this process to stop after the step in progress; `signal_number` says why
// (SIGTERM for a preemption notice). Async-signal-safe.
void request_stop(int signal_number);

// The signal of the request pending, 0 when none.
int stop_requested();

// SIGTERM, SIGINT and SIGHUP request a stop from now on; a second SIGINT (Ctrl-C) ends the process
// at once. A repeated SIGTERM or SIGHUP does not (a batch system and hprun may both send one).
void stop_on_signals();

}  // namespace hp::train
