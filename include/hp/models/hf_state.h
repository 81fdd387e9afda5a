// Our model tensors as Hugging Face tensors and back, whole (for hp-ckpt and tests): the names of
// Llama / Qwen3 (LlamaForCausalLM, Qwen3ForCausalLM; hp/models/llama/hf_names.h) and of Qwen3-MoE
// (Qwen3MoeForCausalLM), whose per-expert weights our models stack:
//
//   layers.N.mlp.router.gate.weight   [E, D]     <-> model.layers.N.mlp.gate.weight
//   layers.N.mlp.router.expert_bias   [E]        <-> model.layers.N.mlp.gate.e_score_correction_bias
//   layers.N.mlp.experts.w1           [E, F, D]  <-> model.layers.N.mlp.experts.{0..E-1}.gate_proj.weight [F, D]
//   layers.N.mlp.experts.w3           [E, F, D]  <-> model.layers.N.mlp.experts.{0..E-1}.up_proj.weight   [F, D]
//   layers.N.mlp.experts.w2           [E, D, F]  <-> model.layers.N.mlp.experts.{0..E-1}.down_proj.weight [D, F]
//
// The expert bias (auxiliary-loss-free balancing) has no place in Qwen3-MoE's own files: it is
// exported under DeepSeek-V3's name, which Qwen3MoeForCausalLM ignores, so a round trip keeps it.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

namespace hp::models {

using NamedTensors = std::map<std::string, at::Tensor>;

// Where our tensor `name` of shape `shape` is in Hugging Face files: its name there, or for a
// stacked expert weight, one name per expert in expert order (`stacked`: our dim 0 stacks them).
// Throws hp::Error for a tensor with no Hugging Face name.
struct HfPlace {
  std::vector<std::string> names;
  bool stacked = false;
  // Training state of ours that Hugging Face's own files lack (the expert bias): a load from files
  // without it keeps ours.
  bool optional = false;
};
HfPlace hf_place(const std::string& name, at::IntArrayRef shape);

// `ours`: whole plain tensors by model FQN ("layers.0.attn.q_proj.weight"). Throws hp::Error
// naming a tensor that has no Hugging Face name.
NamedTensors to_hf_tensors(const NamedTensors& ours);

// The inverse: stacks each layer's experts 0..E-1 (all of them, with equal shapes, or an error).
NamedTensors from_hf_tensors(const NamedTensors& hf);

}  // namespace hp::models
