// hp::nn::Dropout (declared in hp/nn/layers.h): masks by global position where the tokens'
// coordinates are known (hp/nn/token_coordinates.h), else over the tensor as given.
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "hp/dtensor/random.h"
#include "hp/nn/layers.h"
#include "hp/nn/token_coordinates.h"

namespace hp::nn {
namespace {

// A run of `length` tokens at consecutive positions from `position`, at local index `local`.
struct PositionRun {
  int64_t local, position, length;
};

// The positions of local tokens [begin, begin + n) as runs (a context-parallel shard holds two).
std::vector<PositionRun> position_runs(const at::Tensor& positions, int64_t begin, int64_t n) {
  if (!positions.defined()) return {{0, begin, n}};
  const at::Tensor mine = positions.narrow(0, begin, n).contiguous();
  const int64_t* p = mine.data_ptr<int64_t>();
  std::vector<PositionRun> runs;
  for (int64_t i = 0; i < n; ++i) {
    if (!runs.empty() && runs.back().position + runs.back().length == p[i])
      ++runs.back().length;
    else
      runs.push_back({i, p[i], 1});
  }
  return runs;
}

// The keep mask (1 or 0, fp32) of `local_shape`, the piece at `offset` of an activation of
// `shape` [rows, tokens, ...] whose rows and tokens sit where `where` says.
at::Tensor keep_mask(const std::vector<int64_t>& local_shape, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& shape, const TokenCoordinates& where, uint64_t seed, uint64_t stream,
                     double p) {
  HP_CHECK(shape.size() >= 2, "Dropout: with token coordinates the input must be [rows, tokens, ...]; got ",
           shape.size(), " dims");
  HP_CHECK(where.first_row >= 0 && where.first_row + shape[0] <= where.global_rows, "Dropout: rows [", where.first_row,
           ", ", where.first_row + shape[0], ") are not rows of the global batch of ", where.global_rows);
  const int64_t placed = where.positions.defined() ? where.positions.numel() : where.global_seq;
  HP_CHECK(placed == shape[1], "Dropout: the input has ", shape[1],
           " tokens per row where the token coordinates place ", placed,
           " (an input holding part of the sequence must be a DTensor that says which part, e.g. SequenceParallel on "
           "the Dropout, or the coordinates must give its positions)");
  std::vector<int64_t> global_shape = shape;
  global_shape[0] = where.global_rows;
  global_shape[1] = where.global_seq;
  at::Tensor keep = at::empty(local_shape, at::kFloat);
  std::vector<int64_t> at = offset;
  at[0] += where.first_row;
  for (const PositionRun& run : position_runs(where.positions, offset[1], local_shape[1])) {
    HP_CHECK(run.position >= 0 && run.position + run.length <= where.global_seq, "Dropout: tokens at positions [",
             run.position, ", ", run.position + run.length, ") are outside rows of ", where.global_seq, " tokens");
    at[1] = run.position;
    philox_fill(keep.narrow(1, run.local, run.length), at, global_shape, seed, stream, RandomFill::kBernoulli, 1.0 - p,
                0.0);
  }
  return keep;
}

}  // namespace

Dropout::Dropout(double prob) : Module("Dropout"), p(prob) {
  HP_CHECK(prob >= 0.0 && prob <= 1.0, "Dropout: p must be in [0, 1], got ", prob);
}

void Dropout::seed(uint64_t seed) {
  seed_ = seed;
  draws_.reset();
}

at::Tensor Dropout::forward(const at::Tensor& x) {
  if (!is_training() || p == 0.0) return x;
  if (p == 1.0) return x * 0.0;
  const double scale = 1.0 / (1.0 - p);
  const Draw draw = draws_.next();
  if (!draw.where) {
    if (is_dtensor(x)) return at::dropout(x, p, /*train=*/true);
    // The tensor as the whole batch.
    at::Tensor keep = at::empty(x.sizes(), at::kFloat);
    philox_fill(keep, std::vector<int64_t>(x.dim(), 0), x.sizes().vec(), seed_, draw.stream, RandomFill::kBernoulli,
                1.0 - p, 0.0);
    return x * keep.to(local_tensor(x).device(), x.scalar_type()) * scale;
  }
  const TokenCoordinates& coordinates = *draw.where;
  const uint64_t stream = draw.stream;
  if (!is_dtensor(x)) {
    const std::vector<int64_t> shape = x.sizes().vec();
    const at::Tensor keep =
        keep_mask(shape, std::vector<int64_t>(shape.size(), 0), shape, coordinates, seed_, stream, p);
    return x * keep.to(local_tensor(x).device(), x.scalar_type()) * scale;
  }
  // A DTensor's piece sits at its offset within the call's activation; a partial value's pieces
  // all take the whole mask (the mask scales their sum).
  const DTensorSpec& spec = DTensor(x).spec();
  const auto [local_shape, offset] = spec.local_shape_and_offset(*spec.mesh().get_coordinate());
  const at::Tensor keep = keep_mask(local_shape, offset, spec.shape(), coordinates, seed_, stream, p);
  Placements placements = spec.placements();
  for (Placement& placement : placements)
    if (placement.is_partial()) placement = Replicate();
  return x *
         DTensor::from_local(keep.to(local_tensor(x).device(), x.scalar_type()), spec.mesh(), placements,
                             spec.shape()) *
         scale;
}

}  // namespace hp::nn
