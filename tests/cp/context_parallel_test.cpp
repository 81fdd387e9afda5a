// Context parallelism against attention on one rank: ring, all-gather, Ulysses and hybrid (2 x 2)
// on 2 and 4 ranks, causal and not, load-balanced and not, in fp64 (within 1e-12) and fp32 (atol
// 2e-6, rtol 1e-5: PyTorch's own bound), with q/k head dim 24, v head dim 16, a custom scale and
// grouped-query heads (2 key/value heads, so Ulysses over 4 repeats them). out, dq, dk and dv are
// unsharded and compared whole. Plus the communication each mode issues, the work balance the
// head-tail cut gives, and the Llama loss at shard boundaries.
#include <hp/comm/comm_debug_mode.h>
#include <hp/comm/functional.h>
#include <hp/models/llama/model.h>
#include <hp/nn/attention.h>
#include <hp/nn/init.h>
#include <hp/parallel/context_parallel.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr double kScale = 0.3;
constexpr int64_t kSeq = 16;

struct Grads {
  at::Tensor out, dq, dk, dv;
};

// The test's global problem, the same on every rank: b 2, 4 query heads, 2 key/value heads.
struct Problem {
  at::Tensor q, k, v, dout;
  Problem(at::Tensor q_, at::Tensor k_, at::Tensor v_, at::Tensor dout_)
      : q(std::move(q_)), k(std::move(k_)), v(std::move(v_)), dout(std::move(dout_)) {}
  explicit Problem(at::ScalarType dtype)
      : q(rank_data(0, {2, 4, kSeq, 24}, dtype, 1)),
        k(rank_data(0, {2, 2, kSeq, 24}, dtype, 2)),
        v(rank_data(0, {2, 2, kSeq, 16}, dtype, 3)),
        dout(rank_data(0, {2, 4, kSeq, 16}, dtype, 4)) {}
};

// out and the gradients of sum(out * dout) from `core` on q, k, v (leaves made here).
Grads attend(nn::CoreAttention& core, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& dout) {
  const at::Tensor ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(), vl = v.detach().requires_grad_();
  const at::Tensor out = core.call({ql, kl, vl});
  out.backward(dout);
  return {out.detach(), ql.grad(), kl.grad(), vl.grad()};
}

struct CpCase {
  CpMode mode;
  int64_t ulysses = 0;  // hybrid's Ulysses degree
  bool async = false;
};

DeviceMesh cp_mesh(const comm::ProcessGroup& world) { return init_device_mesh(world, "cpu", {world.size()}, {"cp"}); }

std::shared_ptr<nn::CoreAttention> make_core(const DeviceMesh& mesh, const CpCase& c, bool causal, bool balanced) {
  auto core = std::make_shared<nn::CoreAttention>(causal, kScale);
  ContextParallel().set_mode(c.mode).set_load_balance(balanced).set_ulysses_degree(c.ulysses).set_async(c.async).apply(
      *core, "core", mesh);
  return core;
}

// Every (dtype, causal, balanced) combination on `ranks` ranks, against one rank.
void check_against_one_rank(int ranks, const CpCase& c) {
  run(ranks, [&](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = cp_mesh(world);
    const int64_t rank = world.rank();
    for (at::ScalarType dtype : {at::kDouble, at::kFloat})
      for (bool causal : {true, false})
        for (bool balanced : {true, false}) {
          const std::string what = to_string(c.mode) + " on " + std::to_string(ranks) + " ranks, " + dtype_name(dtype) +
                                   (causal ? ", causal" : ", full") + (balanced ? ", balanced" : ", contiguous");
          const Problem p(dtype);
          nn::CoreAttention single(causal, kScale);
          const Grads want = attend(single, p.q, p.k, p.v, p.dout);
          auto core = make_core(mesh, c, causal, balanced);
          auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, ranks, rank, balanced); };
          const Grads local = attend(*core, shard(p.q), shard(p.k), shard(p.v), shard(p.dout));
          const comm::ProcessGroup& group = mesh.get_group(0);
          auto unshard = [&](const at::Tensor& t) { return cp_unshard(t, 2, group, balanced); };
          const double atol = dtype == at::kDouble ? 1e-12 : 2e-6, rtol = dtype == at::kDouble ? 0.0 : 1e-5;
          check_allclose(unshard(local.out), want.out, what + ": out", atol, rtol);
          check_allclose(unshard(local.dq), want.dq, what + ": dq", atol, rtol);
          check_allclose(unshard(local.dk), want.dk, what + ": dk", atol, rtol);
          check_allclose(unshard(local.dv), want.dv, what + ": dv", atol, rtol);
        }
  });
}

