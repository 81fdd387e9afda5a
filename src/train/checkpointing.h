// The run's checkpoints: the model parts' and the optimizer's live tensors, resumed from the latest
// checkpoint of the run, saved every checkpoint.interval steps with staging and writing in the
// background (each save committed at the next step, or at once when checkpoint.async is off), and
// pruned to the newest checkpoint.keep. A copy of a tied weight is left out of saves (the rank
// holding the original saves it) and filled by loads. The mesh's RNG position (DTensor random ops),
// per pipeline rank, is saved with each checkpoint and set back on resume.
//
// Collective over `world`: every rank calls each method at the same step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "hp/comm/process_group.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dtensor/random.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/optim/lr_scheduler.h"
#include "hp/train/config.h"

namespace hp::train::detail {

class Checkpointing {
 public:
  Checkpointing(const TrainConfig& config, const DeviceMesh& mesh, const models::ModelParts& parts,
                torch::optim::Optimizer& optimizer, const comm::ProcessGroup& world);
  Checkpointing(const Checkpointing&) = delete;
  Checkpointing& operator=(const Checkpointing&) = delete;

  // Loads the run's latest checkpoint into the live state, sets the scheduler to its step and the
  // mesh's RNG to its position; returns that step, or 0 when the run has no checkpoint yet (or,
  // with only_this_job, none saved under this process's hprun job).
  int64_t resume(LRScheduler& scheduler, bool only_this_job);
  // Before the optimizer changes the state: a save still staging in the background reads it.
  void wait_staged() { pending_.wait_staged(); }
  // After optimizer step `step` (1-based): commits a save started at an earlier step.
  void commit_earlier_than(int64_t step);
  // After optimizer step `step`: at the interval, starts saving the state of that step and returns
  // the checkpoint's directory; otherwise nullopt.
  std::optional<std::string> save_if_due(int64_t step, const LRScheduler& scheduler);
  // When the run stops early (`why`: "SIGTERM", "not finite at step 7"): saves the state of step
  // `step` and commits it before returning, marked as last words; returns its directory, or nullopt
  // when the run saves no checkpoints.
  //  - kAfterStep: after optimizer step `step`, instead of save_if_due.
  //  - kBeforeNextStep: during step `step` + 1, before its optimizer step (a step that is not
  //    finite): the parameters and optimizer still hold step `step`'s state, and the mesh's RNG
  //    position is the one noted at the step's start (its forward's draws are not step `step`'s).
  //    Nullopt also when step `step` is saved already (0, or a checkpoint interval).
  enum class LastWordsOf { kAfterStep, kBeforeNextStep };
  std::optional<std::string> save_last_words(int64_t step, const LRScheduler& scheduler, const std::string& why,
                                             LastWordsOf when);
  // After an error that ends the run (every rank calls it, once the ranks agreed through the store
  // on `step`, the step all of them hold whole, docs/resilience.md#last-words): commits the save in
  // flight if every rank's part of it succeeds, then, unless step `step`'s checkpoint is committed
  // by now, saves the state of `step`, whose mesh RNG position is `rng`, as last words marked `why`,
  // and commits it. Returns the directory of step `step`'s checkpoint, or nullopt when the run
  // saves no checkpoints or `step` is 0. Needs the store only, not the world's collectives.
  std::optional<std::string> save_after_error(int64_t step, const MeshRngState& rng, const LRScheduler& scheduler,
                                              const std::string& why);
  // After optimizer step `step`: the state of that step packed into one byte tensor, as an in-memory
  // checkpoint keeps it (memory_checkpointing.h); the values are a checkpoint's.
  at::Tensor pack(int64_t step, const LRScheduler& scheduler);
  // Sets the live state, the scheduler and the mesh's RNG to a packed state of this rank (an
  // in-memory checkpoint); returns its step.
  int64_t restore_packed(const at::Tensor& packed, LRScheduler& scheduler);
  // At the start of each step: where the mesh's RNG stands, for last words before the next step.
  void note_step_start();
  const MeshRngState& step_start_rng() const { return step_start_rng_; }  // as of note_step_start()
  // Commits the save in flight, if any.
  void finish();
  // Whether a save is in flight (staged or written in the background, not yet committed).
  bool save_pending() const { return pending_.pending(); }

 private:
  // Starts saving the state of `step` with `marks` added to its values; returns its directory.
  std::string start_save(int64_t step, const LRScheduler& scheduler, const nlohmann::json& marks);
  dcp::StateDict to_save() const;
  // Sets state_'s values to a checkpoint's for the state after step `step` (the optimizer's step
  // counts refreshed).
  void set_values(int64_t step, const LRScheduler& scheduler);
  // After loading state_: the optimizer's step counts, the scheduler and the mesh's RNG; returns the step.
  int64_t restore_loaded(LRScheduler& scheduler);
  nlohmann::json mesh_rng_values(const MeshRngState& rng) const;  // the "mesh_rng" value this rank saves
  void restore_mesh_rng();                                        // from the loaded values, if they have this rank's
  const TrainConfig& config_;
  const DeviceMesh& mesh_;
  const models::ModelParts& parts_;
  torch::optim::Optimizer& optimizer_;
  const comm::ProcessGroup& world_;
  dcp::StateDict state_;  // aliases the live model and optimizer tensors
  dcp::AsyncSave pending_;
  int64_t pending_step_ = -1;
  std::string pending_dir_;
  // The last checkpoint committed or resumed from (possibly an interrupted replacement's `.old`).
  int64_t committed_step_ = -1;
  std::string committed_dir_;
  MeshRngState step_start_rng_;
};

}  // namespace hp::train::detail
