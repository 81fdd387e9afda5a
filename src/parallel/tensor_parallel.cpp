// The parallel styles: each places the parameters of one module type and lays out its inputs and
// outputs through forward hooks (hp/parallel/tensor_parallel.h).
#include "hp/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "hp/nn/layers.h"
#include "parallel/async_tp.h"
#include "parallel/layout.h"

namespace hp {
namespace {

using parallel::as_dtensor;
using parallel::check_divisible;
using parallel::distribute_parameter;
using parallel::lay_out;
using parallel::normalized;

std::string where(const ParallelStyleBase& style, const std::string& fqn) { return style.name() + " on '" + fqn + "'"; }

void check_one_dim(const ParallelStyleBase& style, const std::string& fqn, const DeviceMesh& mesh) {
  HP_CHECK(mesh.ndim() == 1, where(style, fqn), ": tensor-parallel styles take a 1-D mesh, got ", mesh.str(),
           "; slice it, e.g. mesh[\"tp\"]");
}

[[noreturn]] void unsupported(const ParallelStyleBase& style, const std::string& fqn, const nn::Module& module,
                              const char* supported) {
  HP_FAIL(where(style, fqn), ": cannot apply to a ", module.name(), " module; it supports ", supported);
}

// Colwise and Rowwise split one dim of a Linear's or an Embedding's weight ([out, in] and
// [num_embeddings, embedding_dim]); the mesh size must divide it.
void check_weight_split(const ParallelStyleBase& style, nn::Module& module, const std::string& fqn,
                        const DeviceMesh& mesh, int64_t linear_dim, int64_t embedding_dim) {
  check_one_dim(style, fqn, mesh);
  static const char* const kLinearDims[] = {"out_features", "in_features"};
  static const char* const kEmbeddingDims[] = {"num_embeddings", "embedding_dim"};
  const bool linear = dynamic_cast<nn::Linear*>(&module) != nullptr;
  if (!linear && dynamic_cast<nn::Embedding*>(&module) == nullptr)
    unsupported(style, fqn, module, "Linear and Embedding");
  const int64_t dim = linear ? linear_dim : embedding_dim;
  check_divisible(
      fqn + ".weight dim " + std::to_string(dim) + " (" + (linear ? kLinearDims : kEmbeddingDims)[dim] + ")",
      module.param("weight").size(dim), mesh.size(), where(style, fqn));
}

// Pre-hook: input 0 read as `layout`, redistributed to `desired` (kept a DTensor). `features`:
// the input's global last dim when the module knows it (a Linear's in_features).
void lay_out_input(nn::Module& module, const DeviceMesh& mesh, Placement layout, Placement desired, std::string w,
                   comm::WireFormat wire, std::optional<int64_t> features = std::nullopt) {
  module.register_forward_pre_hook([mesh, layout, desired, w, wire, features](nn::Module&, nn::Inputs& in) {
    in.at(0) = lay_out(as_dtensor(in.at(0), mesh, {layout}, w, features), {desired}, /*use_local=*/false, wire);
  });
}

// Post-hook: the output redistributed to `desired`, local if asked.
void lay_out_output(nn::Module& module, Placement desired, bool use_local, comm::WireFormat wire) {
  module.register_forward_hook([desired, use_local, wire](nn::Module&, const nn::Inputs&, at::Tensor& out) {
    out = lay_out(out, {desired}, use_local, wire);
  });
}

// set_async_tp's conditions: a Linear whose `side` ("input" or "output") is sharded on a sequence
// dim (`seq`), with native reductions.
void check_async_tp(const ParallelStyleBase& style, nn::Module& module, const std::string& fqn, Placement seq,
                    const char* side, comm::WireFormat wire) {
  HP_CHECK(dynamic_cast<nn::Linear*>(&module) != nullptr, where(style, fqn),
           ": set_async_tp fuses a Linear's matmul with its communication; this is a ", module.name(), " module");
  HP_CHECK(seq.is_shard() && seq.dim() != -1, where(style, fqn), ": set_async_tp needs the ", side,
           " sharded on the sequence dim (e.g. Shard(1)), got ", seq.str());
  HP_CHECK(wire == comm::WireFormat::kNative, where(style, fqn),
           ": set_async_tp is not combined with set_reduce_wire (the fused reductions add in the data's own dtype)");
}

// Async TP replaces the Linear's forward: the DTensor input x (laid out by the pre-hook) and the
// local weight go through `fused(group, x's piece, weight's piece, sequence dim)`, whose result is
// this rank's piece of the output, sharded on the sequence dim (output_on_sequence) or on the last;
// `add_bias` adds the bias to it. A sequence that does not split evenly (a prompt being generated)
// goes through the unfused layer.
using FusedLinear = at::Tensor (*)(const comm::ProcessGroup&, const at::Tensor&, const at::Tensor&, int64_t);
using AddBias = at::Tensor (*)(const at::Tensor& out, const at::Tensor& bias);

void fuse_linear(nn::Module& module, const DeviceMesh& mesh, Placement seq, bool output_on_sequence, FusedLinear fused,
                 AddBias add_bias) {
  const auto& linear = dynamic_cast<const nn::Linear&>(module);
  module.set_forward_override([mesh, seq, output_on_sequence, fused, add_bias, out_features = linear.out_features,
                               has_bias = linear.has_bias](nn::Module& m, const nn::Inputs& in) -> at::Tensor {
    const DTensor x(in.at(0));
    const int64_t dim = normalized(seq, x.dim()).dim();
    if (x.size(dim) % mesh.size() != 0) {
      const at::Tensor input = output_on_sequence ? x : x.redistribute(mesh, {Replicate()});
      return at::linear(input, m.param("weight"), has_bias ? m.param("bias") : at::Tensor());
    }
    const at::Tensor y = fused(mesh.get_group(0), x.to_local(), DTensor(m.param("weight")).to_local(), dim);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    const Placement placed = output_on_sequence ? Shard(dim) : Shard(x.dim() - 1);
    const at::Tensor out = DTensor::from_local(y, mesh, {placed}, shape);
    return has_bias ? add_bias(out, m.param("bias")) : out;
  });
}

}  // namespace

// ---- ColwiseParallel ----------------------------------------------------------------------------

void ColwiseParallel::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  check_weight_split(*this, module, fqn, mesh, /*linear_dim=*/0, /*embedding_dim=*/1);
  if (async_tp_) check_async_tp(*this, module, fqn, input_layout_, "input", wire_);
}