TEST(ContextParallel, RingMatchesOneRank) {
  check_against_one_rank(2, {CpMode::kRing});
  check_against_one_rank(4, {CpMode::kRing});
}

TEST(ContextParallel, AllGatherMatchesOneRank) {
  check_against_one_rank(2, {CpMode::kAllGather});
  check_against_one_rank(4, {CpMode::kAllGather});
}

TEST(ContextParallel, UlyssesMatchesOneRank) {
  check_against_one_rank(2, {CpMode::kUlysses});
  check_against_one_rank(4, {CpMode::kUlysses});  // 2 key/value heads repeated for 4 ranks
}

TEST(ContextParallel, HybridMatchesOneRank) { check_against_one_rank(4, {CpMode::kHybrid, 2}); }

// The asynchronous variant: begin(k, v), before the queries exist, issues the exchange of K and V
// (the ring's first, the all-gathers, or Ulysses's all_to_alls of K and V); the call then gives one
// rank's out, dq, dk and dv (fp64, within 1e-12), with the mode's usual communication in all. Keys
// handed over that are not the call's, or were written into since, are exchanged and dropped, and
// the call does its own.
TEST(ContextParallel, AsyncStartsTheExchangeAtBeginAndMatchesOneRank) {
  struct Case {
    int ranks;
    CpCase mode;
    std::string op;  // what begin issues, twice
    int64_t total;   // its operations in all
  };
  for (const Case& c :
       {Case{2, {CpMode::kRing, 0, true}, "send", 4}, Case{4, {CpMode::kRing, 0, true}, "send", 4},
        Case{2, {CpMode::kAllGather, 0, true}, "all_gather", 2}, Case{4, {CpMode::kUlysses, 0, true}, "all_to_all", 2},
        Case{4, {CpMode::kHybrid, 2, true}, "all_to_all", 2}})
    run(c.ranks, [&](const comm::ProcessGroup& world) {
      const std::string what = to_string(c.mode.mode) + " on " + std::to_string(c.ranks) + " ranks, async";
      const DeviceMesh mesh = cp_mesh(world);
      const Problem p(at::kDouble);
      nn::CoreAttention single(true, kScale);
      const Grads want = attend(single, p.q, p.k, p.v, p.dout);
      auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, c.ranks, world.rank()).detach(); };
      auto unshard = [&](const at::Tensor& t) { return cp_unshard(t, 2, world, true); };
      std::string usual;  // what the plan issues without begin
      int64_t usual_total = 0;
      {
        const auto sync = make_core(mesh, {c.mode.mode, c.mode.ulysses}, true, true);
        comm::CommDebugMode without;
        attend(*sync, shard(p.q), shard(p.k), shard(p.v), shard(p.dout));
        usual = without.str();
        usual_total = without.total();
      }
      // The call takes the keys begun; or other ones; or the ones begun, written into since.
      enum class Keys { kBegun, kOther, kWritten };
      for (const Keys keys : {Keys::kBegun, Keys::kOther, Keys::kWritten}) {
        auto core = make_core(mesh, c.mode, true, true);
        const at::Tensor q = shard(p.q).requires_grad_(), k = shard(p.k).requires_grad_(),
                         v = shard(p.v).requires_grad_();
        const at::Tensor v_call = keys == Keys::kWritten ? v * 1.0 : v;
        at::Tensor out;
        {
          comm::CommDebugMode all;
          {
            comm::CommDebugMode at_begin;
            core->begin(keys == Keys::kOther ? k * 1.0 : k, v_call);
            HP_CHECK(at_begin.count(c.op) == 2 && at_begin.total() == c.total, what, ": begin issued ", at_begin.str());
          }
          if (keys == Keys::kWritten) v_call.mul_(1.0);
          out = core->call({q, k, v_call});
          out.backward(shard(p.dout));
          if (keys == Keys::kBegun) {
            HP_CHECK(all.str() == usual, what, ": ", all.str(), " against ", usual, " without begin");
          } else {
            HP_CHECK(all.total() == usual_total + c.total, what, ": ", all.str(), ": begin's and the call's own");
          }
        }
        const std::string how = what + (keys == Keys::kBegun   ? ""
                                        : keys == Keys::kOther ? ", other keys begun"
                                                               : ", keys written into after begin");
        check_allclose(unshard(out.detach()), want.out, how + ": out", 1e-12, 0.0);
        check_allclose(unshard(q.grad()), want.dq, how + ": dq", 1e-12, 0.0);
        check_allclose(unshard(k.grad()), want.dk, how + ": dk", 1e-12, 0.0);
        check_allclose(unshard(v.grad()), want.dv, how + ": dv", 1e-12, 0.0);
      }
    });
}

