// Running a redistribute plan on this rank's local piece. Shapes:
//   x       this rank's piece under the placements reached so far (`current`)
//   L       the length of the tensor dim being split at mesh dim i, as seen at that mesh dim
//           (after the splits of earlier mesh dims): pieces are chunk_sizes(L, n)
#include <ATen/ATen.h>

#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/dtensor/redistribute.h"

namespace hp {
namespace {

using Kind = RedistributeStep::Kind;

// S(d) -> S(e) on one mesh dim: piece r of x along e goes to rank r; the pieces received are
// concatenated along d in rank order. Moved as one flat buffer with per-rank element counts.
at::Tensor all_to_all_shards(const at::Tensor& x, const comm::ProcessGroup& group, int64_t d, int64_t e,
                             const std::vector<int64_t>& d_sizes, const std::vector<int64_t>& e_sizes) {
  const int n = group.size(), me = group.rank();
  std::vector<at::Tensor> send;
  comm::AllToAllOptions opts;
  int64_t offset = 0;
  for (int r = 0; r < n; ++r) {
    send.push_back(x.narrow(e, offset, e_sizes[r]).contiguous().reshape({-1}));
    offset += e_sizes[r];
    opts.input_split_sizes.push_back(send.back().numel());
  }
  std::vector<std::vector<int64_t>> shapes;
  for (int r = 0; r < n; ++r) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape[d] = d_sizes[r];
    shape[e] = e_sizes[me];
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    opts.output_split_sizes.push_back(numel);
    shapes.push_back(std::move(shape));
  }
  at::Tensor received = group.all_to_all(at::cat(send), opts);
  std::vector<at::Tensor> pieces;
  offset = 0;
  for (int r = 0; r < n; ++r) {
    pieces.push_back(received.narrow(0, offset, opts.output_split_sizes[r]).view(shapes[r]));
    offset += opts.output_split_sizes[r];
  }
  return at::cat(pieces, d);
}

}  // namespace

at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src, const Placements& dst_placements,
                              comm::WireFormat wire) {
  const DeviceMesh& mesh = src.mesh();
  const DTensorSpec dst(mesh, dst_placements, src.shape());  // validates and normalizes
  const std::vector<int64_t> expected = src.local_shape();
  HP_CHECK(local.sizes() == at::IntArrayRef(expected), "redistribute: the local tensor has shape ", local.sizes(),
           " but ", src.str(), " puts a piece of shape ", at::IntArrayRef(expected), " on world rank ",
           mesh.get_rank());
  const std::vector<int64_t> coordinate = *mesh.get_coordinate();

  // The wire format for reducing `partial`: only sums and averages of fp32, bf16 or fp16 data have one.
  const at::ScalarType dtype = local.scalar_type();
  const bool carried = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  const auto wire_for = [&](const Placement& partial) {
    const comm::ReduceOp op = partial.reduce_op();
    return carried && (op == comm::ReduceOp::kSum || op == comm::ReduceOp::kAvg) ? wire : comm::WireFormat::kNative;
  };
  at::Tensor x = local;
  Placements current = src.placements();
  for (const RedistributeStep& step : plan_redistribute(src.placements(), dst.placements())) {
    const int64_t i = step.mesh_dim;
    const comm::ProcessGroup& group = mesh.get_group(i);
    const int64_t n = mesh.size(i), c = coordinate[i];
    auto pieces_of = [&](int64_t dim) {
      return chunk_sizes(length_at_mesh_dim(src.shape(), current, mesh, coordinate, dim, i), n);
    };
    switch (step.kind) {
      case Kind::kAllGather:
        x = group.all_gather(x, {step.from.dim(), pieces_of(step.from.dim())});
        break;
      case Kind::kChunk: {
        const auto sizes = pieces_of(step.to.dim());
        int64_t offset = 0;
        for (int64_t r = 0; r < c; ++r) offset += sizes[r];
        x = x.narrow(step.to.dim(), offset, sizes[c]).contiguous();
        break;
      }
      case Kind::kAllReduce:  // never reduce into the caller's tensor
        x = group.all_reduce(x.clone(), {step.from.reduce_op(), wire_for(step.from)});
        break;
      case Kind::kReduceScatter:
        x = group.reduce_scatter(x,
                                 {step.from.reduce_op(), step.to.dim(), pieces_of(step.to.dim()), wire_for(step.from)});
        break;
      case Kind::kAllToAll:
        x = all_to_all_shards(x, group, step.from.dim(), step.to.dim(), pieces_of(step.from.dim()),
                              pieces_of(step.to.dim()));
        break;
      case Kind::kPartition:
        // Partial(sum) of a replicated value: one copy holds it, the others contribute zero.
        // avg/max/min of identical values are the value itself, so every rank keeps it.
        if (step.to.reduce_op() == comm::ReduceOp::kSum && c != 0) x = at::zeros_like(x);
        break;
    }
    current[i] = step.to;
  }
  return x;
}

}  // namespace hp
