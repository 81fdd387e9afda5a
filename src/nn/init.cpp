#include "hp/nn/init.h"

#include <ATen/ATen.h>

#include <string>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "hp/dtensor/random.h"
#include "hp/nn/attention.h"
#include "hp/nn/layers.h"

namespace hp::nn {
namespace {

// Parameter k draws from stream k of `seed`. Modules that drop (Dropout, CoreAttention's
// probability dropout) get their own seeds, derived from `seed` and their FQN, so that two dropouts never share masks
// and a module keeps its seed whatever else the model holds.
uint64_t dropout_seed(uint64_t seed, const std::string& fqn) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a of the FQN, then SplitMix64's finalizer with the seed
  for (const char ch : fqn) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001B3ull;
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (h | 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fills `piece`, which sits at `offset` in a parameter of `global_shape`, as `init` says.
void fill(const at::Tensor& piece, const std::vector<int64_t>& offset, const std::vector<int64_t>& global_shape,
          const Init& init, uint64_t seed, uint64_t stream) {
  if (piece.is_meta()) return;  // a dry run's: no values to draw
  at::NoGradGuard no_grad;
  switch (init.kind) {
    case Init::Kind::kConstant:
      piece.fill_(init.a);
      return;
    case Init::Kind::kNormal:
      philox_fill(piece, offset, global_shape, seed, stream, RandomFill::kNormal, init.a, init.b);
      return;
    case Init::Kind::kUniform:
      philox_fill(piece, offset, global_shape, seed, stream, RandomFill::kUniform, init.a, init.b);
      return;
  }
}

// The parameter with storage for its values. A DTensor gets its local piece in place, keeping its
// identity (gradient hooks that plans registered stay); a plain meta tensor is replaced.
at::Tensor materialize(const at::Tensor& p, c10::Device device) {
  if (is_dtensor(p)) {
    materialize_local(p, device.is_meta() ? std::optional<c10::Device>(device) : std::nullopt);
    return p;
  }
  if (!p.is_meta()) return p;
  return at::empty(p.sizes(), p.options().device(device)).set_requires_grad(p.requires_grad());
}

}  // namespace

void init_parameters(Module& model, uint64_t seed, c10::Device device) {
  init_parameters(
      model, seed, [](const std::string&) { return true; }, device);
}

void init_parameters(Module& model, uint64_t seed, const std::function<bool(const std::string& fqn)>& wanted,
                     c10::Device device) {
  uint64_t stream = 0;  // counts every parameter, drawn or not, so each keeps its stream
  for (auto& [prefix, module] : model.named_modules_fqn()) {
    if (auto* dropout = dynamic_cast<Dropout*>(module)) dropout->seed(dropout_seed(seed, prefix));
    if (auto* core = dynamic_cast<CoreAttention*>(module)) core->seed(dropout_seed(seed, prefix));
    for (const auto& item : module->named_parameters(/*recurse=*/false)) {
      if (!wanted(prefix.empty() ? item.key() : prefix + "." + item.key())) {
        ++stream;
        continue;
      }
      at::Tensor p = materialize(item.value(), device);
      const Init& init = module->param_init(item.key());
      if (is_dtensor(p)) {
        const DTensorSpec& spec = DTensor(p).spec();
        for (const Placement& placement : spec.placements())
          HP_CHECK(!placement.is_partial(), prefix, ".", item.key(), ": cannot initialize a ",
                   to_string(spec.placements()), " parameter");
        const auto offset = spec.local_shape_and_offset(*spec.mesh().get_coordinate()).second;
        fill(local_tensor(p), offset, spec.shape(), init, seed, stream);
      } else {
        fill(p, std::vector<int64_t>(p.dim(), 0), p.sizes().vec(), init, seed, stream);
      }
      module->set_param(item.key(), p);
      ++stream;
    }
  }
}

int64_t local_parameter_bytes(Module& model) {
  int64_t bytes = 0;
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& storage = local_tensor(item.value());
    if (!storage.is_meta()) bytes += storage.numel() * static_cast<int64_t>(storage.element_size());
  }
  return bytes;
}

}  // namespace hp::nn