TEST(ContextParallel, OneRankRingMatches) { check_against_one_rank(1, {CpMode::kRing}); }

TEST(ContextParallel, HeadTailOrder) {
  EXPECT_EQ(head_tail_order(8), (std::vector<int64_t>{0, 7, 1, 6, 2, 5, 3, 4}));
  // Each rank's piece of that order, ascending (so that ring attention sorts nothing).
  EXPECT_TRUE(at::equal(cp_positions(8, 2, 0), at::tensor(std::vector<int64_t>{0, 1, 6, 7})));
  EXPECT_TRUE(at::equal(cp_positions(8, 2, 1), at::tensor(std::vector<int64_t>{2, 3, 4, 5})));
  EXPECT_TRUE(at::equal(cp_positions(16, 4, 3), at::tensor(std::vector<int64_t>{6, 7, 8, 9})));
  EXPECT_TRUE(at::equal(cp_positions(8, 2, 1, false), at::arange(4, 8, at::kLong)));
  expect_error([] { cp_positions(12, 4, 0); }, "must divide by 8 (2 x cp");
  expect_error([] { cp_positions(6, 4, 0, false); }, "must divide by 4 (cp)");
  expect_error([] { cp_mode_named("zigzag"); }, "ring, allgather, ulysses or hybrid");
}

TEST(ContextParallel, UnshardRestoresTheSequence) {
  for (int ranks : {2, 4})
    run(ranks, [&](const comm::ProcessGroup& world) {
      const at::Tensor x = rank_data(0, {3, kSeq, 5}, at::kFloat);
      for (bool balanced : {true, false}) {
        const at::Tensor local = cp_shard(x, 1, ranks, world.rank(), balanced);
        check_close(cp_unshard(local, 1, world, balanced), x, "restore(rearrange(x))", /*bitwise=*/true);
      }
    });
}

// Ring: forward W-1 exchanges of K and V; backward W-1 of K and V and W of their gradient
// accumulators. Ulysses: 4 all_to_alls each way.
TEST(ContextParallel, CommunicationPerMode) {
  for (int ranks : {2, 4})
    run(ranks, [&](const comm::ProcessGroup& world) {
      const DeviceMesh mesh = cp_mesh(world);
      const Problem p(at::kFloat);
      auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, ranks, world.rank()).detach(); };
      const at::Tensor q = shard(p.q).requires_grad_(), k = shard(p.k).requires_grad_(),
                       v = shard(p.v).requires_grad_();
      const int64_t w = ranks, kv_bytes = k.nbytes() + v.nbytes();
      {
        auto core = make_core(mesh, {CpMode::kRing}, true, true);
        comm::CommDebugMode forward;
        const at::Tensor out = core->call({q, k, v});
        HP_CHECK(forward.count("send") == 2 * (w - 1) && forward.count("recv") == 2 * (w - 1) &&
                     forward.total() == 4 * (w - 1),
                 "ring forward: ", forward.str());
        HP_CHECK(forward.bytes("send") == (w - 1) * kv_bytes, "ring forward bytes: ", forward.str());
        comm::CommDebugMode backward;
        out.backward(shard(p.dout));
        // The accumulators are fp32 like K and V here.
        HP_CHECK(backward.count("send") == 2 * (2 * w - 1) && backward.total() == 4 * (2 * w - 1),
                 "ring backward: ", backward.str());
        HP_CHECK(backward.bytes("send") == (2 * w - 1) * kv_bytes, "ring backward bytes: ", backward.str());
      }
      {
        auto core = make_core(mesh, {CpMode::kUlysses}, true, true);
        comm::CommDebugMode forward;
        const at::Tensor out = core->call({q, k, v});
        // k and v: 2 heads, repeated to 4 on 4 ranks before they travel.
        const int64_t kv_sent = w == 4 ? 2 * kv_bytes : kv_bytes;
        HP_CHECK(forward.count("all_to_all") == 4 && forward.total() == 4, "ulysses forward: ", forward.str());
        HP_CHECK(forward.bytes("all_to_all") == static_cast<int64_t>(q.nbytes() + out.nbytes()) + kv_sent,
                 "ulysses forward bytes: ", forward.str());
        comm::CommDebugMode backward;
        out.backward(shard(p.dout));
        HP_CHECK(backward.count("all_to_all") == 4 && backward.total() == 4, "ulysses backward: ", backward.str());
      }
      {
        auto core = make_core(mesh, {CpMode::kAllGather}, true, true);
        comm::CommDebugMode forward;
        const at::Tensor out = core->call({q, k, v});
        HP_CHECK(forward.count("all_gather") == 2 && forward.total() == 2, "allgather forward: ", forward.str());
        comm::CommDebugMode backward;
        out.backward(shard(p.dout));
        HP_CHECK(backward.count("reduce_scatter") == 2 && backward.total() == 2,
                 "allgather backward: ", backward.str());
      }
    });
}

