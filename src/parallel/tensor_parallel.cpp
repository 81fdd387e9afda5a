// The parallel styles: each places the parameters of one module type and lays out its inputs and
// outputs through forward hooks (hp/parallel/tensor_parallel.h).
#include "hp/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/log.h"
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

// Whether async TP can fuse a layer on `x`: its sequence dim `dim` splits evenly over the mesh.
bool fusable(const DTensor& x, int64_t dim, const DeviceMesh& mesh) { return x.size(dim) % mesh.size() == 0; }

// The Linear `m` on `x`, unfused (a sequence that does not split evenly).
at::Tensor unfused_linear(nn::Module& m, const DTensor& x, const DeviceMesh& mesh, bool output_on_sequence) {
  const auto& linear = dynamic_cast<const nn::Linear&>(m);
  const at::Tensor input = output_on_sequence ? x : x.redistribute(mesh, {Replicate()});
  return at::linear(input, m.param("weight"), linear.has_bias ? m.param("bias") : at::Tensor());
}

// The Linear `m`'s output as a DTensor placed `placed` from this rank's piece `y` of it on `x`,
// its bias added by `add_bias`.
at::Tensor linear_output(nn::Module& m, const at::Tensor& y, const DTensor& x, const DeviceMesh& mesh, Placement placed,
                         AddBias add_bias) {
  const auto& linear = dynamic_cast<const nn::Linear&>(m);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = linear.out_features;
  const at::Tensor out = DTensor::from_local(y, mesh, {placed}, shape);
  return linear.has_bias ? add_bias(out, m.param("bias")) : out;
}

// A Colwise layer's bias piece matches the output's features, and every rank has all rows: added
// locally.
at::Tensor add_bias_piece(const at::Tensor& out, const at::Tensor& bias) {
  const DTensor o(out);
  return DTensor::from_local(o.to_local() + DTensor(bias).to_local(), o.device_mesh(), o.placements(), o.sizes().vec());
}

