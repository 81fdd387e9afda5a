// The CPU attention kernel against attention written out (repeat the key/value heads, scores,
// mask by position, softmax, mix) and differentiated by autograd: out, dq, dk and dv within 1e-12
// in fp64 and PyTorch's fp32 bound (atol 2e-6, rtol 1e-5); with q/k head dim 24 and v head dim 16,
// a custom scale, grouped-query heads, blocks of 3 query rows, and tokens in any order. Plus the
// pieces ring attention is built from: merging partial results over key blocks, and backward of a
// key block against the global out and lse.
#include <ATen/core/dispatch/Dispatcher.h>
#include <hp/core/dispatch_mode.h>
#include <hp/dtensor/random.h>
#include <hp/nn/attention.h>

#include <map>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr double kScale = 0.3;

struct Qkv {
  at::Tensor q, k, v;
};

// b 2, 4 query heads, 2 key/value heads, qk head dim 24, v head dim 16.
Qkv make_qkv(int64_t sq, int64_t sk, at::ScalarType dtype, int salt = 0) {
  return {rank_data(0, {2, 4, sq, 24}, dtype, salt + 1), rank_data(0, {2, 2, sk, 24}, dtype, salt + 2),
          rank_data(0, {2, 2, sk, 16}, dtype, salt + 3)};
}

at::Tensor iota(int64_t n) { return at::arange(n, at::kLong); }

// Attention written out with autograd ops, in the inputs' dtype.
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const nn::AttentionMask& m,
                           double scale) {
  const int64_t rep = q.size(1) / k.size(1);
  at::Tensor scores = at::matmul(q, k.repeat_interleave(rep, 1).transpose(-2, -1)) * scale;
  const at::Tensor qp = m.q_positions.defined() ? m.q_positions : iota(q.size(2));
  const at::Tensor kp = m.k_positions.defined() ? m.k_positions : iota(k.size(2));
  if (m.causal) scores = scores.masked_fill(kp.unsqueeze(0) > qp.unsqueeze(1), -INFINITY);
  return at::matmul(at::softmax(scores, -1), v.repeat_interleave(rep, 1));
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// out and the gradients of sum(out * dout).
template <typename Fn>
Result run_with_grad(const Qkv& in, const at::Tensor& dout, Fn fn) {
  const at::Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
                   v = in.v.detach().requires_grad_();
  const at::Tensor out = fn(q, k, v);
  out.backward(dout);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void check_result(const Result& got, const Result& want, const std::string& what, double atol, double rtol) {
  check_allclose(got.out, want.out, what + ": out", atol, rtol);
  check_allclose(got.dq, want.dq, what + ": dq", atol, rtol);
  check_allclose(got.dk, want.dk, what + ": dk", atol, rtol);
  check_allclose(got.dv, want.dv, what + ": dv", atol, rtol);
}

// bf16: the kernel's products round their factors (and their results, but for the probabilities'
// gradient) to bf16, as attention written out in bf16 does, so it is held to the error attention
// written out in bf16 makes against fp64: each of out, dq, dk and dv within three times that
// error's largest element, plus 1e-3 (measured: at most 2.2 times).
void check_bf16_result(const Result& got, const Result& want, const Result& naive) {
  const auto largest_error = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  };
  const std::vector<std::tuple<const char*, at::Tensor, at::Tensor, at::Tensor>> parts = {
      {"out", got.out, want.out, naive.out},
      {"dq", got.dq, want.dq, naive.dq},
      {"dk", got.dk, want.dk, naive.dk},
      {"dv", got.dv, want.dv, naive.dv}};
  for (const auto& [name, g, w, n] : parts) {
    const double bound = 3.0 * largest_error(n, w) + 1e-3;
    check_allclose(g, w, std::string("bf16: ") + name, bound, 0.0);
  }
}

// (dtype, causal, query block, tokens shuffled)
class AttentionKernelCase : public ::testing::TestWithParam<std::tuple<at::ScalarType, bool, int64_t, bool>> {};

TEST_P(AttentionKernelCase, MatchesAttentionWrittenOut) {
  const auto [dtype, causal, block, shuffled] = GetParam();
  const int64_t s = 10;
  const Qkv in = make_qkv(s, s, dtype);
  const at::Tensor dout = rank_data(0, {2, 4, s, 16}, dtype, 9);
  // Shuffled: the same tokens in another order (as a context-parallel shard holds them).
  const at::Tensor positions = shuffled ? at::tensor(std::vector<int64_t>{3, 9, 0, 7, 1, 8, 2, 6, 4, 5}) : iota(s);
  const nn::AttentionMask mask{causal, positions, positions};
  const auto kernel = nn::cpu_attention_kernel(block);
  const Result got = run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return nn::attention(kernel, q, k, v, mask, kScale);
  });
  // The reference in fp64 from the same (rounded) inputs.
  const Qkv in64{in.q.to(at::kDouble), in.k.to(at::kDouble), in.v.to(at::kDouble)};
  const Result want =
      run_with_grad(in64, dout.to(at::kDouble), [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
        return naive_attention(q, k, v, mask, kScale);
      });
  EXPECT_EQ(got.out.scalar_type(), dtype);
  EXPECT_EQ(got.dq.scalar_type(), dtype);
  try {
    if (dtype == at::kDouble) check_result(got, want, "fp64", 1e-12, 0.0);
    if (dtype == at::kFloat) check_result(got, want, "fp32", 2e-6, 1e-5);
    if (dtype == at::kBFloat16)
      check_bf16_result(got, want,
                        run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                          return naive_attention(q, k, v, mask, kScale);
                        }));
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(AttentionKernel, AttentionKernelCase,
                         ::testing::Combine(::testing::Values(at::kDouble, at::kFloat, at::kBFloat16),
                                            ::testing::Bool(), ::testing::Values<int64_t>(3, 256), ::testing::Bool()));