// Causal ring attention: with the head-tail cut every rank computes as many unmasked scores; cut
// contiguously on 2 ranks, the later half of c = S/2 tokens sees c(c+1)/2 + c^2 scores where the
// earlier sees c(c+1)/2: 1 + 2c/(c+1) times the work (2.78 here, 3 as S grows).
TEST(ContextParallel, HeadTailCutBalancesTheWork) {
  for (int ranks : {2, 4})
    for (bool balanced : {true, false}) {
      std::vector<int64_t> work(ranks);
      run(ranks, [&](const comm::ProcessGroup& world) {
        const DeviceMesh mesh = cp_mesh(world);
        const Problem p(at::kFloat);
        auto core = make_core(mesh, {CpMode::kRing}, true, balanced);
        auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, ranks, world.rank(), balanced); };
        nn::AttentionWorkCounter counter;
        core->call({shard(p.q), shard(p.k), shard(p.v)});
        work[world.rank()] = counter.unmasked_scores();
      });
      const int64_t total = std::accumulate(work.begin(), work.end(), int64_t{0});
      EXPECT_EQ(total, 2 * 4 * kSeq * (kSeq + 1) / 2);  // as on one rank
      const double ratio = static_cast<double>(*std::max_element(work.begin(), work.end())) /
                           static_cast<double>(*std::min_element(work.begin(), work.end()));
      if (balanced) {
        EXPECT_EQ(ratio, 1.0) << ranks << " ranks";
      }
      const double c = kSeq / 2.0;
      if (!balanced && ranks == 2) {
        EXPECT_DOUBLE_EQ(ratio, 1.0 + 2.0 * c / (c + 1.0));
      }
    }
}

// What a rank's ring attention keeps between forward and backward (its output and log-sum-exp; q,
// k and v are the caller's) is 1/W of what one rank keeps for the whole sequence, plus the int64
// positions of the tokens (under 5% here, with a v head dim of 64): no ring buffer outlives the
// forward.
TEST(ContextParallel, RingKeepsOneWthOfTheActivationsForBackward) {
  const Problem p(rank_data(0, {2, 4, kSeq, 24}, at::kFloat, 1), rank_data(0, {2, 2, kSeq, 24}, at::kFloat, 2),
                  rank_data(0, {2, 2, kSeq, 64}, at::kFloat, 3), {});
  auto held_after_forward = [&](nn::CoreAttention& core, const Problem& in) {
    const at::Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
                     v = in.v.detach().requires_grad_();
    MemoryTracker tracker;
    const at::Tensor out = core.call({q, k, v});
    return settled_current(tracker);
  };
  nn::CoreAttention single;
  const int64_t one = held_after_forward(single, p);
  for (int ranks : {2, 4})
    run(ranks, [&](const comm::ProcessGroup& world) {
      auto core = make_core(cp_mesh(world), {CpMode::kRing}, true, true);
      auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, ranks, world.rank()); };
      const int64_t mine = held_after_forward(*core, Problem{shard(p.q), shard(p.k), shard(p.v), {}});
      HP_CHECK(mine * ranks >= one && mine * ranks <= one * 105 / 100, "ring on ", ranks, " ranks keeps ", mine,
               " bytes for backward; one rank keeps ", one);
    });
}

