// The distributed RNG: random values never depend on the sharding, replicated tensors agree on
// every rank, streams advance and re-seeding repeats them.
#include <ATen/ATen.h>
#include <hp/core/error.h>
#include <hp/dtensor/random.h>

#include "test_util.h"

namespace hp::test {
namespace {

std::vector<Placements> layouts(const DeviceMesh& mesh) {
  std::vector<Placements> out;
  for (const Placement& p : {Shard(0), Shard(1), Replicate()}) {
    if (mesh.ndim() == 1)
      out.push_back({p});
    else
      for (const Placement& q : {Shard(0), Shard(1), Replicate()}) out.push_back({p, q});
  }
  return out;
}

at::Tensor full(const at::Tensor& t) { return DTensor(t).full_tensor(); }

// rand/randn and dropout give the same full tensor for every placement (uneven 7x5 pieces on 3
// ranks and on a (2, 2) mesh), bitwise, and replicated results agree across ranks.
TEST(DistributedRng, ValuesDoNotDependOnTheSharding) {
  for (int world : {3, 4}) {
    run(world, [world](const comm::ProcessGroup& g) {
      DeviceMesh mesh =
          world == 4 ? init_device_mesh(g, "cpu", {2, 2}, {"a", "b"}) : init_device_mesh(g, "cpu", {3}, {"a"});
      at::Tensor want_normal, want_uniform, want_mask;
      for (const Placements& p : layouts(mesh)) {
        manual_seed(mesh, 1234);
        at::Tensor normal = full(randn({7, 5}, mesh, p));
        at::Tensor uniform = full(rand({7, 5}, mesh, p));
        at::Tensor mask = full(at::dropout(distribute_tensor(at::ones({7, 5}), mesh, p), 0.4, /*train=*/true));
        if (!want_normal.defined()) {
          want_normal = normal, want_uniform = uniform, want_mask = mask;
          continue;
        }
        check_close(normal, want_normal, "randn with " + to_string(p), /*bitwise=*/true);
        check_close(uniform, want_uniform, "rand with " + to_string(p), true);
        check_close(mask, want_mask, "dropout mask with " + to_string(p), true);
      }
      // Replicated: every rank draws the same values itself (its own piece, nothing gathered),
      // equal to rank 0's and to the sharded draws.
      manual_seed(mesh, 1234);
      const at::Tensor mine = DTensor(randn({7, 5}, mesh, Placements(mesh.ndim(), Replicate()))).to_local();
      check_close(g.broadcast(mine.clone(), 0), mine, "replicated values agree across ranks", true);
      check_close(mine, want_normal, "replicated values equal the sharded ones", true);
    });
  }
}

// Each op takes a new stream (two draws differ); re-seeding repeats the sequence; the values look
// like the distributions they claim (100k samples: mean and std within 0.02, uniform in [0, 1)).
TEST(DistributedRng, StreamsAdvanceAndSeedsRepeat) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    manual_seed(mesh, 5);
    at::Tensor first = full(randn({100000}, mesh, {Shard(0)}));
    at::Tensor second = full(randn({100000}, mesh, {Shard(0)}));
    if (at::equal(first, second)) throw std::runtime_error("two draws gave the same values");
    manual_seed(mesh, 5);
    check_close(full(randn({100000}, mesh, {Shard(0)})), first, "re-seeded draw", true);
    const double mean = first.mean().item<double>(), std = first.std().item<double>();
    if (std::abs(mean) > 0.02 || std::abs(std - 1.0) > 0.02)
      throw std::runtime_error("randn mean " + std::to_string(mean) + " std " + std::to_string(std));
    at::Tensor u = full(rand({100000}, mesh, {Shard(0)}));
    if (u.min().item<double>() < 0 || u.max().item<double>() >= 1 || std::abs(u.mean().item<double>() - 0.5) > 0.02)
      throw std::runtime_error("rand is not uniform in [0, 1)");
  });
}

// A generator argument is refused (the mesh's RNG is the only source), as is filling a Partial tensor.
TEST(DistributedRng, ClearErrors) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    DTensor x = distribute_tensor(at::zeros({4}), mesh, {Shard(0)});
    try {
      x.uniform_(0, 1, at::make_generator<at::CPUGeneratorImpl>(1));
      throw std::runtime_error("a generator was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find("pass no generator") == std::string::npos) throw;
    }
    DTensor partial(distribute_tensor(at::ones({4, 2}), mesh, {Shard(0)}).sum(0));
    try {
      partial.normal_();
      throw std::runtime_error("a Partial tensor was filled");
    } catch (const Error& e) {
      if (std::string(e.what()).find("redistribute it to Replicate first") == std::string::npos) throw;
    }
  });
}

}  // namespace
}  // namespace hp::test