// How many matrix products a region runs with factors of each dtype.
struct ProductDtypes : DispatchMode {
  std::map<at::ScalarType, int> seen;
  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
    const std::string name = op_name(op);
    if (name == "aten::mm" || name == "aten::bmm") ++seen[(*stack)[stack->size() - 2].toTensor().scalar_type()];
    run_below(op, keys, stack);
  }
};

// bf16 inputs: the products take bf16 factors (the CPU's bf16 units, fp32 accumulation inside),
// but for the probabilities' gradient, one per query block in backward; fp32 inputs keep fp32
// products. 10 queries in blocks of 4: 3 blocks, 2 products each forward and 5 backward.
TEST(AttentionKernel, ProductsRunInTheInputsLowPrecisionDtype) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const Qkv in = make_qkv(10, 10, dtype);
    ProductDtypes products;
    {
      DispatchModeGuard on(products);
      run_with_grad(
          in, rank_data(0, {2, 4, 10, 16}, dtype, 9),
          [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
            return nn::attention(nn::cpu_attention_kernel(4), q, k, v, nn::AttentionMask{true, {}, {}}, kScale);
          });
    }
    const std::map<at::ScalarType, int> want =
        dtype == at::kFloat ? std::map<at::ScalarType, int>{{at::kFloat, 21}}
                            : std::map<at::ScalarType, int>{{at::kBFloat16, 18}, {at::kFloat, 3}};
    EXPECT_EQ(products.seen, want) << dtype;
  }
}

