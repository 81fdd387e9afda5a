// Hugging Face safetensors export and import.
//
//   hp::dcp::save_hf(hp::dcp::model_state_dict(model, ""), "out/", world, hp::models::llama_to_hf_name);
//   hp::dcp::load_hf(state, "hf_model/", hp::models::llama_to_hf_name);   // straight into a sharded model
//
// The export is `model.safetensors`, or shards `model-00001-of-0000N.safetensors` with
// `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {name: file}}) when
// the tensors exceed `max_shard_bytes`. The import reads either form and, for each tensor of the
// target state dict, only the bytes of this rank's piece.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/dcp/checkpoint.h"

namespace hp::dcp {

// Where one of our tensors is in the Hugging Face files: one tensor of the same shape, or, for a
// tensor whose dim 0 stacks several (a MoE layer's experts: ours [E, F, D], theirs E tensors
// [F, D]), those tensors in order. No names: not exported.
struct HfName {
  HfName() = default;
  HfName(std::string name);  // NOLINT(google-explicit-constructor): a map may return a plain name
  HfName(const char* name) : HfName(std::string(name)) {}  // NOLINT(google-explicit-constructor)
  // One name, or with `stacks` one per piece of dim 0 (each non-empty).
  HfName(std::vector<std::string> names, bool stacks);
  static HfName stacked(std::vector<std::string> names) { return HfName(std::move(names), true); }
  std::vector<std::string> names;
  bool stacks = false;
  // Our own state that other tools' files lack (a MoE router's expert bias): load_hf leaves the
  // tensor as it is when the files do not have it.
  bool optional = false;
};

// Our tensor name -> where it is in the Hugging Face files.
using NameMap = std::function<HfName(const std::string&)>;

struct HfSaveOptions {
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  // Files rank 0 writes beside the tensors, each atomically: (file name, contents), e.g.
  // config.json and generation_config.json (hp/models/hf_config.h makes both).
  std::vector<std::pair<std::string, std::string>> files;
};

// Collective over `group`: gathers each tensor whole in turn (every rank runs the same gathers) and
// rank 0 writes the files, each through a temporary name and a rename. A stacked tensor is written
// as its pieces along dim 0, each under its name, all in one file.
void save_hf(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group, const NameMap& to_hf,
             HfSaveOptions options = {});

// Not collective. Fills every tensor of `state`; a tensor the files lack is an error naming it
// (unless its name is optional: then it is left as it is). A
// stacked tensor reads, from each of its pieces, only the part in this rank's piece of it (an
// expert-parallel rank reads only its experts).
// Floating-point tensors convert to the target's dtype (a bf16 file into an fp32 model: each value
// exactly; fp32 into bf16: rounded to nearest even).
void load_hf(StateDict& state, const std::string& dir, const NameMap& to_hf);

// Every tensor of the HF files in `dir`, whole, by its HF name (for tools and tests).
StateDict load_hf_whole(const std::string& dir);

}  // namespace hp::dcp
