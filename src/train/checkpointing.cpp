#include "train/checkpointing.h"

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/job.h"
#include "hp/core/log.h"
#include "hp/dcp/state_dict.h"
#include "hp/dtensor/random.h"
#include "train/memory_checkpointing.h"

namespace hp::train::detail {
namespace {
namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  std::ostringstream out;
  out << "step-" << std::setw(6) << std::setfill('0') << step;
  return out.str();
}

// Keeps the `keep` newest step-* checkpoints up to `committed` (rank 0, after committing it). Those
// of later steps are an earlier run's: they are left alone, since counting them would delete the
// one just committed, which `latest` names.
void prune_checkpoints(const std::string& root, int64_t keep, int64_t committed) {
  std::vector<std::pair<int64_t, fs::path>> dirs;  // by step number: names outgrow their zero padding
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 && name.size() > 5 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos && std::stoll(name.substr(5)) <= committed)
      dirs.emplace_back(std::stoll(name.substr(5)), e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (size_t i = 0; i + keep < dirs.size(); ++i) fs::remove_all(dirs[i].second);
}

}  // namespace

Checkpointing::Checkpointing(const TrainConfig& config, const DeviceMesh& mesh, const models::ModelParts& parts,
                             torch::optim::Optimizer& optimizer, const comm::ProcessGroup& world)
    : config_(config), mesh_(mesh), parts_(parts), optimizer_(optimizer), world_(world) {
  for (auto& [fqn, tensor] : parts.named_tensors()) state_.tensors["model." + fqn] = tensor;
  dcp::add_optimizer_state(state_, optimizer_, *parts.model);
}

int64_t Checkpointing::resume(LRScheduler& scheduler, bool only_this_job) {
  const auto latest = dcp::latest_checkpoint(config_.checkpoint_dir());
  if (!latest) return 0;
  dcp::StateDict values_only;
  dcp::load(values_only, *latest);
  if (only_this_job) {
    const auto saved = values_only.values.find("job");
    const std::string job = saved == values_only.values.end() ? "" : saved->get<std::string>();
    if (job.empty() || job != job::dir().value_or("")) {
      if (world_.rank() == 0)
        log::info("not resuming from ", *latest, ": an earlier run saved it, not this job; starting from step 0");
      return 0;
    }
  }
  // The run's random draws (the data order, dropout masks) are functions of (seed, step): the
  // checkpoint's step continues its run only under its seed. Checked before anything is loaded.
  if (const auto saved = values_only.values.find("seed"); saved != values_only.values.end())
    HP_CHECK(saved->get<uint64_t>() == config_.seed, "resume: ", *latest, " was trained with seed ",
             saved->get<uint64_t>(), " but the config says seed ", config_.seed,
             "; the data order and dropout masks depend on it, so the run would not continue as it was. Resume "
             "with seed: ",
             saved->get<uint64_t>(), ", or start a new run (another run_dir)");
  dcp::load(state_, *latest);
  const int64_t step = restore_loaded(scheduler);
  if (world_.rank() == 0) log::info("resumed from ", *latest, " at step ", step);
  committed_step_ = step, committed_dir_ = *latest;
  return step;
}

int64_t Checkpointing::restore_loaded(LRScheduler& scheduler) {
  dcp::restore_optimizer_values(state_, optimizer_, *parts_.model);
  const int64_t step = state_.values.at("step").get<int64_t>();
  scheduler.set_step(step);
  restore_mesh_rng();
  return step;
}

at::Tensor Checkpointing::pack(int64_t step, const LRScheduler& scheduler) {
  set_values(step, scheduler);
  return pack_state(state_);
}

int64_t Checkpointing::restore_packed(const at::Tensor& packed, LRScheduler& scheduler) {
  unpack_state(packed, state_);
  return restore_loaded(scheduler);
}

void Checkpointing::note_step_start() { step_start_rng_ = get_rng_state(mesh_); }

// Each process counts the draws of its own pipeline stages: every pipeline rank saves its own
// position (ranks of one stage draw alike), and the checkpoint's values merge them.
nlohmann::json Checkpointing::mesh_rng_values(const MeshRngState& rng) const {
  return {{"seed", rng.seed},
          {"pp", config_.parallel.pp},
          {"next_stream_by_pp_rank", {{std::to_string(mesh_.get_local_rank("pp")), rng.next_stream}}}};
}

