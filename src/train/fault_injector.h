// Faults injected on purpose, for tests and drills of the recovery paths: the config's
// resilience.faults and the environment's HP_FAULT list them as KIND:RANK:STEP[:ARG], separated by
// commas (docs/resilience.md):
//
//   kill:2:7       rank 2 SIGKILLs itself after step 7 (a crashed node)
//   throw:1:4      rank 1 throws hp::Error after step 4 (a failing rank)
//   throw:1:4:backward  the same after step 4's backward (its optimizer step not taken), and
//                  throw:1:4:optimizer as the optimizer step begins (the state is being changed)
//   hang:0:3       rank 0 stops at the start of step 3 and never returns (a stuck rank)
//   delay:1:5:2.5  rank 1 sleeps 2.5 s at the start of step 5 (a straggler)
//   flip:2:7:FQN   rank 2 flips bit 22 of the first element of its shard of parameter FQN (default:
//                  its first parameter) after step 7: silent data corruption in one replica
//   flip_grad:2:7:FQN  the same in the gradient of that shard, once it is reduced and clipped and
//                  before step 7's optimizer step: a corrupted gradient the optimizer applies
//   flip_state:2:7:FQN  the same in the first of that shard's optimizer state tensors (AdamW's
//                  exp_avg) after step 7
//   preempt:0:7    rank 0 has hprun stop the job (SIGTERM to it, which hprun forwards to every rank)
//                  at the start of step 7, and waits for its own SIGTERM: a preemption notice
//   nan:1:7        rank 1 sets the first element of its first parameter's gradient to NaN after
//                  step 7's backward: a transient fault (a rerun of the step does not see it)
//   nan:1:7:always the same in every run of step 7 (the step reruns alike): what a bad batch does
//   damage_copy:2:8  rank 2, sending the in-memory checkpoint of step 8 that it keeps for a buddy
//                  whose process was started again, damages the first copy it sends (one byte of
//                  each tensor: the middle element's sign and exponent); the checksum shows it, and
//                  the buddy asks again
//   spike:1:7:50   rank 1 multiplies its gradients by 50 after step 7's backward, once (a flipped
//                  exponent); spike:1:7:50:always in every run of step 7
//
// Each fault fires once per job: under hprun a claim file in the job directory (hp/core/job.h)
// keeps a restarted attempt from firing it again.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hp/models/model_parts.h"
#include "hp/train/callbacks.h"

namespace torch::optim {
class Optimizer;
}

namespace hp::train::detail {

enum class FaultKind {
  kKill,
  kThrow,
  kHang,
  kDelay,
  kPreempt,
  kFlip,
  kFlipGrad,
  kFlipState,
  kNan,
  kSpike,
  kDamageCopy
};

struct Fault {
  FaultKind kind = FaultKind::kKill;
  int rank = 0;
  int64_t step = 1;
  double seconds = 0.0;   // delay
  double factor = 1.0;    // spike
  bool always = false;    // nan, spike: in every run of the step (a rerun too), not once
  std::string parameter;  // flip, flip_grad, flip_state, nan (empty: the rank's first)
  std::string when;       // throw: "" (after the step), "backward" or "optimizer"
  int index = 0;          // position in the job's list (config, then environment): names the claim file
  std::string text;       // as written (for errors)
  std::string source;     // where: "HP_FAULT" or "resilience.faults" (for errors)
};

// Parses a list from `source`, numbering its faults from `first_index`; a malformed one throws
// hp::Error quoting it.
std::vector<Fault> parse_faults(const std::string& spec, const std::string& source = "HP_FAULT", int first_index = 0);

// A fault for a rank the world does not have, or a step the run never reaches, is an error: it
// would never fire.
void check_faults_fire(const std::vector<Fault>& faults, int world_size, int64_t steps);

// The faults of `configured` (resilience.faults), then those of HP_FAULT, checked.
std::vector<Fault> injected_faults(const std::string& configured, int world_size, int64_t steps);

// Callbacks that fire the faults meant for `rank`; a flip changes a parameter of `parts` (or its
// gradient, or its state in `optimizer`), which must name it. The callbacks keep a reference to
// `optimizer`.
std::vector<std::shared_ptr<Callback>> fault_callbacks(const std::vector<Fault>& faults, int rank,
                                                       const models::ModelParts& parts,
                                                       torch::optim::Optimizer& optimizer);

// Whether `rank`, sending its buddy's in-memory checkpoint of `step` in a recovery, damages the
// copy it sends: true for a damage_copy fault of that rank and step, once per job under hprun (in
// every recovery to that step without it).
bool damages_copy(const std::vector<Fault>& faults, int rank, int64_t step);

}  // namespace hp::train::detail