// Probability dropout (AttentionDropout): the kernel's out and gradients against attention written
// out with the documented mask (element ((row * heads + head) * 2^21 + q position) * 2^21 + k
// position of the Philox stream), within 1e-12 in fp64: rows 1..2 of the batch, query heads 2..5
// of 8, shuffled positions, blocks of 3 query rows. Key blocks (ring attention) merge and
// differentiate to the whole with dropout too.
TEST(AttentionKernel, DropoutMatchesAttentionWrittenOut) {
  const int64_t s = 10;
  const Qkv in = make_qkv(s, s, at::kDouble);
  const at::Tensor dout = rank_data(0, {2, 4, s, 16}, at::kDouble, 9);
  const at::Tensor positions = at::tensor(std::vector<int64_t>{3, 9, 0, 7, 1, 8, 2, 6, 4, 5});
  nn::AttentionMask mask{true, positions, positions, {0.3, 17, 5, 1, 4, 2, 8}};
  const Result got = run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return nn::attention(nn::cpu_attention_kernel(3), q, k, v, mask, kScale);
  });
  const int64_t two21 = int64_t{1} << 21;
  const at::Tensor row_head =
      (at::arange(1, 3, at::kLong).view({2, 1}) * 8 + at::arange(2, 6, at::kLong)).view({2, 4, 1, 1});
  const at::Tensor index = (row_head * two21 + positions.view({1, 1, s, 1})) * two21 + positions.view({1, 1, 1, s});
  at::Tensor keep = at::empty({2, 4, s, s}, at::kDouble);
  philox_fill_at(keep, index, 17, 5, RandomFill::kBernoulli, 0.7, 0.0);
  const Result want = run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    at::Tensor scores = at::matmul(q, k.repeat_interleave(2, 1).transpose(-2, -1)) * kScale;
    scores = scores.masked_fill(positions.unsqueeze(0) > positions.unsqueeze(1), -INFINITY);
    return at::matmul(at::softmax(scores, -1) * keep / 0.7, v.repeat_interleave(2, 1));
  });
  check_result(got, want, "dropout", 1e-12, 0.0);
  EXPECT_GT((keep == 0.0).sum().item<int64_t>(), 0) << "something is dropped";
  // Key blocks: the first 4 tokens and the other 6, merged, then each block's backward.
  const auto kernel = nn::cpu_attention_kernel(3);
  const auto block_mask = [&](int64_t first, int64_t n) {
    nn::AttentionMask m = mask;
    m.k_positions = positions.narrow(0, first, n);
    return m;
  };
  const auto keys = [&](const at::Tensor& t, int64_t first, int64_t n) { return t.narrow(2, first, n); };
  const nn::AttentionOutput a = kernel->forward(in.q, keys(in.k, 0, 4), keys(in.v, 0, 4), block_mask(0, 4), kScale);
  const nn::AttentionOutput b = kernel->forward(in.q, keys(in.k, 4, 6), keys(in.v, 4, 6), block_mask(4, 6), kScale);
  const nn::AttentionOutput merged = nn::merge_attention(a, b);
  check_allclose(merged.out, want.out, "merged out", 1e-12, 0.0);
  const nn::AttentionGrads ga = kernel->backward(in.q, keys(in.k, 0, 4), keys(in.v, 0, 4), merged.out, merged.lse, dout,
                                                 block_mask(0, 4), kScale);
  const nn::AttentionGrads gb = kernel->backward(in.q, keys(in.k, 4, 6), keys(in.v, 4, 6), merged.out, merged.lse, dout,
                                                 block_mask(4, 6), kScale);
  check_allclose(ga.dq + gb.dq, want.dq, "dq over key blocks", 1e-12, 0.0);
  check_allclose(at::cat({ga.dv, gb.dv}, 2), want.dv, "dv over key blocks", 1e-12, 0.0);
  check_allclose(at::cat({ga.dk, gb.dk}, 2), want.dk, "dk over key blocks", 1e-12, 0.0);
  const auto fails = [&](nn::AttentionDropout dropout, const std::string& message) {
    nn::AttentionMask bad = mask;
    bad.dropout = dropout;
    expect_error([&] { nn::cpu_attention_kernel()->forward(in.q, in.k, in.v, bad, kScale); }, message);
  };
  fails({0.3, 17, 5, 1, 4, 6, 8}, "heads [6, 10) are not heads of the model's 8");
  fails({0.3, 17, 5, 3, 4, 2, 8}, "rows [3, 5) are not rows of the global batch of 4");
  fails({0.3, 17, 5, 0, int64_t{1} << 19, 2, 8}, "the global batch's 524288 rows x 8 heads exceed the 2097152");
}

TEST(AttentionKernel, QueriesAfterTheKeysSeeThemAll) {
  // Queries at 5..9 against keys 0..9: a query block that sees a prefix of the keys.
  const Qkv in = make_qkv(5, 10, at::kDouble);
  const nn::AttentionMask mask{true, at::arange(5, 10, at::kLong), {}};
  const at::Tensor dout = rank_data(0, {2, 4, 5, 16}, at::kDouble, 9);
  const Result got = run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return nn::attention(nn::cpu_attention_kernel(2), q, k, v, mask, kScale);
  });
  const Result want = run_with_grad(in, dout, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return naive_attention(q, k, v, mask, kScale);
  });
  check_result(got, want, "queries 5..9", 1e-12, 0.0);
}

