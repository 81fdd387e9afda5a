// The trainer's report to hprun: the step each attempt of the job (and each process-level recovery
// in it) started from and the last step it finished, in the job directory (hp/core/job.h). hprun's restart summary
// reads them to say how many steps a failure cost.
#pragma once

#include <memory>

#include "hp/train/callbacks.h"

namespace hp::train::detail {

// The callback that writes them, or null when the process does not run under hprun.
std::shared_ptr<Callback> job_progress();

}  // namespace hp::train::detail
