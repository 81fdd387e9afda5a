// Table-driven property test over every registered sharding rule: for every combination of
// placements of the inputs, each among {S(d) for each dim d, R, P(sum) for real-valued inputs}, on a
// 1-D mesh of 4 and on a (2, 2) mesh, with uneven shapes (7x5), op(dtensors) holds the pieces of
// op(full tensors) and so do the input gradients through backward. Each rank compares the piece it
// holds with the one cut from the single-device result; Partial results are reduced first.
//
// Inputs are random normal (and uniform for positive ones) fp32 values, not integers, so that a
// sum taken in another order shows. Bitwise wherever no reduction is split across ranks, else rtol
// 1e-6 per element with an absolute floor of 1e-6 times the result's largest magnitude. "Split" is
// observed, not declared: a combination that issues no all_reduce or reduce_scatter
// (CommDebugMode) in the op, its backward or the reduction of a Partial result has every sum
// computed whole on one rank, and must match bitwise. Two exceptions come from ATen, not from us:
// - its AVX2/AVX512 kernels compute transcendental functions (exp, tanh, erf, ...) with a SIMD body
//   and a scalar tail that round differently, so the same element gets other bits when a shard
//   boundary moves it from body to tail. Cases using them are marked `simd_math`; they are bitwise
//   when ATen runs its portable kernels (ATEN_CPU_CAPABILITY=default, which ctest runs as the
//   "bitwise:" copy of this table, on the covering set below);
// - its sum over dim 0 orders the additions by the matrix's width (`column_sums_in_backward`);
// - BLAS may order a product's sums by the shape of the piece of rows computed
//   (`row_pieces_of_a_product_in_backward`).
// A Partial input's pieces add up to its value only within rounding, so every comparison that
// involves one is a split reduction, compared within rtol.
//
// Every combination on the (2, 2) mesh runs by default (a case with many is split in parts, each
// a ctest test); HP_RULE_COVERING=1 runs a covering set there instead (every placement of every
// input, partners rotating), as the one-process run and the "bitwise:" copy do. The test ends by
// checking that every registered rule was consulted.
#include <hp/comm/comm_debug_mode.h>
#include <hp/dtensor/dtensor.h>
#include <hp/dtensor/random.h>
#include <hp/dtensor/sharding_rule.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/normalization.h>

#include <cctype>
#include <cstdlib>
#include <set>

#include "hp/core/libtorch_version.h"
#include "test_util.h"