// Every rank decides alike from the same values: the position is restored when the checkpoint has
// one for this pipeline layout, else the mesh starts again from the seed's first stream.
void Checkpointing::restore_mesh_rng() {
  const std::string pp_rank = std::to_string(mesh_.get_local_rank("pp"));
  const auto rng = state_.values.find("mesh_rng");
  const bool same_layout = rng != state_.values.end() && rng->value("pp", int64_t{0}) == config_.parallel.pp &&
                           rng->contains("next_stream_by_pp_rank") &&
                           rng->at("next_stream_by_pp_rank").contains(pp_rank);
  if (!same_layout) {
    set_rng_state(mesh_, {config_.seed, 0});
    if (world_.rank() == 0)
      log::warn("resume: the checkpoint has no mesh RNG position for this pipeline layout (an older checkpoint, or ",
                "another pp degree); DTensor random ops start again from the seed's first stream");
    return;
  }
  set_rng_state(mesh_,
                {rng->at("seed").get<uint64_t>(), rng->at("next_stream_by_pp_rank").at(pp_rank).get<uint64_t>()});
}

void Checkpointing::commit_earlier_than(int64_t step) {
  if (pending_step_ >= 0 && pending_step_ < step) finish();
}

std::optional<std::string> Checkpointing::save_if_due(int64_t step, const LRScheduler& scheduler) {
  if (config_.checkpoint.interval <= 0 || step % config_.checkpoint.interval != 0) return std::nullopt;
  const std::string dir = start_save(step, scheduler, nlohmann::json::object());
  if (!config_.checkpoint.async) finish();
  return dir;
}

std::optional<std::string> Checkpointing::save_last_words(int64_t step, const LRScheduler& scheduler,
                                                          const std::string& why, LastWordsOf when) {
  if (config_.checkpoint.interval <= 0) return std::nullopt;
  nlohmann::json marks{{"last_words", why}};
  if (when == LastWordsOf::kBeforeNextStep) {
    if (step <= 0 || step % config_.checkpoint.interval == 0) return std::nullopt;
    marks["mesh_rng"] = mesh_rng_values(step_start_rng_);
  }
  const std::string dir = start_save(step, scheduler, marks);
  finish();
  return dir;
}

std::optional<std::string> Checkpointing::save_after_error(int64_t step, const MeshRngState& rng,
                                                           const LRScheduler& scheduler, const std::string& why) {
  if (config_.checkpoint.interval <= 0 || step <= 0) return std::nullopt;
  try {
    finish();
  } catch (const std::exception& e) {  // every rank reads the same outcome: nothing was committed
    pending_step_ = -1;
    if (world_.rank() == 0) log::warn("the checkpoint in flight when training failed was not committed: ", e.what());
  }
  if (committed_step_ == step) return committed_dir_;
  const std::string dir = start_save(step, scheduler, {{"last_words", why}, {"mesh_rng", mesh_rng_values(rng)}});
  finish();
  return dir;
}

std::string Checkpointing::start_save(int64_t step, const LRScheduler& scheduler, const nlohmann::json& marks) {
  finish();
  set_values(step, scheduler);
  state_.values.update(marks);
  dcp::SaveOptions options;
  options.update_latest = true;
  options.stage_in_background = true;  // the copies overlap the next step's forward and backward
  const std::string dir = config_.checkpoint_dir() + "/" + step_dir_name(step);
  pending_ = dcp::save_async(to_save(), dir, world_, options);
  pending_step_ = step, pending_dir_ = dir;
  return dir;
}

void Checkpointing::finish() {
  if (!pending_.pending()) return;
  pending_.wait();
  if (world_.rank() == 0) prune_checkpoints(config_.checkpoint_dir(), config_.checkpoint.keep, pending_step_);
  committed_step_ = std::exchange(pending_step_, -1), committed_dir_ = pending_dir_;
}

void Checkpointing::set_values(int64_t step, const LRScheduler& scheduler) {
  state_.values = {{"step", step},
                   {"seed", config_.seed},
                   {"data", {{"sampler", "stateless"}, {"step", step}}},
                   {"scheduler_step", scheduler.last_step()},
                   {"mesh_rng", mesh_rng_values(get_rng_state(mesh_))},
                   {"world_size", world_.size()},
                   {"job", job::dir().value_or("")}};           // a restart of this job resumes only its own saves
  dcp::add_optimizer_state(state_, optimizer_, *parts_.model);  // refreshes the step counts in values
}

// The state without the copies of tied weights: their parameters and optimizer state.
dcp::StateDict Checkpointing::to_save() const {
  if (parts_.copies.empty()) return state_;
  dcp::StateDict out = state_;
  for (const std::string& fqn : parts_.copies) {
    out.tensors.erase("model." + fqn);
    const std::string optimizer_prefix = "optim." + fqn + ".";
    for (auto it = out.tensors.lower_bound(optimizer_prefix);
         it != out.tensors.end() && it->first.rfind(optimizer_prefix, 0) == 0;)
      it = out.tensors.erase(it);
  }
  return out;
}

}  // namespace hp::train::detail
