// What the trainer does with a stop request (hp/train/stop.h) once it has honoured it.
#pragma once

#include <string>

namespace hp::train::detail {

// A later run of this process starts without the request.
void clear_stop_request();

// "SIGTERM (a preemption notice)", or "stop request N" for a number that is not one of those.
std::string signal_name(int signal_number);

}  // namespace hp::train::detail
