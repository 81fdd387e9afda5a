// Expert parallelism against one device: the regroup index in every small case, the dispatch and
// combine round trip (bitwise, gradient ones), and a MoE layer on 1, 2 and 4 expert-parallel
// ranks equal to the single-device layer on the ranks' batches concatenated, with the
// collectives the header promises.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <mutex>

#include "hp/comm/comm_debug_mode.h"
#include "hp/core/host_sync.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/init.h"
#include "hp/parallel/expert_parallel.h"
#include "hp/parallel/parallel_dims.h"
#include "test_util.h"

namespace hp::test {
namespace {

// Every count vector with entries 0..2 for 1..3 ranks x 1..3 local experts (this covers experts
// with no rows, no rows at all, one rank and one expert): the received rows, labelled (source,
// expert, i), come out ordered by expert, then source, then i.
TEST(ExpertParallel, ExpertMajorOrderInEverySmallCase) {
  int64_t cases = 0;
  for (int64_t ranks = 1; ranks <= 3; ++ranks)
    for (int64_t local = 1; local <= 3; ++local) {
      const int64_t n = ranks * local;
      if (n > 6) continue;  // 3^6 vectors at most
      std::vector<int64_t> counts(n, 0);
      for (;;) {
        std::vector<std::tuple<int64_t, int64_t, int64_t>> received;  // (expert, source, i), rank-major
        for (int64_t src = 0; src < ranks; ++src)
          for (int64_t e = 0; e < local; ++e)
            for (int64_t i = 0; i < counts[src * local + e]; ++i) received.emplace_back(e, src, i);
        const std::vector<int64_t> order = expert_major_order(counts, ranks, local);
        ASSERT_EQ(order.size(), received.size());
        auto want = received;
        std::sort(want.begin(), want.end());
        for (size_t i = 0; i < order.size(); ++i) ASSERT_EQ(received.at(order[i]), want[i]) << "row " << i;
        ++cases;
        int64_t d = 0;  // next count vector (base 3)
        while (d < n && counts[d] == 2) counts[d++] = 0;
        if (d == n) break;
        ++counts[d];
      }
    }
  EXPECT_EQ(cases, 3 + 9 + 27 + 9 + 81 + 729 + 27 + 729);
  expect_error([] { expert_major_order({1, 2, 3}, 2, 2); }, "3 counts for 2 ranks x 2 experts");
}

// Identity experts, gates of 1/k: the dispatch and combine give every row back bitwise and the
// gradient of their sum is ones; each rank's experts see their rows grouped by expert.
TEST(ExpertParallel, DispatchAndCombineRoundTripIsBitwise) {
  for (const int world : {2, 4}) {
    // Per case, rows per expert on each rank: spread, some experts empty, all on one expert.
    const std::vector<std::function<int64_t(int rank, int64_t expert)>> layouts = {
        [](int rank, int64_t e) { return (rank + e) % 3; },
        [](int rank, int64_t e) { return e % 2 == 0 ? 0 : rank + 1; },
        [](int, int64_t e) { return e == 1 ? 5 : 0; },
    };
    const int64_t experts = 2 * world;
    for (size_t c = 0; c < layouts.size(); ++c) {
      run(world, [&](const comm::ProcessGroup& group) {
        std::vector<int64_t> counts(experts);
        int64_t rows = 0;
        for (int64_t e = 0; e < experts; ++e) rows += counts[e] = layouts[c](group.rank(), e);
        const at::Tensor x =
            rank_data(group.rank(), {rows, 6}, at::kFloat, static_cast<int>(c)).set_requires_grad(true);
        const auto dispatcher = expert_parallel_dispatcher(group, experts);
        const at::Tensor out = dispatcher->run(x, at::tensor(counts, at::kLong),
                                               [&](const at::Tensor& r, const std::vector<int64_t>& local) {
                                                 int64_t want = 0;
                                                 for (int src = 0; src < world; ++src)
                                                   for (int64_t e = 0; e < 2; ++e)
                                                     want += layouts[c](src, group.rank() * 2 + e);
                                                 EXPECT_EQ(local[0] + local[1], want);
                                                 EXPECT_EQ(r.size(0), want);
                                                 return r * 1.0;  // identity, through autograd
                                               },
                                               nn::CapacityOverflow{}, {});
        const at::Tensor combined = out * 0.5 + out * 0.5;  // k = 2, gates 1/k
        check_close(combined, x.detach(), "round trip, layout " + std::to_string(c), /*bitwise=*/true);
        combined.sum().backward();
        check_close(x.grad(), at::ones_like(x), "gradient of the round trip", /*bitwise=*/true);
      });
    }
  }
}

nn::MoEOptions layer_options(bool shared) {
  nn::MoEOptions o;
  o.router.experts = 8;
  o.router.top_k = 2;
  o.router.norm_topk_prob = true;
  o.hidden = 24;
  o.shared_hidden = shared ? 16 : 0;
  return o;
}

struct LayerRun {
  at::Tensor out;                           // [ranks * batch, seq, dim]
  std::map<std::string, at::Tensor> grads;  // whole gradients, summed over ranks
  std::map<std::string, int64_t> forward_comm, backward_comm;
  int64_t forward_host_syncs = -1, backward_host_syncs = -1;  // rank 0's
};

// The layer on `world` data-parallel ranks, each with its own batch of `batch` sequences, with
// expert parallelism over `ep` of them (hp::build_expert_mesh: ep borrowed from dp_shard).
LayerRun run_layer(int world, int ep, bool shared, int64_t batch, at::ScalarType dtype = at::kFloat) {
  LayerRun result;
  std::mutex mu;
  std::vector<at::Tensor> outs(world), input_grads(world);
  run(world, [&](const comm::ProcessGroup& group) {
    nn::MoE moe(16, layer_options(shared));
    moe.to(dtype);  // the parameters have no storage yet: init_parameters allocates them in dtype
    ParallelDims dims;
    dims.dp_shard = world;
    dims.ep = ep;
    dims.validate(world);
    const DeviceMesh mesh = build_expert_mesh(group, dims);
    if (ep > 1) parallelize_module(moe, mesh["ep"], {{"", ExpertParallel()}});
    const bool ep_lead = mesh.get_local_rank("ep") == 0;
    nn::init_parameters(moe, 7);
    const at::Tensor x = rank_data(group.rank(), {batch, 5, 16}, dtype, 3).set_requires_grad(true);
    const at::Tensor weights = rank_data(group.rank(), {batch, 5, 16}, dtype, 4);
    at::Tensor out;
    int64_t forward_all_to_all = 0, backward_all_to_all = 0, forward_syncs = 0, backward_syncs = 0;
    {
      comm::CommDebugMode forward;
      HostSyncCount syncs;
      out = moe(x);
      forward_all_to_all = forward.count("all_to_all");
      forward_syncs = syncs.count();
    }
    {
      comm::CommDebugMode backward;
      HostSyncCount syncs;
      (out * weights).sum().backward();
      backward_all_to_all = backward.count("all_to_all");
      backward_syncs = syncs.count();
    }
    // Expert weights are sharded over ep (whole() gathers them, a collective, the same on the ranks
    // of one ep group): sum over the groups, once per group. The router and shared experts are
    // replicated, each rank holding its batch's gradient: sum over every rank.
    std::vector<std::tuple<std::string, at::Tensor, bool>> grads;
    for (const auto& item : moe.named_parameters())
      if (item.value().requires_grad())
        grads.emplace_back(item.key(), whole(item.value().grad()), is_dtensor(item.value()));
    std::lock_guard<std::mutex> lock(mu);
    outs[group.rank()] = out.detach();
    input_grads[group.rank()] = x.grad();
    result.forward_comm["all_to_all"] = forward_all_to_all;
    result.backward_comm["all_to_all"] = backward_all_to_all;
    if (group.rank() == 0) {
      result.forward_host_syncs = forward_syncs;
      result.backward_host_syncs = backward_syncs;
    }
    for (const auto& [name, grad, sharded] : grads) {
      auto& slot = result.grads[name];
      if (sharded && !ep_lead) continue;
      slot = !slot.defined() ? grad.clone() : slot + grad;
    }
  });
  result.out = at::cat(outs, 0);
  result.grads["input"] = at::cat(input_grads, 0);
  return result;
}

// The layer on one device over the ranks' batches concatenated (rank r's batch is rank_data(r)),
// computed in the pieces the ranks compute: with this BLAS a GEMM row's result depends on the
// GEMM's row count (rows of a [30, 16] x [16, 8] product differ in the last bit from the same rows
// of a [120, 16] one), so a GEMM over more rows cannot be bitwise the ranks' GEMMs. The dense GEMMs
// (the router's gate, the shared experts) run on each rank's rows; the routed experts on each
// expert-parallel group's rows (all of them for ep = world: what expert parallelism distributes).
// `whole_call` is instead one forward of the layer over the concatenated batch.
LayerRun run_layer_on_one_device(int world, int ep, bool shared, int64_t batch, at::Tensor* whole_call = nullptr,
                                 at::ScalarType dtype = at::kFloat) {
  LayerRun result;
  nn::MoE moe(16, layer_options(shared));
  moe.to(dtype);
  nn::init_parameters(moe, 7);
  std::vector<at::Tensor> xs, ws;
  for (int r = 0; r < world; ++r) {
    xs.push_back(rank_data(r, {batch, 5, 16}, dtype, 3));
    ws.push_back(rank_data(r, {batch, 5, 16}, dtype, 4));
  }
  const at::Tensor x = at::cat(xs, 0).set_requires_grad(true);
  if (whole_call) *whole_call = moe(x).detach();
  const at::Tensor tokens = x.reshape({-1, 16});
  const int64_t per_rank = batch * 5;
  std::vector<at::Tensor> routed, shared_out;
  for (int group = 0; group < world / ep; ++group) {
    std::vector<at::Tensor> experts, gates;
    nn::Routing routing;
    routing.counts = at::zeros({8}, at::kLong);
    for (int r = group * ep; r < (group + 1) * ep; ++r) {
      const at::Tensor mine = tokens.narrow(0, r * per_rank, per_rank);
      const nn::Routing part = moe.router->route(mine);
      experts.push_back(part.experts);
      gates.push_back(part.gates);
      routing.counts += part.counts;
      if (moe.shared) shared_out.push_back((*moe.shared)(mine));
    }
    routing.experts = at::cat(experts, 0);
    routing.gates = at::cat(gates, 0);
    routed.push_back(moe.routed_output(tokens.narrow(0, group * ep * per_rank, ep * per_rank), routing));
  }
  at::Tensor out = at::cat(routed, 0);
  if (moe.shared) out = out + at::cat(shared_out, 0);
  out = out.view(x.sizes());
  (out * at::cat(ws, 0)).sum().backward();
  result.out = out.detach();
  for (const auto& item : moe.named_parameters())
    if (item.value().requires_grad()) result.grads[item.key()] = item.value().grad();
  result.grads["input"] = x.grad();
  return result;
}

TEST(ExpertParallel, MoELayerMatchesOneDevice) {
  for (const bool shared : {false, true})
    for (const auto& [world, ep_degree] : std::vector<std::pair<int, int>>{{1, 1}, {2, 2}, {4, 4}, {4, 2}}) {
      const std::string what = "ep " + std::to_string(ep_degree) + " of dp_shard " + std::to_string(world) +
                               (shared ? ", shared experts" : "");
      at::Tensor whole_call;
      const LayerRun ep = run_layer(world, ep_degree, shared, 3),
                     one = run_layer_on_one_device(world, ep_degree, shared, 3, &whole_call);
      check_close(ep.out, one.out, what + ": output", /*bitwise=*/true);
      check_relative(ep.out, whole_call, what + ": output against one call over the whole batch", 1e-6);
      ASSERT_EQ(ep.grads.size(), one.grads.size());
      for (const auto& [name, grad] : one.grads) check_relative(ep.grads.at(name), grad, what + ": " + name, 1e-6);
      // 3 all_to_alls forward (counts, dispatch, combine), 2 backward; none on one rank. One host
      // read of device data in forward (the counts, with the received ones under EP), none in backward.
      EXPECT_EQ(ep.forward_comm.at("all_to_all"), ep_degree > 1 ? 3 : 0) << what;
      EXPECT_EQ(ep.backward_comm.at("all_to_all"), ep_degree > 1 ? 2 : 0) << what;
      EXPECT_EQ(ep.forward_host_syncs, 1) << what;
      EXPECT_EQ(ep.backward_host_syncs, 0) << what;
    }
}

// The shared experts run after the dispatch all_to_all is issued and before the experts and the
// combine (2 all_to_alls issued when they start; 3 with overlap_shared off, when they run after the
// routed experts); the output and every gradient are the same bitwise either way.
TEST(ExpertParallel, SharedExpertsRunWhileTheDispatchIsInFlight) {
  run(2, [&](const comm::ProcessGroup& group) {
    std::map<bool, std::pair<at::Tensor, std::vector<at::Tensor>>> results;
    for (const bool overlap : {true, false}) {
      nn::MoEOptions o = layer_options(/*shared=*/true);
      o.overlap_shared = overlap;
      nn::MoE moe(16, o);
      parallelize_module(moe, init_device_mesh(group, "cpu", {2}, {"ep"}), {{"", ExpertParallel()}});
      nn::init_parameters(moe, 7);
      comm::CommDebugMode comm;
      int64_t issued_before_shared = -1;
      moe.shared->register_forward_pre_hook(
          [&](nn::Module&, nn::Inputs&) { issued_before_shared = comm.count("all_to_all"); });
      const at::Tensor x = rank_data(group.rank(), {3, 5, 16}, at::kFloat, 3);
      const at::Tensor out = moe(x);
      if (issued_before_shared != (overlap ? 2 : 3))
        throw std::runtime_error(std::string(overlap ? "with" : "without") +
                                 " the overlap, the shared experts ran after " + std::to_string(issued_before_shared) +
                                 " all_to_alls");
      out.sum().backward();
      std::vector<at::Tensor> grads;
      for (const auto& item : moe.named_parameters()) grads.push_back(whole(item.value().grad()));
      results[overlap] = {out.detach(), grads};
    }
    check_close(results[true].first, results[false].first, "output", /*bitwise=*/true);
    for (size_t i = 0; i < results[true].second.size(); ++i)
      check_close(results[true].second[i], results[false].second[i], "gradient " + std::to_string(i), true);
  });
}

// The same in fp64 (the router then computes in fp64 too): outputs bitwise, and within 1e-12
// relative of one call over the whole batch (a router in fp32 would be ~1e-7 off); every gradient
// within 1e-12 relative.
TEST(ExpertParallel, MoELayerMatchesOneDeviceInFp64) {
  for (const auto& [world, ep_degree] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}}) {
    const std::string what = "fp64, ep " + std::to_string(ep_degree) + " of dp_shard " + std::to_string(world);
    at::Tensor whole_call;
    const LayerRun ep = run_layer(world, ep_degree, true, 3, at::kDouble),
                   one = run_layer_on_one_device(world, ep_degree, true, 3, &whole_call, at::kDouble);
    ASSERT_EQ(ep.out.scalar_type(), at::kDouble);
    check_close(ep.out, one.out, what + ": output", /*bitwise=*/true);
    check_relative(ep.out, whole_call, what + ": output against one call over the whole batch", 1e-12);
    for (const auto& [name, grad] : one.grads) {
      ASSERT_EQ(grad.scalar_type(), at::kDouble) << name;
      check_relative(ep.grads.at(name), grad, what + ": " + name, 1e-12);
    }
  }
}