void ColwiseParallel::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  const auto* linear = dynamic_cast<nn::Linear*>(&module);
  if (linear) {
    distribute_parameter(module, "weight", mesh, {Shard(0)}, fqn);
    if (linear->has_bias) distribute_parameter(module, "bias", mesh, {Shard(0)}, fqn);
  } else {
    distribute_parameter(module, "weight", mesh, {Shard(1)}, fqn);
  }
  // Async TP keeps the input sharded on the sequence: the fused forward gathers it.
  lay_out_input(module, mesh, input_layout_, async_tp_ ? input_layout_ : Replicate(), where(*this, fqn), wire_,
                linear ? std::optional<int64_t>(linear->in_features) : std::nullopt);
  if (async_tp_) {
    // The bias piece matches the output's features, and every rank has all rows: added locally.
    const AddBias add_local = [](const at::Tensor& out, const at::Tensor& bias) -> at::Tensor {
      const DTensor o(out);
      return DTensor::from_local(o.to_local() + DTensor(bias).to_local(), o.device_mesh(), o.placements(),
                                 o.sizes().vec());
    };
    fuse_linear(module, mesh, input_layout_, /*output_on_sequence=*/false, &parallel::all_gather_linear, add_local);
  }
  lay_out_output(module, output_layout_, use_local_output_, comm::WireFormat::kNative);  // no reduction
}

// ---- RowwiseParallel ----------------------------------------------------------------------------

void RowwiseParallel::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  check_weight_split(*this, module, fqn, mesh, /*linear_dim=*/1, /*embedding_dim=*/0);
  if (async_tp_) check_async_tp(*this, module, fqn, output_layout_, "output", wire_);
}

void RowwiseParallel::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  if (auto* linear = dynamic_cast<nn::Linear*>(&module)) {
    distribute_parameter(module, "weight", mesh, {Shard(1)}, fqn);
    if (linear->has_bias) distribute_parameter(module, "bias", mesh, {Replicate()}, fqn);
    lay_out_input(module, mesh, input_layout_.value_or(Shard(-1)), Shard(-1), where(*this, fqn),
                  comm::WireFormat::kNative, linear->in_features);
    if (async_tp_) {
      // A replicated bias on sequence-sharded rows: a DTensor add, whose gradient comes out Partial
      // and is reduced by the parameter's hook.
      const AddBias add_replicated = [](const at::Tensor& out, const at::Tensor& bias) -> at::Tensor {
        return out + bias;
      };
      fuse_linear(module, mesh, output_layout_, /*output_on_sequence=*/true, &parallel::linear_reduce_scatter,
                  add_replicated);
    }
  } else {
    distribute_parameter(module, "weight", mesh, {Shard(0)}, fqn);
    lay_out_input(module, mesh, input_layout_.value_or(Replicate()), Replicate(), where(*this, fqn),
                  comm::WireFormat::kNative);
  }
  lay_out_output(module, output_layout_, use_local_output_, wire_);
}

