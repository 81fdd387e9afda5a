// Declarative tensor parallelism (PyTorch's parallelize_module and parallel styles).
//
//   hp::parallelize_module(*model, tp_mesh, {
//       {"layers.*.attn.q_proj", hp::ColwiseParallel()},
//       {"layers.*.attn.o_proj", hp::RowwiseParallel()},
//       {"output", hp::ColwiseParallel().set_output_layouts(hp::Shard(-1)).set_use_local_output(false)},
//   });
//
// A style turns the matched module's parameters into DTensors on the (1-D) mesh and registers
// hooks that lay out its inputs and outputs; the model code is not touched. Plain-tensor inputs are
// read as this rank's piece laid out by `input_layouts`; outputs are redistributed to
// `output_layouts` and, with use_local_output, handed on as local tensors (so the next module,
// e.g. attention that reshapes heads with -1, computes on local shards without DTensor dispatch).
//
// Plans are checked before anything changes: a pattern that matches nothing, a style on a module
// type it does not support, or a sharded dim not divisible by the mesh size is an hp::Error.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/types.h"
#include "hp/dtensor/placement.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/module.h"

namespace hp {

// The styles that reduce have set_reduce_wire(w): it makes the reductions of their layout changes (a Rowwise output's
// all_reduce or reduce_scatter in forward; the reduction of a Colwise or PrepareModuleInput input's
// gradient in backward) carry the format w and add in fp32 (docs/tensor_parallel.md#low-precision-reductions).
// Set it where an input is laid out once: on a Colwise layer whose input is a replicated DTensor
// shared with other layers, it reduces that layer's share of the gradient on its own.
class ParallelStyleBase {
 public:
  virtual ~ParallelStyleBase() = default;
  virtual std::string name() const = 0;
  // Throws hp::Error when the style cannot apply to `module` on `mesh`; changes nothing.
  virtual void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const = 0;
  virtual void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const = 0;
};

// Async tensor parallelism (set_async_tp, on Linear layers with sequence parallelism): a Colwise
// layer whose input arrives sharded on the sequence dim (set_input_layouts(Shard(1))) gathers it
// fused with its matmul, and a Rowwise layer whose output goes out sharded on it
// (set_output_layouts(Shard(1))) reduce-scatters its product fused with the matmul
// (hp/comm/fused_matmul.h: chunk by chunk through symmetric memory where the tp ranks share a host,
// else the unfused collectives), in forward and in backward. Each such Colwise layer gathers its
// own input, unless ShareInputGather makes layers on one input share one gather: leave attention's
// and the MLP's inputs sharded (no PrepareModuleInput to Replicate).
// A sequence that does not split evenly over the mesh (a prompt being generated) runs unfused; not
// combined with set_reduce_wire.
// docs/tensor_parallel.md#async-tensor-parallelism.

// Linear: weight (and bias) Shard(0), i.e. output features split. Embedding: weight Shard(1).
// Defaults: input_layouts Replicate, output_layouts Shard(-1), use_local_output true.
class ColwiseParallel : public ParallelStyleBase {
 public:
  ColwiseParallel& set_input_layouts(Placement p) {
    input_layout_ = p;
    return *this;
  }
  ColwiseParallel& set_output_layouts(Placement p) {
    output_layout_ = p;
    return *this;
  }
  ColwiseParallel& set_use_local_output(bool b) {
    use_local_output_ = b;
    return *this;
  }
  ColwiseParallel& set_reduce_wire(comm::WireFormat w) {
    wire_ = w;
    return *this;
  }
  ColwiseParallel& set_async_tp(bool on) {
    async_tp_ = on;
    return *this;
  }
  std::string name() const override { return "ColwiseParallel"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  Placement input_layout_ = Replicate();
  Placement output_layout_ = Shard(-1);
  bool use_local_output_ = true;
  comm::WireFormat wire_ = comm::WireFormat::kNative;
  bool async_tp_ = false;
};

// Linear: weight Shard(1) (input features split), bias Replicate; the product is Partial and is
// reduced to output_layouts (all_reduce to Replicate, reduce_scatter to Shard). Embedding: weight
// Shard(0) (vocabulary split; rows owned elsewhere contribute zeros to the Partial sum).
// Defaults: input_layouts Shard(-1) for Linear / Replicate for Embedding, output_layouts
// Replicate, use_local_output true.
class RowwiseParallel : public ParallelStyleBase {
 public:
  RowwiseParallel& set_input_layouts(Placement p) {
    input_layout_ = p;
    return *this;
  }
  RowwiseParallel& set_output_layouts(Placement p) {
    output_layout_ = p;
    return *this;
  }
  RowwiseParallel& set_use_local_output(bool b) {
    use_local_output_ = b;
    return *this;
  }
  RowwiseParallel& set_reduce_wire(comm::WireFormat w) {
    wire_ = w;
    return *this;
  }
  RowwiseParallel& set_async_tp(bool on) {
    async_tp_ = on;
    return *this;
  }
  std::string name() const override { return "RowwiseParallel"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  std::optional<Placement> input_layout_;
  Placement output_layout_ = Replicate();
  bool use_local_output_ = true;
  comm::WireFormat wire_ = comm::WireFormat::kNative;
  bool async_tp_ = false;
};

// Async TP for Linear layers that take one input (attention's q/k/v, the MLP's gate/up), on the
// module that holds them, after ColwiseParallel().set_input_layouts(seq).set_async_tp(true) on
// each (earlier in the plan): the input is gathered once for all of them, fused with their matmuls
// (one all_gather_matmul with every weight), and in backward their input gradients are
// reduce-scattered in one fused op and their weight gradients come from one gather of the input:
// 3 ops in all (n layers alone take 3 each). `layers`: the Linear layers' names under the module.
//   {"layers.*.attn", ShareInputGather({"q_proj", "k_proj", "v_proj"}, Shard(1))}
// Within one call of the module, the first layer called computes every layer's output; the others,
// called on the same tensor, take theirs. A layer called on another tensor (or again) computes them
// all again: right, but without the saving, which a warning says once; pass every layer the same
// DTensor (a plain tensor is made a DTensor anew by each layer). A layer called outside a call of
// the module, or checkpointed alone, gathers for itself. A layer whose output gets no gradient gets
// a zero one. The layers' weights must be their Colwise pieces whenever the first is
// called: FSDP units around all of them, not around one alone.
class ShareInputGather : public ParallelStyleBase {
 public:
  ShareInputGather(std::vector<std::string> layers, Placement seq) : layers_(std::move(layers)), seq_(seq) {}
  std::string name() const override { return "ShareInputGather"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  std::vector<std::string> layers_;
  Placement seq_;
};

// For norms (and dropout) between a Rowwise and a Colwise layer: parameters Replicate, the input
// (and output) sharded on the sequence dim. A plain input is this rank's sequence piece; the output
// stays a DTensor (use_local_output false) so the next style can gather it.
class SequenceParallel : public ParallelStyleBase {
 public:
  explicit SequenceParallel(int64_t sequence_dim = 1, bool use_local_output = false)
      : sequence_dim_(sequence_dim), use_local_output_(use_local_output) {}
  std::string name() const override { return "SequenceParallel"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  int64_t sequence_dim_;
  bool use_local_output_;
};

// Lays out a module's inputs: input i (a plain tensor read as a piece laid out by
// input_layouts[i], or a DTensor) is redistributed to desired_input_layouts[i]. nullopt entries
// leave that input alone (PyTorch's None).
class PrepareModuleInput : public ParallelStyleBase {
 public:
  PrepareModuleInput(std::vector<std::optional<Placement>> input_layouts,
                     std::vector<std::optional<Placement>> desired_input_layouts, bool use_local_output = false);
  PrepareModuleInput& set_reduce_wire(comm::WireFormat w) {
    wire_ = w;
    return *this;
  }
  std::string name() const override { return "PrepareModuleInput"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  std::vector<std::optional<Placement>> input_layouts_, desired_;
  bool use_local_output_;
  comm::WireFormat wire_ = comm::WireFormat::kNative;
};

// Lays out a module's output: read as output_layouts (if plain), redistributed to desired.
class PrepareModuleOutput : public ParallelStyleBase {
 public:
  PrepareModuleOutput(Placement output_layouts, Placement desired_output_layouts, bool use_local_output = true)
      : layout_(output_layouts), desired_(desired_output_layouts), use_local_output_(use_local_output) {}
  PrepareModuleOutput& set_reduce_wire(comm::WireFormat w) {
    wire_ = w;
    return *this;
  }
  std::string name() const override { return "PrepareModuleOutput"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  Placement layout_, desired_;
  bool use_local_output_;
  comm::WireFormat wire_ = comm::WireFormat::kNative;
};

// Any style, held by value so plans read as initializer lists.
class ParallelStyle {
 public:
  template <typename S, typename = std::enable_if_t<std::is_base_of_v<ParallelStyleBase, S>>>
  ParallelStyle(S style) : impl_(std::make_shared<S>(std::move(style))) {}  // NOLINT: implicit by design
  const ParallelStyleBase& operator*() const { return *impl_; }
  const ParallelStyleBase* operator->() const { return impl_.get(); }

 private:
  std::shared_ptr<const ParallelStyleBase> impl_;
};

using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

// Applies each (FQN pattern, style) to every module the pattern matches, in plan order, on a 1-D
// mesh. Every entry is checked before any is applied.
void parallelize_module(nn::Module& model, const DeviceMesh& mesh, const ParallelizePlan& plan);

}  // namespace hp