// Under the error policy, a rank whose rows overflow an expert's capacity stops every rank of the
// expert-parallel group with the same error, naming that rank; none waits in a collective.
TEST(ExpertParallel, ACapacityOverflowStopsEveryRankNamingTheRank) {
  std::vector<std::string> errors(2);
  run(2, [&](const comm::ProcessGroup& group) {
    const DeviceMesh mesh = init_device_mesh(group, "cpu", {2}, {"ep"});
    nn::MoEOptions o = layer_options(false);
    o.router.top_k = 1;
    o.capacity_factor = 1.0;
    nn::MoE moe(16, o);
    parallelize_module(moe, mesh, {{"", ExpertParallel()}});
    nn::init_parameters(moe, 3);
    const int64_t experts = o.router.experts;
    nn::Routing routing;  // 8 tokens: rank 1 sends all of them to expert 1, over its capacity of 1
    routing.experts =
        group.rank() == 1 ? at::ones({8, 1}, at::kLong) : at::arange(8, at::kLong).remainder(experts).view({8, 1});
    routing.gates = at::ones({8, 1});
    routing.counts = at::bincount(routing.experts.view({-1}), {}, experts);
    try {
      moe.routed_output(at::randn({8, 16}), routing);
    } catch (const Error& e) {
      errors[group.rank()] = e.what();
    }
  });
  for (const std::string& error : errors)
    EXPECT_NE(error.find("rank 1: expert 1 got 8 rows, over its capacity of"), std::string::npos) << error;
}

TEST(ExpertParallel, RefusesWhatItCannotSplit) {
  run(2, [&](const comm::ProcessGroup& group) {
    const DeviceMesh mesh = init_device_mesh(group, "cpu", {2}, {"ep"});
    nn::MoEOptions o = layer_options(false);
    o.router.experts = 3;
    o.router.top_k = 1;
    nn::MoE moe(16, o);
    expect_error(
        [&] {
          parallelize_module(moe, mesh, {{"", ExpertParallel()}});
        },
        "has 3 experts, which do not split evenly over 2 expert-parallel ranks");
    expect_error(
        [&] {
          parallelize_module(*moe.router, mesh, {{"", ExpertParallel()}});
        },
        "applies to hp::nn::MoE modules");
  });
}

}  // namespace
}  // namespace hp::test