void fuse_linear(nn::Module& module, const DeviceMesh& mesh, Placement seq, bool output_on_sequence, FusedLinear fused,
                 AddBias add_bias) {
  module.set_forward_override(
      [mesh, seq, output_on_sequence, fused, add_bias](nn::Module& m, const nn::Inputs& in) -> at::Tensor {
        const DTensor x(in.at(0));
        const int64_t dim = normalized(seq, x.dim()).dim();
        if (!fusable(x, dim, mesh)) return unfused_linear(m, x, mesh, output_on_sequence);
        const at::Tensor y = fused(mesh.get_group(0), x.to_local(), DTensor(m.param("weight")).to_local(), dim);
        return linear_output(m, y, x, mesh, output_on_sequence ? Shard(dim) : Shard(x.dim() - 1), add_bias);
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
  if (async_tp_)
    fuse_linear(module, mesh, input_layout_, /*output_on_sequence=*/false, &parallel::all_gather_linear,
                &add_bias_piece);
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

// ---- ShareInputGather ---------------------------------------------------------------------------

namespace {

// Whether `w` is a Colwise Linear weight on `mesh`: a DTensor split by rows.
bool is_colwise_piece(const at::Tensor& w, const DeviceMesh& mesh) {
  return is_dtensor(w) && DTensor(w).device_mesh() == mesh && DTensor(w).placements() == Placements{Shard(0)};
}

// The layers of one ShareInputGather (the module's children, which hold this through their
// overrides), and their outputs on the input last gathered that they have not taken yet: kept
// within one call of the module that holds them (its hooks clear them before and after).
struct SharedGather {
  SharedGather(std::string where, DeviceMesh mesh, Placement seq)
      : where(std::move(where)), mesh(std::move(mesh)), seq(seq) {}
  std::string where;
  DeviceMesh mesh;
  Placement seq;
  std::vector<nn::Module*> layers;
  std::vector<std::string> names;
  at::Tensor input;  // what `pending` was computed on (held, so that no other tensor takes its place)
  int64_t input_version = -1;
  std::vector<at::Tensor> pending;  // by layer; undefined once taken
  bool warned = false;              // that layers were called on other tensors
  bool in_call = false;             // a call of the module that holds the layers is running

  void clear() {
    input.reset();
    for (at::Tensor& t : pending) t.reset();
  }
  void begin_call() {
    clear();
    in_call = true;
  }
  void end_call() {
    clear();
    in_call = false;
  }

  at::Tensor output_of(size_t layer, nn::Module& m, const at::Tensor& in) {
    const DTensor x(in);
    const int64_t dim = normalized(seq, x.dim()).dim();
    if (!fusable(x, dim, mesh)) return unfused_linear(m, x, mesh, /*output_on_sequence=*/false);
    // Called outside a call of the module (on its own, or recomputed by a checkpoint around it
    // alone, which also hands it a fresh input in forward): its own fused gather, nothing kept.
    if (!in_call || m.has_call_wrapper()) {
      const at::Tensor y =
          parallel::all_gather_linear(mesh.get_group(0), x.to_local(), colwise_piece(layer, layer), dim);
      return linear_output(m, y, x, mesh, Shard(x.dim() - 1), &add_bias_piece);
    }
    const bool ready = input.defined() && input.unsafeGetTensorImpl() == in.unsafeGetTensorImpl() &&
                       input_version == in._version() && pending[layer].defined();
    if (!ready) compute_all(x, in, dim, layer);
    at::Tensor out = std::move(pending[layer]);
    pending[layer] = at::Tensor();
    if (!any_pending()) input.reset();
    return out;
  }

 private:
  bool any_pending() const {
    return std::any_of(pending.begin(), pending.end(), [](const at::Tensor& t) { return t.defined(); });
  }

  // Layer `i`'s local weight piece when layer `caller` is called.
  at::Tensor colwise_piece(size_t i, size_t caller) const {
    const at::Tensor& w = layers[i]->param("weight");
    // An FSDP unit of one layer alone leaves the others' weights sharded when the first is called.
    HP_CHECK(is_colwise_piece(w, mesh), where, ": '", names[i], "'s weight is not the Colwise piece on ", mesh.str(),
             " when '", names[caller],
             "' is called (an FSDP unit around one of the layers alone?); shard them in one unit");
    return DTensor(w).to_local();
  }

  // Every layer's output on `x` (the tensor `in`), asked for by layer `caller`.
  void compute_all(const DTensor& x, const at::Tensor& in, int64_t dim, size_t caller) {
    if (any_pending() && !warned) {
      warned = true;
      log::warn(where, ": '", names[caller], "' was called on another tensor than the layers before it (or ",
                "again, or on an input changed in place), so the outputs computed for them go unused and it gathers ",
                "again; pass every layer the same tensor once (a plain tensor is made a DTensor anew by each layer: ",
                "lay it out once, e.g. as a SequenceParallel norm's output)");
    }
    std::vector<at::Tensor> ws;
    for (size_t i = 0; i < layers.size(); ++i) ws.push_back(colwise_piece(i, caller));
    const std::vector<at::Tensor> ys = parallel::all_gather_linears(mesh.get_group(0), x.to_local(), ws, dim);
    for (size_t i = 0; i < layers.size(); ++i)
      pending[i] = linear_output(*layers[i], ys[i], x, mesh, Shard(x.dim() - 1), &add_bias_piece);
    input = in;
    input_version = in._version();
  }
};

// `name`, a layer under `module`, or nullptr.
nn::Module* layer_named(nn::Module& module, const std::string& name) {
  for (auto& [fqn, found] : nn::match_modules(module, name))
    if (fqn == name) return found;
  return nullptr;
}

}  // namespace

void ShareInputGather::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  check_one_dim(*this, fqn, mesh);
  HP_CHECK(layers_.size() >= 2, where(*this, fqn), ": it shares one gather between at least two layers, got ",
           layers_.size());
  HP_CHECK(seq_.is_shard() && seq_.dim() != -1, where(*this, fqn),
           ": the layers' input must be sharded on the sequence dim (e.g. Shard(1)), got ", seq_.str());
  for (const std::string& name : layers_) {
    const nn::Module* layer = layer_named(module, name);
    HP_CHECK(layer != nullptr, where(*this, fqn), ": '", name, "' is not a layer under it");
    HP_CHECK(dynamic_cast<const nn::Linear*>(layer) != nullptr, where(*this, fqn), ": '", name, "' is a ",
             layer->name(), " module; it shares the gather of Linear layers");
  }
}

void ShareInputGather::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  auto shared = std::make_shared<SharedGather>(where(*this, fqn), mesh, seq_);
  shared->names = layers_;
  for (const std::string& name : layers_) {
    nn::Module* layer = layer_named(module, name);
    const at::Tensor& w = layer->param("weight");
    const bool colwise_async = is_colwise_piece(w, mesh) && layer->has_forward_override();
    HP_CHECK(colwise_async, where(*this, fqn), ": apply ColwiseParallel().set_input_layouts(", seq_.str(),
             ").set_async_tp(true) to '", name, "' on the same mesh first (earlier in the plan)");
    shared->layers.push_back(layer);
  }
  shared->pending.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i)
    shared->layers[i]->replace_forward_override(
        [shared, i](nn::Module& m, const nn::Inputs& in) { return shared->output_of(i, m, in.at(0)); });
  // What one call leaves (a layer it did not call, a failure halfway) goes before the next: no
  // output outlives the call, or reaches another input, weights or grad mode.
  module.register_forward_pre_hook([shared](nn::Module&, nn::Inputs&) { shared->begin_call(); });
  module.register_forward_hook([shared](nn::Module&, const nn::Inputs&, at::Tensor&) { shared->end_call(); });
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
