// hp::dcp: distributed checkpoints that any layout can load.
//
// A checkpoint is a directory:
//   metadata.json             per tensor: global shape, dtype, and every chunk (global offsets and
//                             sizes, file, byte offset, XXH64 checksum of each block); plus `values`
//   rank-00000.safetensors    each rank's chunks, one safetensors file per rank that holds any
// Each rank writes the pieces it holds; a piece replicated over mesh dims is written once (by the
// rank at coordinate 0 of those dims); a plain tensor is written by the lowest rank that has it.
// Loading reads, for each tensor of the target state dict, exactly the chunks that overlap this
// rank's piece, whatever mesh, world size or placements saved them (resharding on load), and checks
// every block it reads.
//
// Saving is atomic: files go to `<dir>.tmp`, which is renamed to `<dir>` only after every rank has
// written and synced; an interrupted save leaves the previous checkpoints untouched. See
// docs/checkpoint.md for the format.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "hp/comm/process_group.h"

namespace hp::dcp {

// What a checkpoint holds. `tensors` are DTensors or plain tensors (plain = the same on every rank
// that has it; ranks may hold different ones, e.g. pipeline stages their own buffers);
// load() copies into them in place. `values` carries everything else (step, data position, RNG
// seeds, scheduler state) as JSON; every rank's values are saved, merged key by key (rank 0's win
// where ranks disagree; keys only some ranks have, e.g. a pipeline stage's, are kept), and load()
// replaces `values` with the merged object.
struct StateDict {
  std::map<std::string, at::Tensor> tensors;
  nlohmann::json values = nlohmann::json::object();
};

struct SaveOptions {
  // CPU memory an async save may hold in staged copies at once; staging waits for the writer when
  // it is full (a single larger tensor is staged alone).
  size_t max_staging_bytes = size_t{256} << 20;
  // Copy the tensors before save_async returns, so the caller may change them at once. false: write
  // straight from the tensors (no copy); they must not change until wait(). save() uses false.
  bool stage_copies = true;
  // With stage_copies: make the copies on a background thread, so save_async returns at once and
  // the copies overlap the caller's next work (a training step's forward and backward). The
  // caller must then call AsyncSave::wait_staged() before changing any of the tensors (before
  // the optimizer step). A tensor changed earlier fails the save (seen by its version counter);
  // nothing torn is ever committed.
  bool stage_in_background = false;
  // Granularity of checksums (and so of the smallest read a load does).
  size_t checksum_block_bytes = size_t{1} << 20;
  // After the commit, write the checkpoint's directory name into `<parent>/latest` (atomically).
  bool update_latest = false;
};

// A save in flight: the tensors are copied (or being copied, with stage_in_background) and a
// background thread writes them. wait() is
// collective (every rank of the save's group calls it): it finishes the files, checks that every rank
// succeeded and commits. Dropping an AsyncSave without wait() abandons the save: nothing is
// committed, even when every file is written (rank 0 commits only in its wait()); the next save to
// the same directory clears the leftovers.
class AsyncSave {
 public:
  AsyncSave() = default;
  AsyncSave(AsyncSave&&) noexcept = default;
  AsyncSave& operator=(AsyncSave&&) noexcept;
  ~AsyncSave();
  // Returns once the tensors are staged (at once unless stage_in_background); after it the caller
  // may change them. Never throws: a failure surfaces from wait(). Not collective.
  void wait_staged();
  void wait();
  bool pending() const { return state_ != nullptr; }

  struct State;  // defined in src/dcp/save.cpp

 private:
  explicit AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void abandon() noexcept;  // stops the writer; nothing is committed
  friend AsyncSave save_async(const StateDict&, const std::string&, const comm::ProcessGroup&, SaveOptions);
  std::shared_ptr<State> state_;
};

// Collective over `group` (every rank that holds any tensor of the state dict). Returns once the
// state dict's tensors are staged, so the caller may change them right away; with
// stage_in_background, at once (see SaveOptions).
AsyncSave save_async(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group,
                     SaveOptions options = {});
// save_async(...).wait().
void save(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group, SaveOptions options = {});

// Not collective. Fills every tensor of `state` from the checkpoint in `dir` (each at its own layout)
// and replaces `state.values`. Errors name the directory, the tensor and, for damaged data, the file.
// Tensors the checkpoint has but `state` lacks are ignored.
void load(StateDict& state, const std::string& dir);

// Every tensor of the checkpoint in `dir`, whole, as plain tensors, with its values (one process;
// for tools and tests).
StateDict load_whole(const std::string& dir);

// The checkpoint `<root>/<name in root/latest>` (or its previous version `<name>.old` when a save
// replacing it was interrupted); nullopt without root/latest. Throws when `latest` names a checkpoint
// that is gone, instead of letting a resume silently start over.
std::optional<std::string> latest_checkpoint(const std::string& root);

struct VerifyReport {
  int64_t tensors = 0, chunks = 0, bytes = 0;
};
// Reads every chunk of the checkpoint and checks its checksums; throws naming the first damage.
VerifyReport verify(const std::string& dir);

}  // namespace hp::dcp