// The memory bound: a rank's peak during attention's forward and backward (allocator
// counters) is at most 1/W of one rank's plus 10% of it, for the ring, Ulysses and hybrid (all-gather
// holds every rank's K and V by design), on bench_cp's 4096-token
// causal, head-tail problem. Read two ways:
// - q, k and v made inside the step, as a model's projections make them, and held afterwards only
//   by what attention keeps for backward (the caller holds its output, which the output projection
//   keeps, and dout): ring and Ulysses at W 2 and 4, hybrid 2 x 2. Ulysses keeps its gathered, head-sharded q, k and v
//   where the ring keeps the caller's. Seen to fail (Ulysses 0.685 at W 2, hybrid 0.381 at W 4)
//   with the gathered sequence in rank order, which the kernel copied to sort it.
// - q, k and v the caller's (so not counted): the ring alone, also within 1.1 / W at W 2 (0.549: a
//   margin of about 100 KB of 98 MB, in byte counts that do not vary from run to run; an allocation
//   of the block's size more breaks it, as it should). Seen to fail (0.72 at W 2) with each rank's
//   tokens in head-tail order, which the ring copied to sort them. Ulysses, which holds a second
//   copy of them, is 0.67 at W 2 this way.
TEST(ContextParallel, PeakPerRankIsOneWthOfOneRanksPlusATenth) {
  constexpr int64_t kLong = 4096;
  const at::Tensor q = rank_data(0, {1, 8, kLong, 64}, at::kFloat, 1),
                   k = rank_data(0, {1, 4, kLong, 64}, at::kFloat, 2),
                   v = rank_data(0, {1, 4, kLong, 64}, at::kFloat, 3),
                   dout = rank_data(0, {1, 8, kLong, 64}, at::kFloat, 4);
  const auto peak_of_step = [](nn::CoreAttention& core, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& dout, bool inputs_made_inside) {
    const at::Tensor ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(),
                     vl = v.detach().requires_grad_();
    MemoryTracker tracker;
    // The clones are let go at the end of the statement.
    const at::Tensor out =
        inputs_made_inside ? core.call({ql.clone(), kl.clone(), vl.clone()}) : core.call({ql, kl, vl});
    out.backward(dout);
    return tracker.peak();
  };
  nn::CoreAttention single(true, kScale);
  for (const bool inside : {true, false}) {
    const double one = static_cast<double>(peak_of_step(single, q, k, v, dout, inside));
    std::vector<std::pair<int, CpCase>> cases = {{2, {CpMode::kRing}}, {4, {CpMode::kRing}}};
    if (inside)
      cases.insert(cases.end(), {{2, {CpMode::kUlysses}}, {4, {CpMode::kUlysses}}, {4, {CpMode::kHybrid, 2}}});
    for (const auto& [ranks, mode] : cases) {
      std::vector<double> ratio(ranks);
      run(ranks, [&, ranks = ranks, mode = mode](const comm::ProcessGroup& world) {
        auto core = make_core(cp_mesh(world), mode, true, true);
        auto shard = [&](const at::Tensor& t) { return cp_shard(t, 2, ranks, world.rank()); };
        ratio[world.rank()] = peak_of_step(*core, shard(q), shard(k), shard(v), shard(dout), inside) / one;
      });
      const double worst = *std::max_element(ratio.begin(), ratio.end());
      const std::string what = to_string(mode.mode) + " on " + std::to_string(ranks) + " ranks, q, k, v " +
                               (inside ? "made inside" : "the caller's");
      std::cout << what << ": peak per rank / one rank's = " << worst << "\n";
      EXPECT_LE(worst, 1.0 / ranks + 0.10) << what;
      if (!inside && ranks == 2) {
        EXPECT_LE(worst, 1.1 / ranks) << what;
      }
    }
  }
}