TEST(AttentionKernel, LseIsTheLogSumExpOfTheScores) {
  const Qkv in = make_qkv(6, 6, at::kDouble);
  const nn::AttentionOutput r = nn::cpu_attention_kernel(4)->forward(in.q, in.k, in.v, {true, {}, {}}, kScale);
  const at::Tensor scores = at::matmul(in.q, in.k.repeat_interleave(2, 1).transpose(-2, -1)) * kScale;
  const at::Tensor want = at::logsumexp(scores.masked_fill(at::ones({6, 6}, at::kBool).triu(1), -INFINITY), -1);
  check_allclose(r.lse, want, "lse", 1e-12, 0.0);
}

TEST(AttentionKernel, QueriesThatSeeNoKeyGiveZeroAndMinusInfinity) {
  const Qkv in = make_qkv(2, 3, at::kDouble);
  const nn::AttentionMask mask{true, at::arange(0, 2, at::kLong), at::arange(5, 8, at::kLong)};
  const auto kernel = nn::cpu_attention_kernel();
  const nn::AttentionOutput r = kernel->forward(in.q, in.k, in.v, mask, kScale);
  EXPECT_TRUE(at::equal(r.out, at::zeros_like(r.out)));
  EXPECT_TRUE(at::all(r.lse == -INFINITY).item<bool>());
  const nn::AttentionGrads g = kernel->backward(in.q, in.k, in.v, r.out, r.lse, at::ones_like(r.out), mask, kScale);
  for (const at::Tensor& t : {g.dq, g.dk, g.dv}) EXPECT_TRUE(at::equal(t, at::zeros_like(t)));
}

// Keys split in two blocks (the first one invisible to the early queries): merging the blocks'
// partial results gives the whole result, and backward of each block against the whole out and
// lse gives its share of the whole gradients. What ring attention relies on.
TEST(AttentionKernel, KeyBlocksMergeAndDifferentiateToTheWhole) {
  const int64_t s = 10;
  const Qkv in = make_qkv(s, s, at::kDouble);
  const at::Tensor dout = rank_data(0, {2, 4, s, 16}, at::kDouble, 9);
  const auto kernel = nn::cpu_attention_kernel(3);
  // Block A: keys at 6..9 (after the first queries), block B: keys at 0..5.
  const at::Tensor a = at::arange(6, 10, at::kLong), b = at::arange(0, 6, at::kLong);
  auto keys = [&](const at::Tensor& t, const at::Tensor& p) { return t.index_select(2, p); };
  const nn::AttentionMask whole{true, {}, {}}, mask_a{true, {}, a}, mask_b{true, {}, b};
  const nn::AttentionOutput full = kernel->forward(in.q, in.k, in.v, whole, kScale);
  const nn::AttentionOutput merged =
      nn::merge_attention(kernel->forward(in.q, keys(in.k, a), keys(in.v, a), mask_a, kScale),
                          kernel->forward(in.q, keys(in.k, b), keys(in.v, b), mask_b, kScale));
  check_allclose(merged.out, full.out, "merged out", 1e-12, 0.0);
  check_allclose(merged.lse, full.lse, "merged lse", 1e-12, 0.0);

  const nn::AttentionGrads g = kernel->backward(in.q, in.k, in.v, full.out, full.lse, dout, whole, kScale);
  const nn::AttentionGrads ga =
      kernel->backward(in.q, keys(in.k, a), keys(in.v, a), full.out, full.lse, dout, mask_a, kScale);
  const nn::AttentionGrads gb =
      kernel->backward(in.q, keys(in.k, b), keys(in.v, b), full.out, full.lse, dout, mask_b, kScale);
  check_allclose(ga.dq + gb.dq, g.dq, "dq from blocks", 1e-12, 0.0);
  check_allclose(at::cat({gb.dk, ga.dk}, 2), g.dk, "dk from blocks", 1e-12, 0.0);
  check_allclose(at::cat({gb.dv, ga.dv}, 2), g.dv, "dv from blocks", 1e-12, 0.0);
}

