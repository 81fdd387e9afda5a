// Every collective on a 2x2 ("dp", "tp") mesh, each result
// checked against the value computed locally. Run it with:
//
//   build/bin/hprun --nproc-per-node 4 build/bin/collectives_demo
//
// Exits non-zero if any result differs from the expectation.
#include <hp/hp.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

namespace {

int failures = 0;

std::string values_of(const at::Tensor& t) {
  std::ostringstream out;
  out << "[";
  auto flat = t.flatten().to(at::kDouble);
  for (int64_t i = 0; i < flat.numel(); ++i) out << (i ? " " : "") << flat[i].item<double>();
  out << "]";
  return out.str();
}

void report(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  const bool ok = got.sizes() == want.sizes() && at::equal(got, want);
  if (!ok) ++failures;
  std::cout << (ok ? "ok    " : "WRONG ") << what << ": shape " << got.sizes() << " values " << values_of(got)
            << (ok ? "" : "  expected " + values_of(want)) << "\n";
}

// Rank r of a group contributes r+1 in every element (rows of it, in all_gather's uneven case).
at::Tensor contribution(int r, int64_t rows) { return at::full({rows, 2}, r + 1, at::kFloat); }

}  // namespace

int main() try {
  hp::comm::ProcessGroup world = hp::comm::init_process_group();
  HP_CHECK(world.size() == 4, "collectives_demo needs 4 ranks (hprun --nproc-per-node 4), got ", world.size());
  hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});
  const auto coord = *mesh.get_coordinate();
  std::cout << "world rank " << world.rank() << " at mesh coordinate (" << coord[0] << ", " << coord[1] << ") of "
            << mesh.str() << "\n";

  for (const std::string dim : {"dp", "tp"}) {
    const hp::comm::ProcessGroup& g = mesh.get_group(dim);
    const int n = g.size(), r = g.rank();
    const std::string tag =
        "[" + dim + " ranks " + std::to_string(g.ranks()[0]) + "," + std::to_string(g.ranks()[1]) + "] ";
    const double total = n * (n + 1) / 2.0;  // sum of r+1 over the group

    report(tag + "all_reduce sum", g.all_reduce(contribution(r, 1)), at::full({1, 2}, total));
    report(tag + "all_reduce avg", g.all_reduce(contribution(r, 1), {hp::comm::ReduceOp::kAvg}),
           at::full({1, 2}, total / n));
    report(tag + "all_reduce max", g.all_reduce(contribution(r, 1), {hp::comm::ReduceOp::kMax}),
           at::full({1, 2}, n * 1.0));
    // Uneven all_gather: rank r contributes r+1 rows.
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> expected;
    for (int p = 0; p < n; ++p) {
      sizes.push_back(p + 1);
      expected.push_back(contribution(p, p + 1));
    }
    report(tag + "all_gather (uneven)", g.all_gather(contribution(r, r + 1), {0, sizes}), at::cat(expected));
    // reduce_scatter of 3 rows: rank 0 keeps rows 0-1, rank 1 keeps row 2 (torch.chunk split).
    auto pieces = hp::chunk_sizes(3, n);
    report(tag + "reduce_scatter", g.reduce_scatter(contribution(r, 3)), at::full({pieces[r], 2}, total));
    // all_to_all: row p of every rank goes to rank p, so rank r receives (p+1) from each rank p.
    std::vector<at::Tensor> received;
    for (int p = 0; p < n; ++p) received.push_back(contribution(p, 1));
    report(tag + "all_to_all", g.all_to_all(contribution(r, n)), at::cat(received));
    report(tag + "broadcast from 1", g.broadcast(contribution(r, 1), 1), contribution(1, 1));
    if (r == 0) {
      g.send(contribution(r, 2), 1);
    } else {
      report(tag + "recv from 0", g.recv(at::empty({2, 2}), 0), contribution(0, 2));
    }
    auto work = g.all_reduce_async(contribution(r, 1));
    report(tag + "all_reduce async", work.wait(), at::full({1, 2}, total));
    g.barrier();
  }
  std::cout << (failures == 0 ? "all collectives correct" : std::to_string(failures) + " collectives WRONG") << "\n";
  return failures == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "collectives_demo: " << e.what() << "\n";
  return 1;
}
