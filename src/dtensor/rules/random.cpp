// Random fills (uniform_, normal_, bernoulli_): each rank computes its piece of the values the op
// gives the whole tensor, from a counter-based generator indexed by global element position (see
// hp/dtensor/random.h). Shapes: `offset` is the piece's global offset, `global_strides` the global
// tensor's contiguous strides, so element idx of the piece is global element sum((offset + idx) *
// global_strides).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/strides.h>

#include <cmath>

#include "dtensor/philox.h"
#include "dtensor/rules/rules.h"
#include "hp/core/error.h"
#include "hp/dtensor/random.h"

namespace hp {

namespace {
constexpr double kTwoPow32 = 4294967296.0;
constexpr int64_t kGrain = 16384;  // elements per thread's share, at least

double draw(RandomFill kind, const std::array<uint32_t, 4>& r, double a, double b) {
  switch (kind) {
    case RandomFill::kUniform:
      return a + (b - a) * (r[0] / kTwoPow32);
    case RandomFill::kNormal: {
      const double u1 = (r[0] + 1.0) / kTwoPow32, u2 = r[1] / kTwoPow32;  // u1 in (0, 1]: log is finite
      return a + b * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    }
    case RandomFill::kBernoulli:
      return r[0] / kTwoPow32 < a ? 1.0 : 0.0;
  }
  return 0;
}
}  // namespace

void philox_fill(const at::Tensor& piece, const std::vector<int64_t>& offset, const std::vector<int64_t>& global_shape,
                 uint64_t seed, uint64_t stream, RandomFill kind, double a, double b) {
  const std::vector<int64_t> shape = piece.sizes().vec();
  const auto global_strides = c10::contiguous_strides(global_shape);
  at::Tensor values = at::empty(shape, at::TensorOptions().dtype(at::kDouble));
  double* out = values.data_ptr<double>();
  const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  // Each element is independent of the others: threads split them, with the same values.
  at::parallel_for(0, values.numel(), kGrain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> index(shape.size(), 0);
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1, rest = begin; d >= 0; --d) {
      index[d] = rest % shape[d];
      rest /= shape[d];
    }
    for (int64_t n = begin; n < end; ++n) {
      int64_t global = 0;
      for (size_t d = 0; d < shape.size(); ++d) global += (offset[d] + index[d]) * global_strides[d];
      const auto r = detail::philox4x32({static_cast<uint32_t>(global), static_cast<uint32_t>(global >> 32),
                                         static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)},
                                        key);
      out[n] = draw(kind, r, a, b);
      for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {  // odometer
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
  });
  piece.copy_(values);
}

void philox_fill_at(const at::Tensor& out, const at::Tensor& global_indices, uint64_t seed, uint64_t stream,
                    RandomFill kind, double a, double b) {
  HP_CHECK(kind != RandomFill::kNormal, "philox_fill_at: uniform or bernoulli values only");
  HP_CHECK(global_indices.scalar_type() == at::kLong && global_indices.sizes() == out.sizes(),
           "philox_fill_at: indices must be int64 of the output's shape ", out.sizes(), "; got ",
           global_indices.scalar_type(), " ", global_indices.sizes());
  const at::Tensor indices = global_indices.contiguous();
  const int64_t* index = indices.data_ptr<int64_t>();
  at::Tensor values = at::empty(out.sizes(), at::TensorOptions().dtype(at::kDouble));
  double* value = values.data_ptr<double>();
  const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  at::parallel_for(0, values.numel(), kGrain, [&](int64_t begin, int64_t end) {
    // Element i is word i % 4 of counter i / 4: runs of consecutive indices share one evaluation.
    uint64_t counter = ~uint64_t{0};
    std::array<uint32_t, 4> words{};
    for (int64_t n = begin; n < end; ++n) {
      const uint64_t i = static_cast<uint64_t>(index[n]);
      if (i / 4 != counter) {
        counter = i / 4;
        words = detail::philox4x32({static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                                    static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)},
                                   key);
      }
      value[n] = draw(kind, {words[i % 4], 0, 0, 0}, a, b);  // uniform and bernoulli read word 0 only
    }
  });
  out.copy_(values);
}

}  // namespace hp

namespace hp::rules {
namespace {

using Fill = RandomFill;

void fill_piece(const at::Tensor& local, const DTensorSpec& spec, Fill kind, double a, double b) {
  const auto [seed, stream] = spec.mesh().claim_random_stream();
  const auto offset = spec.local_shape_and_offset(*spec.mesh().get_coordinate()).second;
  philox_fill(local, offset, spec.shape(), seed, stream, kind, a, b);
}

// (self, a, b?, generator?) -> self, in place.
OpSharding random_fill(const OpCall& call, Fill kind, int generator_arg) {
  const DTensorSpec& self = call.inputs.at(0);
  for (const Placement& p : self.placements())
    HP_CHECK(!p.is_partial(), call.op, ": cannot fill a ", to_string(self.placements()),
             " tensor with random values; redistribute it to Replicate first");
  HP_CHECK(call.args.at(generator_arg).isNone(), call.op,
           ": DTensor random ops draw from the mesh's RNG (hp::manual_seed(mesh, seed)); pass no generator");
  OpSharding s;
  s.inputs = {self.placements()};
  s.outputs = {self.placements()};
  const bool two_params = kind != Fill::kBernoulli;
  s.local_kernel = [kind, two_params](const std::vector<c10::IValue>& args, const DTensorSpec& out,
                                      const std::vector<DTensorSpec>&) {
    fill_piece(args[0].toTensor(), out, kind, args[1].toDouble(), two_params ? args[2].toDouble() : 0.0);
    return args[0];
  };
  return s;
}

}  // namespace

void register_random_rules(const Register& add) {
  add("aten::uniform_", [](const OpCall& c) { return random_fill(c, Fill::kUniform, 3); });
  add("aten::normal_", [](const OpCall& c) { return random_fill(c, Fill::kNormal, 3); });
  add("aten::bernoulli_.float", [](const OpCall& c) { return random_fill(c, Fill::kBernoulli, 2); });
}

}  // namespace hp::rules

namespace hp {

void manual_seed(const DeviceMesh& mesh, uint64_t seed) { mesh.manual_seed(seed); }

MeshRngState get_rng_state(const DeviceMesh& mesh) {
  const auto [seed, next_stream] = mesh.random_state();
  return {seed, next_stream};
}

void set_rng_state(const DeviceMesh& mesh, const MeshRngState& state) {
  mesh.set_random_state(state.seed, state.next_stream);
}

namespace {
DTensor empty_dtensor(const std::vector<int64_t>& shape, const DeviceMesh& mesh, Placements placements) {
  DTensorSpec spec(mesh, placements, shape);
  return DTensor::from_local(at::empty(spec.local_shape()), mesh, std::move(placements), shape);
}
}  // namespace

DTensor rand(const std::vector<int64_t>& shape, const DeviceMesh& mesh, Placements placements) {
  DTensor out = empty_dtensor(shape, mesh, std::move(placements));
  out.uniform_(0.0, 1.0);
  return out;
}

DTensor randn(const std::vector<int64_t>& shape, const DeviceMesh& mesh, Placements placements) {
  DTensor out = empty_dtensor(shape, mesh, std::move(placements));
  out.normal_(0.0, 1.0);
  return out;
}

}  // namespace hp