// backward_into adds backward()'s gradients into the sums it is given: through the kernel's own
// accumulators (ascending positions, contiguous sums in the accumulation dtype), and through the
// fallback that adds backward()'s result (shuffled positions; a sum in another dtype; a
// non-contiguous one). fp64 within 1e-12; bf16 inputs (fp32 sums) within fp32's rounding; with
// dropout and grouped-query heads throughout.
TEST(AttentionKernel, BackwardIntoAddsBackwardsGradients) {
  const int64_t s = 10;
  const at::Tensor shuffled = at::tensor(std::vector<int64_t>{3, 9, 0, 7, 1, 8, 2, 6, 4, 5});
  const auto kernel = nn::cpu_attention_kernel(3);
  for (at::ScalarType dtype : {at::kDouble, at::kBFloat16})
    for (const bool in_order : {true, false})
      for (const std::string layout : {"own", "float64 sums", "transposed sums"}) {
        const std::string what =
            std::string(dtype_name(dtype)) + (in_order ? ", ascending, " : ", shuffled, ") + layout;
        const Qkv in = make_qkv(s, s, dtype);
        const at::Tensor dout = rank_data(0, {2, 4, s, 16}, dtype, 9);
        nn::AttentionMask mask{
            true, in_order ? at::Tensor() : shuffled, in_order ? at::Tensor() : shuffled, {0.3, 17, 5, 1, 4, 2, 8}};
        const nn::AttentionOutput o = kernel->forward(in.q, in.k, in.v, mask, kScale);
        const nn::AttentionGrads g = kernel->backward(in.q, in.k, in.v, o.out, o.lse, dout, mask, kScale);
        const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
        const auto start = [&](const at::Tensor& like, int salt) {
          const at::Tensor t = rank_data(0, like.sizes().vec(), at::kDouble, salt);
          if (layout == "float64 sums") return t;
          if (layout == "transposed sums") return t.to(acc).transpose(2, 3).contiguous().transpose(2, 3);
          return t.to(acc);
        };
        const nn::AttentionGrads sum{start(in.q, 21), start(in.k, 22), start(in.v, 23)};
        const nn::AttentionGrads before{sum.dq.clone(), sum.dk.clone(), sum.dv.clone()};
        kernel->backward_into(in.q, in.k, in.v, o.out, o.lse, dout, mask, kScale, sum);
        const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
        check_allclose(sum.dq, before.dq + g.dq.to(sum.dq.scalar_type()), what + ": dq", tol, tol);
        check_allclose(sum.dk, before.dk + g.dk.to(sum.dk.scalar_type()), what + ": dk", tol, tol);
        check_allclose(sum.dv, before.dv + g.dv.to(sum.dv.scalar_type()), what + ": dv", tol, tol);
      }
}

TEST(AttentionKernel, WorkCounterCountsUnmaskedScores) {
  const Qkv in = make_qkv(8, 8, at::kFloat);
  const auto kernel = nn::cpu_attention_kernel(3);
  nn::AttentionWorkCounter outer;
  {
    nn::AttentionWorkCounter causal;
    kernel->forward(in.q, in.k, in.v, {true, {}, {}}, kScale);
    EXPECT_EQ(causal.unmasked_scores(), 2 * 4 * 36);  // batch x query heads x 8*9/2
  }
  nn::AttentionWorkCounter full;
  kernel->forward(in.q, in.k, in.v, {false, {}, {}}, kScale);
  EXPECT_EQ(full.unmasked_scores(), 2 * 4 * 64);
  EXPECT_EQ(outer.unmasked_scores(), 2 * 4 * (36 + 64));
}

TEST(AttentionKernel, CoreAttentionDefaultsToCausalWithInverseSqrtScale) {
  const Qkv in = make_qkv(6, 6, at::kDouble);
  nn::CoreAttention core;
  const at::Tensor got = core.call({in.q, in.k, in.v});
  check_allclose(got, naive_attention(in.q, in.k, in.v, {true, {}, {}}, 1.0 / std::sqrt(24.0)), "core", 1e-12, 0.0);
  EXPECT_TRUE(at::equal(core.positions(6), iota(6)));
}

TEST(AttentionKernel, BadShapesAreErrors) {
  const Qkv in = make_qkv(6, 6, at::kFloat);
  const auto kernel = nn::cpu_attention_kernel();
  expect_error([&] { kernel->forward(in.q.narrow(1, 0, 3), in.k, in.v, {}, 1.0); }, "not a multiple");
  expect_error([&] { kernel->forward(in.q, in.k, in.v, {true, iota(5), {}}, 1.0); }, "q_positions must be int64 [6]");
  expect_error([&] { kernel->forward(in.q, in.k, in.v.narrow(2, 0, 5), {}, 1.0); }, "shapes do not match");
  expect_error([&] { nn::cpu_attention_kernel(0); }, "query_block must be positive");
}

}  // namespace
}  // namespace hp::test