// ---- SequenceParallel ---------------------------------------------------------------------------

void SequenceParallel::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  check_one_dim(*this, fqn, mesh);
  const bool supported = dynamic_cast<nn::RMSNorm*>(&module) || dynamic_cast<nn::LayerNorm*>(&module) ||
                         dynamic_cast<nn::Dropout*>(&module);
  if (!supported) unsupported(*this, fqn, module, "RMSNorm, LayerNorm and Dropout");
}

void SequenceParallel::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  for (const auto& item : module.named_parameters(/*recurse=*/false))
    distribute_parameter(module, item.key(), mesh, {Replicate()}, fqn);
  const Placement seq = Shard(sequence_dim_);
  lay_out_input(module, mesh, seq, seq, where(*this, fqn), comm::WireFormat::kNative);
  lay_out_output(module, seq, use_local_output_, comm::WireFormat::kNative);
}

// ---- PrepareModuleInput / PrepareModuleOutput ---------------------------------------------------

PrepareModuleInput::PrepareModuleInput(std::vector<std::optional<Placement>> input_layouts,
                                       std::vector<std::optional<Placement>> desired_input_layouts,
                                       bool use_local_output)
    : input_layouts_(std::move(input_layouts)),
      desired_(std::move(desired_input_layouts)),
      use_local_output_(use_local_output) {
  HP_CHECK(input_layouts_.size() == desired_.size(), "PrepareModuleInput: ", input_layouts_.size(),
           " input_layouts but ", desired_.size(), " desired_input_layouts; give one of each per input");
  for (size_t i = 0; i < desired_.size(); ++i)
    HP_CHECK(input_layouts_[i].has_value() == desired_[i].has_value(), "PrepareModuleInput: input ", i,
             " has a layout but no desired layout or the other way round");
}

void PrepareModuleInput::check(nn::Module&, const std::string& fqn, const DeviceMesh& mesh) const {
  check_one_dim(*this, fqn, mesh);
}

void PrepareModuleInput::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  module.register_forward_pre_hook([mesh, layouts = input_layouts_, desired = desired_, local = use_local_output_,
                                    wire = wire_, w = where(*this, fqn)](nn::Module&, nn::Inputs& in) {
    HP_CHECK(in.size() == layouts.size(), w, ": the plan describes ", layouts.size(), " inputs but the module got ",
             in.size());
    for (size_t i = 0; i < in.size(); ++i)
      if (layouts[i]) in[i] = lay_out(as_dtensor(in[i], mesh, {*layouts[i]}, w), {*desired[i]}, local, wire);
  });
}

void PrepareModuleOutput::check(nn::Module&, const std::string& fqn, const DeviceMesh& mesh) const {
  check_one_dim(*this, fqn, mesh);
}

void PrepareModuleOutput::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  module.register_forward_hook([mesh, layout = layout_, desired = desired_, local = use_local_output_, wire = wire_,
                                w = where(*this, fqn)](nn::Module&, const nn::Inputs&, at::Tensor& out) {
    out = lay_out(as_dtensor(out, mesh, {layout}, w), {desired}, local, wire);
  });
}

// ---- parallelize_module -------------------------------------------------------------------------

void parallelize_module(nn::Module& model, const DeviceMesh& mesh, const ParallelizePlan& plan) {
  std::vector<std::vector<std::pair<std::string, nn::Module*>>> targets;
  for (const auto& [pattern, style] : plan) {
    auto matched = nn::match_modules(model, pattern);
    HP_CHECK(!matched.empty(), "parallelize_module: the pattern '", pattern, "' (", style->name(),
             ") matches no module of the model");
    for (auto& [fqn, module] : matched) style->check(*module, fqn, mesh);
    targets.push_back(std::move(matched));
  }
  for (size_t i = 0; i < plan.size(); ++i)
    for (auto& [fqn, module] : targets[i]) plan[i].second->apply(*module, fqn, mesh);
}

}  // namespace hp