TEST(ContextParallel, BadPlansAreErrors) {
  run(4, [&](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = cp_mesh(world);
    nn::CoreAttention core;
    for (int64_t degree : {0, 1, 3, 4})
      expect_error(
          [&] { ContextParallel().set_mode(CpMode::kHybrid).set_ulysses_degree(degree).check(core, "c", mesh); },
          "must be above 1, below cp and divide cp (4)");
    nn::RMSNorm norm(8);
    expect_error([&] { ContextParallel().check(norm, "norm", mesh); }, "applies to CoreAttention modules; norm is");
    // Ulysses over 4 ranks: 6 query heads do not split; 3 key/value heads neither split nor repeat evenly.
    auto ulysses = make_core(mesh, {CpMode::kUlysses}, true, true);
    const at::Tensor q6 = at::zeros({1, 6, 4, 8}), k2 = at::zeros({1, 2, 4, 8});
    expect_error(
        [&] {
          ulysses->call({q6, k2, k2});
        },
        "6 query heads (on this rank) do not divide by the Ulysses degree 4");
    const at::Tensor q12 = at::zeros({1, 12, 4, 8}), k3 = at::zeros({1, 3, 4, 8});
    expect_error([&] { ulysses->call({q12, k3, k3}); }, "3 key/value heads");
  });
}

// The test Llama in fp64 on a sequence of 8, with the loss summed over this rank's tokens and
// divided by the global token count: CP 2 and 4 give CP 1's loss and gradients, with every layer's
// attention in ring or Ulysses mode, or one mode per layer (ring for layer 0, Ulysses for layer 1:
// the forward then sends the ring's K/V and makes Ulysses's 4 all_to_alls).
TEST(ContextParallel, LlamaLossAtShardBoundaries) {
  models::LlamaConfig config;
  config.max_seq = 8;
  const int64_t seq = 8, batch = 2;
  const at::Tensor stream = at::randint(0, config.vocab, {batch, seq + 1}, at::make_generator<at::CPUGeneratorImpl>(7),
                                        at::TensorOptions(at::kLong));
  // Labels shifted before sharding: token t predicts token t + 1.
  const at::Tensor tokens = stream.narrow(1, 0, seq), labels = stream.narrow(1, 1, seq);
  auto build = [&] {
    auto model = std::make_shared<models::Llama>(config);
    nn::init_parameters(*model, 5);
    model->to(at::kDouble);
    return model;
  };
  auto loss_sum = [](const at::Tensor& logits, const at::Tensor& targets) {
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {}, at::Reduction::Sum);
  };
  auto single = build();
  const at::Tensor want = loss_sum((*single)(tokens), labels) / (batch * seq);
  want.backward();
  const ContextParallel ring = ContextParallel().set_mode(CpMode::kRing),
                        ulysses = ContextParallel().set_mode(CpMode::kUlysses);
  const std::vector<std::pair<std::string, ParallelizePlan>> plans = {
      {"ring", {{"layers.*.attn.core", ring}}},
      {"ulysses", {{"layers.*.attn.core", ulysses}}},
      {"ring then ulysses", {{"layers.0.attn.core", ring}, {"layers.1.attn.core", ulysses}}}};
  ASSERT_EQ(config.layers, 2);
  for (int ranks : {2, 4})
    for (const auto& [name, plan] : plans)
      run(ranks, [&](const comm::ProcessGroup& world) {
        auto model = build();
        const DeviceMesh mesh = cp_mesh(world);
        parallelize_module(*model, mesh, plan);
        auto shard = [&](const at::Tensor& t) { return cp_shard(t, 1, ranks, world.rank()); };
        // This rank's share of the loss; backward from it gives this rank's share of the gradients.
        comm::CommDebugMode forward;
        const at::Tensor local = loss_sum((*model)(shard(tokens)), shard(labels)) / (batch * seq);
        if (plan.size() == 2)
          HP_CHECK(forward.count("send") == 2 * (ranks - 1) && forward.count("all_to_all") == 4,
                   "one mode per layer, forward: ", forward.str());
        local.backward();
        const at::Tensor loss = world.all_reduce(local.detach().clone());
        const std::string what = name + " on " + std::to_string(ranks) + " ranks";
        check_allclose(loss, want.detach(), what + ": loss", 1e-12, 0.0);
        for (const auto& item : model->named_parameters()) {
          // Each rank's gradient is its tokens' share; their sum is the whole gradient.
          const at::Tensor grad = world.all_reduce(item.value().grad().clone());
          check_allclose(grad, single->named_parameters()[item.key()].grad(), what + ": grad of " + item.key(), 1e-12,
                         1e-12);
        }
      });
}

}  // namespace
}  // namespace hp::test