namespace hp::test {
namespace {

namespace F = torch::nn::functional;
using Args = std::vector<at::Tensor>;

struct Arg {
  std::vector<int64_t> shape;
  enum Kind { kReal, kPositive, kIndex, kBool } kind = kReal;
  int64_t index_max = 0;
};

struct Case {
  std::string name;
  std::vector<Arg> args;
  std::function<at::Tensor(const Args&)> fn;
  // Uses kernels whose SIMD body and scalar tail round differently (transcendentals, vectorized
  // reductions): bitwise only under ATen's portable kernels, see the top of the file.
  bool simd_math = false;
  bool in_place_on_first = false;  // the first input is written in place: it may not be Partial
  // Its backward sums the columns of a matrix (a broadcast operand's gradient). ATen's dim-0 sum
  // orders its additions by the matrix's width, under every CPU capability, so a column shard gets
  // other bits: its gradients are bitwise only for integer-valued inputs.
  bool column_sums_in_backward = false;
  // Its backward computes a product in pieces of rows (a replicated weight's gradient, row-sharded
  // from gathered operands). The sum over the contracted dim is whole on one rank, but BLAS may
  // order its additions by the piece's shape: OpenBLAS's AVX-512 kernels do (a 2-row and a 5-row
  // piece of one [5, 21] x [21, 4] product got other last bits on an Intel Xeon), its AVX2 ones did
  // not on the AMD machines this table ran on before. Compared within rtol.
  bool row_pieces_of_a_product_in_backward = false;
};

Arg real(std::vector<int64_t> s) { return {std::move(s), Arg::kReal, 0}; }
Arg positive(std::vector<int64_t> s) { return {std::move(s), Arg::kPositive, 0}; }
Arg index(std::vector<int64_t> s, int64_t max) { return {std::move(s), Arg::kIndex, max}; }
Arg boolean(std::vector<int64_t> s) { return {std::move(s), Arg::kBool, 0}; }

std::vector<Case> cases() {
  const std::vector<int64_t> M = {7, 5};
  std::vector<Case> c;
  auto unary = [&](std::string name, std::function<at::Tensor(const at::Tensor&)> f, Arg a, bool simd = false) {
    c.push_back({std::move(name), {std::move(a)}, [f](const Args& x) { return f(x[0]); }, simd});
  };
  auto binary = [&](std::string name, std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> f, Arg a, Arg b,
                    bool simd = false) {
    c.push_back({std::move(name), {std::move(a), std::move(b)}, [f](const Args& x) { return f(x[0], x[1]); }, simd});
  };
  // Pointwise, unary (their backward ops come along).
  unary(
      "gelu", [](auto& x) { return at::gelu(x); }, real(M), true);
  unary(
      "relu", [](auto& x) { return at::relu(x); }, real(M));
  unary(
      "silu", [](auto& x) { return at::silu(x); }, real(M), true);
  unary(
      "mish", [](auto& x) { return at::mish(x); }, real(M), true);
  unary(
      "sigmoid", [](auto& x) { return at::sigmoid(x); }, real(M), true);
  unary(
      "tanh", [](auto& x) { return at::tanh(x); }, real(M), true);
  unary(
      "exp", [](auto& x) { return at::exp(x * 0.1); }, real(M), true);
  unary(
      "log", [](auto& x) { return at::log(x); }, positive(M), true);
  unary(
      "log1p", [](auto& x) { return at::log1p(x); }, positive(M), true);
  unary(
      "sqrt", [](auto& x) { return at::sqrt(x); }, positive(M));
  unary(
      "rsqrt", [](auto& x) { return at::rsqrt(x); }, positive(M), true);
  unary(
      "reciprocal", [](auto& x) { return at::reciprocal(x); }, positive(M));
  unary(
      "abs", [](auto& x) { return at::abs(x); }, real(M));
  unary(
      "neg", [](auto& x) { return -x; }, real(M));
  unary(
      "sin cos", [](auto& x) { return at::sin(x) + at::cos(x); }, real(M), true);
  unary(
      "erf", [](auto& x) { return at::erf(x); }, real(M), true);
  unary(
      "sign", [](auto& x) { return at::sign(x); }, real(M));
  unary(
      "pow scalar", [](auto& x) { return at::pow(x, 2.0); }, real(M));
  unary(
      "clamp", [](auto& x) { return at::clamp(x, -1.5, 2.0) + at::clamp_min(x, 0.5) + at::clamp_max(x, 1.0); },
      real(M));
  unary(
      "scalar arithmetic", [](auto& x) { return (x + 1.0) * 2.0 - 3.0 / (x * x + 1.0) - (1.0 - x); }, real(M));
  unary(
      "to double", [](auto& x) { return x.to(at::kDouble).to(at::kFloat); }, real(M));
  unary(
      "comparisons",
      [](auto& x) {
        return at::where(at::logical_not(x.gt(0.5)), x.lt(0.5).to(at::kFloat),
                         x.ge(1.0).to(at::kFloat) + x.le(2.0) + x.eq(1.0) + x.ne(2.0));
      },
      real(M));
  c.push_back({"in place unary",
               {real(M)},
               [](const Args& x) {
                 const at::Tensor& a = x[0];
                 return a.clone().neg_() + a.clone().exp_() + a.abs().add_(1.0).sqrt_() + a.clone().relu_() +
                        a.clone().clamp_(0, 3) + a.clone().pow_(2.0);
               },
               true,
               true});
  unary(
      "fill zero copy",
      [](auto& x) {
        at::Tensor y = x.clone();
        at::Tensor z = at::empty_like(y).fill_(2.0);
        return y.mul_(z) + at::zeros_like(x).zero_() + at::full_like(x, 3.0) + at::ones_like(x).copy_(x);
      },
      real(M));
  unary(
      "detach alias", [](auto& x) { return x.detach() * x + x.alias(); }, real(M));
  // Pointwise, binary, with broadcasting.
  binary(
      "add sub", [](auto& a, auto& b) { return a + b * 2.0 - b; }, real(M), real(M));
  binary(
      "mul div", [](auto& a, auto& b) { return a * b / (b * b + 1.0); }, real(M), real(M));
  binary(
      "broadcast row", [](auto& a, auto& b) { return a * b + b; }, real(M), real({5}));
  c.back().column_sums_in_backward = true;
  binary(
      "broadcast column", [](auto& a, auto& b) { return a - b; }, real(M), real({7, 1}));
  binary(
      "ne logical_or",
      [](auto& a, auto& b) {
        return (a.ne(b).logical_or(a.gt(b)).to(at::kFloat) + a.gt(0.0).logical_or_(b.gt(0.0)).to(at::kFloat)) * 1.0;
      },
      real(M), real(M));
  binary(
      "maximum minimum", [](auto& a, auto& b) { return at::maximum(a, b) + at::minimum(a, b); }, real(M), real(M));
  binary(
      "maximum minimum out",
      [](auto& a, auto& b) {  // out= forms are not differentiable: on detached operands
        const at::Tensor x = a.detach(), y = b.detach();
        // The out arguments: x's shards, never Partial (abs reduces a Partial first).
        at::Tensor high = x.abs(), low = x.abs();
        at::maximum_out(high, x, y);
        at::minimum_out(low, x, y);
        return high + low;
      },
      real(M), real(M));
  binary(
      "pow tensor rsub", [](auto& a, auto& b) { return at::pow(a, b * 0.0 + 2.0) + at::rsub(a, b) + at::rsub(a, 1.0); },
      positive(M), real(M));
  binary(
      "lerp", [](auto& a, auto& b) { return at::lerp(a, b, 0.25) + at::lerp(a, b, b * 0.1); }, real(M), real(M));
  binary(
      "addcmul addcdiv",
      [](auto& a, auto& b) { return at::addcmul(a, a, b, 0.5) + at::addcdiv(a, b, b * b + 1.0, 2.0); }, real(M),
      real(M));
  c.push_back({"in place binary",
               {real(M), real(M)},
               [](const Args& x) {
                 const at::Tensor &a = x[0], &b = x[1];
                 return a.clone()
                     .add_(b)
                     .sub_(b, 0.5)
                     .mul_(b)
                     .div_(b * b + 1.0)
                     .add_(1.0)
                     .sub_(0.5)
                     .mul_(2.0)
                     .div_(4.0)
                     .lerp_(b, 0.5)
                     .lerp_(b, b * 0.0 + 0.25)
                     .addcmul_(b, b, 0.1)
                     .addcdiv_(b, b * b + 1.0, 0.1);
               },
               false,
               true});
  binary(
      "masked_fill where",
      [](auto& a, auto& m) {
        return a.masked_fill(m, 0.5) + a.masked_fill(m, at::scalar_tensor(2.0)) + at::where(m, a, a * 2.0);
      },
      real(M), boolean(M));
  c.push_back({"masked_fill_ in place",
               {real(M), boolean(M)},
               [](const Args& x) { return x[0].clone().masked_fill_(x[1], 1.0); },
               false,
               true});
  // Reductions.
  unary(
      "sum", [](auto& x) { return x.sum(); }, real(M));
  unary(
      "sum dims",
      [](auto& x) {
        return x.sum(1) + x.sum(at::IntArrayRef{0, 1}, true).squeeze(1);
      },
      real(M));
  unary(
      "mean", [](auto& x) { return x.mean() + x.mean(0).sum() + x.mean(1, true).sum(); }, real(M));
  unary(
      "amax amin", [](auto& x) { return x.amax(1) + x.amin(1); }, real(M));
  // Forward only: LibTorch 1.13's backward of max/min(dim) scatters into a plain tensor (see dispatch.cpp).
  unary(
      "max min with indices",
      [](auto& x) {
        auto [values, where] = x.detach().max(1);
        auto [low, at_low] = x.detach().min(0, /*keepdim=*/true);
        return values.unsqueeze(1) + where.unsqueeze(1).to(at::kFloat) + low + at_low.to(at::kFloat);
      },
      real(M));
  c.push_back({"gather scatter", {real(M), index({7, 2}, 5)}, [](const Args& x) {
                 return x[0].gather(1, x[1]) +
                        at::zeros_like(x[0]).scatter(1, x[1], x[0].narrow(1, 0, 2)).narrow(1, 0, 2) +
                        x[0].new_ones({7, 2}) + x[0].new_full({7, 2}, 2.0) + x[0].new_empty({7, 2}).fill_(1.0) +
                        at::zeros_like(x[0]).scatter_add(1, x[1], x[0].narrow(1, 1, 2)).narrow(1, 0, 2);
               }});
  c.push_back({"layer_norm",
               {real(M), real({5}), real({5})},
               [](const Args& x) { return F::layer_norm(x[0], F::LayerNormFuncOptions({5}).weight(x[1]).bias(x[2])); },
               true});
  binary(
      "rms_norm", [](auto& x, auto& w) { return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w; }, real(M),
      real({5}), true);
  // Softmax family and losses.
  unary(
      "softmax", [](auto& x) { return at::softmax(x, 1) + at::softmax(x, 0); }, real(M), true);
  unary(
      "log_softmax", [](auto& x) { return at::log_softmax(x, 1) * at::log_softmax(x, 0); }, real(M), true);
  binary(
      "nll_loss sum none",
      [](auto& x, auto& t) {
        return F::nll_loss(at::log_softmax(x, 1), t, F::NLLLossFuncOptions().reduction(torch::kSum)) +
               F::nll_loss(at::log_softmax(x, 1), t, F::NLLLossFuncOptions().reduction(torch::kNone)).sum();
      },
      real(M), index({7}, 5), true);
  binary(
      "cross_entropy mean", [](auto& x, auto& t) { return F::cross_entropy(x, t); }, real(M), index({7}, 5), true);
  binary(
      "embedding", [](auto& w, auto& i) { return at::embedding(w, i); }, real({11, 5}), index({7, 3}, 11));
  // Matrix products.
  binary(
      "mm", [](auto& a, auto& b) { return at::mm(a, b); }, real(M), real({5, 6}));
  c.push_back({"addmm", {real({6}), real(M), real({5, 6})}, [](const Args& x) { return at::addmm(x[0], x[1], x[2]); }});
  c.push_back({"addmm 2-D bias", {real({7, 6}), real(M), real({5, 6})}, [](const Args& x) {
                 return at::addmm(x[0], x[1], x[2], 0.5, 2.0);
               }});
  binary(
      "matmul 3-D by 2-D", [](auto& a, auto& b) { return at::matmul(a, b); }, real({3, 7, 5}), real({5, 4}));
  c.back().row_pieces_of_a_product_in_backward = true;
  binary(
      "bmm", [](auto& a, auto& b) { return at::bmm(a, b); }, real({3, 7, 5}), real({3, 5, 4}));
  c.push_back({"baddbmm", {real({3, 7, 4}), real({3, 7, 5}), real({3, 5, 4})}, [](const Args& x) {
                 return at::baddbmm(x[0], x[1], x[2]);
               }});
  binary(
      "linear", [](auto& x, auto& w) { return F::linear(x, w); }, real(M), real({6, 5}));
  // Shape ops.
  unary(
      "t transpose permute",
      [](auto& x) {
        return x.t().t() + x.transpose(0, 1).permute({1, 0});
      },
      real(M));
  unary(
      "unsqueeze squeeze expand",
      [](auto& x) {
        return x.unsqueeze(0).expand({3, 7, 5}).sum(0) + x.unsqueeze(1).squeeze(1);
      },
      real(M));
  unary(
      "view reshape",
      [](auto& x) {
        return x.view({35}).view({7, 5}) + x.reshape({7, 5, 1}).squeeze(2) + x.t().reshape({35}).view({5, 7}).t();
      },
      real(M));
  unary(
      "view split dims",
      [](auto& x) {
        return x.view({7, 5, 1, 1}).sum({2, 3});
      },
      real(M));
  unary(
      "slice select",
      [](auto& x) { return x.slice(0, 1, 6).sum(0) + x.select(1, 2).sum() + x.narrow(1, 1, 3).sum(1).sum(); }, real(M));
  unary(
      "cat stack split",
      [](auto& x) {
        auto parts = x.split(2, 1);
        auto sized = x.split_with_sizes({3, 2}, 1);
        return at::cat({parts[0], parts[1] * 2.0, parts[2]}, 1) + at::stack({x, x}, 0).sum(0) +
               at::cat({sized[1], sized[0]}, 1);
      },
      real(M));
  unary(
      "item", [](auto& x) { return x * (x.sum().template item<float>() * 0.0) + x; }, real(M));
  return c;
}

// Every placement of one input on `mesh`: S(d) for each dim, R, and P(sum) for real inputs.
std::vector<Placements> choices(const Arg& arg, int64_t mesh_ndim, bool partial_allowed) {
  std::vector<Placement> one;
  for (int64_t d = 0; d < static_cast<int64_t>(arg.shape.size()); ++d) one.push_back(Shard(d));
  one.push_back(Replicate());
  if (partial_allowed && (arg.kind == Arg::kReal || arg.kind == Arg::kPositive)) one.push_back(Partial());
  std::vector<Placements> out;
  if (mesh_ndim == 1) {
    for (const auto& p : one) out.push_back({p});
  } else {
    for (const auto& p : one)
      for (const auto& q : one) out.push_back({p, q});
  }
  return out;
}

at::Tensor make_full(const Arg& arg, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  switch (arg.kind) {
    case Arg::kReal:
      return at::randn(arg.shape, gen, at::TensorOptions().dtype(at::kFloat)) * 2.0;
    case Arg::kPositive:
      return at::rand(arg.shape, gen, at::TensorOptions().dtype(at::kFloat)) * 4.0 + 0.5;
    case Arg::kIndex:
      return at::randint(0, arg.index_max, arg.shape, gen, at::TensorOptions().dtype(at::kLong));
    case Arg::kBool:
      return at::randint(0, 2, arg.shape, gen, at::TensorOptions().dtype(at::kLong)).to(at::kBool);
  }
  return {};
}

// The DTensor of `full` placed by `placements`; Partial pieces add up to `full` exactly.
at::Tensor place(const at::Tensor& full, const DeviceMesh& mesh, const Placements& placements, int seed) {
  Placements as_shards = placements;
  for (auto& p : as_shards)
    if (p.is_partial()) p = Replicate();
  DTensorSpec spec(mesh, placements, full.sizes().vec());
  at::Tensor piece = DTensor(distribute_tensor(full, mesh, as_shards)).to_local().detach().clone();
  const auto coordinate = *mesh.get_coordinate();
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (!placements[i].is_partial()) continue;
    const at::Tensor noise =
        at::randn(piece.sizes(), at::make_generator<at::CPUGeneratorImpl>(seed + i), piece.options());
    piece = coordinate[i] == 0 ? piece - (mesh.size(i) - 1) * noise : noise;
  }
  return DTensor::from_local(piece, mesh, placements, full.sizes().vec());
}

// True when ATen was told to run its portable kernels, whose vector body and scalar tail compute
// alike (LibTorch does not export its own query of the capability it picked).
bool portable_kernels() {
  const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
  return capability != nullptr && std::string(capability) == "default";
}

// A reduction split across ranks ends in a collective that adds pieces: Partial inputs or outputs
// reduced to Replicate (all_reduce) or to Shard (reduce_scatter).
bool splits_a_reduction(const comm::CommDebugMode& comm) {
  return comm.count("all_reduce") + comm.count("reduce_scatter") > 0;
}

// How many comparisons ran bitwise and how many within rtol, so a run shows what it proved.
struct Tally {
  int bitwise = 0, rtol = 0;
};

// `got` against `want`, a piece of the single-device result whose largest magnitude is `scale`.
void compare(const at::Tensor& got, const at::Tensor& want, double scale, const std::string& what, bool bitwise,
             Tally& tally) {
  ++(bitwise ? tally.bitwise : tally.rtol);
  if (got.sizes() != want.sizes())
    throw std::runtime_error(what + ": shape " + c10::str(got.sizes()) + " vs " + c10::str(want.sizes()));
  // rtol 1e-6 per element, with an absolute floor of 1e-6 times the result's largest magnitude:
  // sums that cancel leave errors of eps * |terms|.
  const bool ok = bitwise ? at::equal(got, want) : at::allclose(got, want, 1e-6, 1e-6 * std::max(scale, 1.0));
  if (!ok) {
    std::ostringstream msg;
    msg << what << (bitwise ? " (bitwise)" : " (rtol 1e-6)") << " differs, max abs diff "
        << (got - want).abs().max().item<double>();
    throw std::runtime_error(msg.str());
  }
}

// `got` (a DTensor with no Partial placement) against the whole tensor `want`, piece by piece: each
// rank compares the piece it holds with the one it must hold, cut from `want`, which costs no
// collective.
void compare_pieces(const at::Tensor& got, const at::Tensor& want, const std::string& what, bool bitwise,
                    Tally& tally) {
  const DTensor d(got);
  for (const Placement& p : d.placements())
    if (p.is_partial()) throw std::runtime_error(what + ": compare_pieces needs a reduced DTensor");
  if (d.sizes() != want.sizes())
    throw std::runtime_error(what + ": global shape " + c10::str(d.sizes()) + " vs " + c10::str(want.sizes()));
  const auto [shape, offset] = d.spec().local_shape_and_offset(*d.device_mesh().get_coordinate());
  at::Tensor piece = want;
  for (size_t k = 0; k < shape.size(); ++k) piece = piece.narrow(static_cast<int64_t>(k), offset[k], shape[k]);
  const double scale = want.numel() ? want.abs().max().item<double>() : 0.0;
  compare(d.to_local().detach(), piece, scale, what, bitwise, tally);
}

// `t` with each Partial placement reduced to Replicate; other placements kept.
at::Tensor reduced_if_partial(const at::Tensor& t) {
  DTensor d(t);
  Placements placements = d.placements();
  bool partial = false;
  for (Placement& p : placements)
    if (p.is_partial()) {
      p = Replicate();
      partial = true;
    }
  return partial ? d.redistribute(d.device_mesh(), placements) : d;
}

// Which placement combinations to run: every combination (exhaustive), or a covering set in which
// every placement of every input appears, its partners rotating through their own choices.
std::vector<std::vector<size_t>> combinations(const std::vector<std::vector<Placements>>& options, bool exhaustive) {
  std::vector<std::vector<size_t>> out;
  if (exhaustive || options.size() == 1) {
    std::vector<size_t> pick(options.size(), 0);
    for (;;) {
      out.push_back(pick);
      size_t k = pick.size();
      while (k-- > 0) {
        if (++pick[k] < options[k].size()) break;
        pick[k] = 0;
      }
      if (k == static_cast<size_t>(-1)) return out;
    }
  }
  for (size_t k = 0; k < options.size(); ++k) {
    for (size_t j = 0; j < options[k].size(); ++j) {
      std::vector<size_t> pick(options.size());
      for (size_t other = 0; other < options.size(); ++other)
        pick[other] = other == k ? j : (j + other) % options[other].size();
      out.push_back(pick);
    }
  }
  return out;
}

// A share of a case's combinations: those whose index is `index` modulo `count`.
struct Part {
  size_t index = 0, count = 1;
};

// Each input's placements on a mesh of `mesh_ndim` dims.
std::vector<std::vector<Placements>> placement_options(const Case& c, int64_t mesh_ndim) {
  std::vector<std::vector<Placements>> options;
  for (size_t k = 0; k < c.args.size(); ++k)
    options.push_back(choices(c.args[k], mesh_ndim, !(k == 0 && c.in_place_on_first)));
  return options;
}

void check_case(const Case& c, const DeviceMesh& mesh, bool exhaustive, Part part, Tally& tally) {
  std::vector<at::Tensor> full;
  for (size_t k = 0; k < c.args.size(); ++k) full.push_back(make_full(c.args[k], 100 + static_cast<int>(k)));
  // Single device.
  Args ref;
  for (const auto& f : full) ref.push_back(f.is_floating_point() ? f.clone().requires_grad_(true) : f);
  const at::Tensor ref_out = c.fn(ref);
  const bool differentiable = ref_out.requires_grad();
  const at::Tensor w = at::randint(-3, 4, ref_out.sizes(), at::make_generator<at::CPUGeneratorImpl>(7),
                                   ref_out.options().requires_grad(false));
  if (differentiable) (ref_out * w).sum().backward();

  const std::vector<std::vector<Placements>> options = placement_options(c, mesh.ndim());
  const std::vector<std::vector<size_t>> picks = combinations(options, exhaustive);
  for (size_t i = part.index; i < picks.size(); i += part.count) {
    const std::vector<size_t>& pick = picks[i];
    Args inputs;
    std::string layout;
    for (size_t k = 0; k < c.args.size(); ++k) {
      const Placements& p = options[k][pick[k]];
      layout += (k ? " " : "") + to_string(p);
      at::Tensor d = place(full[k], mesh, p, 200 + static_cast<int>(k));
      if (full[k].is_floating_point()) d.requires_grad_(true);
      inputs.push_back(d);
    }
    const std::string what = c.name + " on " + mesh.str() + " with " + layout;
    const bool exact_kernels = !c.simd_math || portable_kernels();
    // Forward: split iff a reducing collective ran in the op or in reducing a Partial result.
    comm::CommDebugMode comm;
    const at::Tensor out = c.fn(inputs);
    const at::Tensor got = reduced_if_partial(out.detach());
    compare_pieces(got, ref_out.detach(), what, exact_kernels && !splits_a_reduction(comm), tally);
    if (differentiable) {
      // Gradients also depend on the forward values, so the same counter keeps running. A Partial
      // gradient is reduced before any is compared, so each comparison sees every reduction.
      (out * distribute_tensor(w, mesh, Placements(mesh.ndim(), Replicate()))).sum().backward();
      std::vector<at::Tensor> grads;
      for (size_t k = 0; k < inputs.size(); ++k)
        if (full[k].is_floating_point()) grads.push_back(reduced_if_partial(inputs[k].grad()));
      const bool bitwise = exact_kernels && !c.column_sums_in_backward && !c.row_pieces_of_a_product_in_backward &&
                           !splits_a_reduction(comm);
      for (size_t k = 0, g = 0; k < inputs.size(); ++k)
        if (full[k].is_floating_point())
          compare_pieces(grads[g++], ref[k].grad(), "grad " + std::to_string(k) + " of " + what, bitwise, tally);
    }
  }
}

testing::RunRanksOptions options() {
  testing::RunRanksOptions o;
  o.watchdog = std::chrono::minutes(10);
  o.group.set_timeout(std::chrono::seconds(5));  // a desynchronized failure must not cost minutes
  return o;
}

const std::vector<Case>& all_cases() {
  static const std::vector<Case> all = cases();
  return all;
}

// A case, or a part of one: a case with more (2, 2) combinations than kCombinationsPerPart is
// split in parts (ctest runs each as a test, so none runs for minutes).
struct CasePart {
  size_t case_index;
  Part part;
};
constexpr size_t kCombinationsPerPart = 400;

void PrintTo(const CasePart& p, std::ostream* os) {
  *os << all_cases()[p.case_index].name << ", part " << p.part.index + 1 << " of " << p.part.count;
}

std::vector<CasePart> case_parts() {
  std::vector<CasePart> out;
  for (size_t i = 0; i < all_cases().size(); ++i) {
    size_t combinations = 1;
    for (const auto& options : placement_options(all_cases()[i], 2)) combinations *= options.size();
    const size_t count = (combinations + kCombinationsPerPart - 1) / kCombinationsPerPart;
    for (size_t part = 0; part < count; ++part) out.push_back({i, {part, count}});
  }
  return out;
}

class RuleCase : public ::testing::TestWithParam<CasePart> {};

// Every placement combination of a case on a 1-D mesh of 4 (in its part 0) and on a (2, 2) mesh
// (those of its part). HP_RULE_COVERING=1 runs a covering set on the (2, 2) mesh instead: every
// placement of every input, its partners rotating through their own choices.
TEST_P(RuleCase, MatchesSingleDevice) {
  const Case& c = all_cases().at(GetParam().case_index);
  const Part part = GetParam().part;
  const char* covering = std::getenv("HP_RULE_COVERING");
  const bool exhaustive = covering == nullptr || std::string(covering) == "0";
  run(
      4,
      [&](const comm::ProcessGroup& g) {
        Tally tally;
        if (part.index == 0) check_case(c, init_device_mesh(g, "cpu", {4}, {"x"}), /*exhaustive=*/true, {}, tally);
        check_case(c, init_device_mesh(g, "cpu", {2, 2}, {"a", "b"}), exhaustive, part, tally);
        if (g.rank() == 0)
          std::cout << c.name << ": " << tally.bitwise << " comparisons bitwise, " << tally.rtol << " within rtol 1e-6"
                    << (portable_kernels() ? " (portable ATen kernels)" : "") << "\n";
      },
      options());
}

INSTANTIATE_TEST_SUITE_P(Table, RuleCase, ::testing::ValuesIn(case_parts()), [](const auto& info) {
  const Part part = info.param.part;
  std::string name = all_cases()[info.param.case_index].name;
  if (part.count > 1) name += " part " + std::to_string(part.index + 1) + " of " + std::to_string(part.count);
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
});

// Every registered rule is consulted by some case (forward or backward), so none goes untested.
TEST(ShardingRules, EveryRegisteredRuleIsExercised) {
  run(
      4,
      [](const comm::ProcessGroup& g) {
        DeviceMesh line = init_device_mesh(g, "cpu", {4}, {"x"});
        const char* only = std::getenv("HP_RULE_CASES");  // debugging: run the cases whose name contains this
        for (const Case& c : all_cases()) try {
            if (only != nullptr && c.name.find(only) == std::string::npos) continue;
            Args inputs;
            for (size_t k = 0; k < c.args.size(); ++k) {
              at::Tensor d = distribute_tensor(make_full(c.args[k], 100 + static_cast<int>(k)), line,
                                               {k == 0 ? Shard(0) : Replicate()});
              if (d.is_floating_point()) d.requires_grad_(true);
              inputs.push_back(d);
            }
            at::Tensor out = c.fn(inputs);
            if (out.requires_grad()) out.sum().backward();
          } catch (const std::exception& e) {
            throw std::runtime_error(c.name + ": " + e.what());
          }
        // Random fills have their own test (random_test.cpp); run them once so their rules count too.
        manual_seed(line, 1);
        at::dropout(distribute_tensor(at::ones({4, 4}), line, {Shard(0)}), 0.5, true);
        randn({4}, line, {Replicate()});
        rand({4}, line, {Replicate()});
      },
      options());
  std::set<std::string> unused;
  const auto used = sharding_rule_lookups();
  for (const std::string& rule : registered_sharding_rules(/*builtin_only=*/true))
    if (!used.count(rule)) unused.insert(rule);
#if HP_LIBTORCH_2
  // LibTorch 2.x's reshape views directly instead of going through _reshape_alias (seen on 2.11);
  // the rule stays for code that names the op.
  unused.erase("aten::_reshape_alias");
#endif
  std::string list;
  for (const auto& r : unused) list += " " + r;
  EXPECT_TRUE(unused.empty()) << "rules no case exercised:" << list;
}

}  // namespace
}  // namespace hp::test
