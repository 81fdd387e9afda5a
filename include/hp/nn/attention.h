// Core attention behind a kernel interface, with explicit positions.
//
// An AttentionKernel is the math of softmax(q k^T * scale, masked) v, forward and backward, with no
// autograd and no communication: forward returns the output and the log-sum-exp of each row's
// scores, and backward recomputes the probabilities from that log-sum-exp (FlashAttention's
// recurrence), so a caller that splits the keys into blocks (ring attention) gets each block's
// exact share of the gradient by passing the global out and lse. cpu_attention_kernel() works
// blockwise in fp32 (fp64 for fp64 inputs); for bf16 inputs its products take bf16 factors and
// round their results to bf16, but for the probabilities' gradient (fp32). It works on any device;
// the device build adds ATen's flash attention for the CUDA problems it computes alike
// (default_attention_kernel).
//
// Masks are by position: with `causal`, query i sees key j when k_positions[j] <= q_positions[i].
// A rank holding any subset of a sequence (a context-parallel shard, a ring block from a peer)
// therefore attends exactly as one device would, whatever order its tokens are in.
//
// CoreAttention is the module a model calls with q, k, v; how it computes (on this rank alone, or
// across a context-parallel group) is its AttentionCompute, which plans replace from outside
// (hp/parallel/context_parallel.h). The model asks it where its tokens are (positions()) for its
// rotary embedding.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "hp/nn/module.h"
#include "hp/nn/token_coordinates.h"

namespace hp::nn {

// Dropout on the attention probabilities (Hugging Face's attention_dropout), by global
// coordinates so that it does not depend on the layout: the probability of query position i for
// key position j in head h of batch row r is kept (and scaled by 1 / (1 - p)) by Philox under
// (seed, stream) at index ((r * heads + h) * 2^21 + i) * 2^21 + j (so rows x heads and positions
// must stay within 2^21). A rank holding some rows, some heads (tensor parallelism, Ulysses) or
// some positions (context parallelism) draws its part of one device's masks.
struct AttentionDropout {
  double p = 0.0;  // 0: none
  uint64_t seed = 0, stream = 0;
  int64_t first_row = 0;    // q's first row in the global batch
  int64_t global_rows = 0;  // rows of the global batch
  int64_t first_head = 0;   // q's first head among the model's query heads
  int64_t heads = 0;        // the model's query heads
};

// Which keys each query sees, and the probabilities' dropout. Positions are int64 vectors on the
// host, [sq] and [sk]; undefined means 0, 1, ..., n-1.
struct AttentionMask {
  bool causal = true;
  at::Tensor q_positions, k_positions;
  AttentionDropout dropout = {};
};

// Tokens put in ascending position order, along dim 2 (the sequence of [b, h, s, d] and of
// [b, h, s]): kernels work on sorted tokens, and ring attention sorts once per call.
struct PositionOrder {
  explicit PositionOrder(const at::Tensor& positions);  // int64 [s] on the host
  at::Tensor positions;                                 // ascending
  at::Tensor order;                                     // into the original tokens; undefined when already ascending
  at::Tensor take(const at::Tensor& tokens) const {
    return order.defined() ? tokens.index_select(2, order.to(tokens.device())) : tokens;
  }
  at::Tensor put_back(const at::Tensor& sorted) const;
};

// Whether `positions` (int64 [n] on the host; undefined means so) are 0, 1, ..., n-1: the tokens of
// a whole sequence in order.
bool positions_in_order(const at::Tensor& positions);

// out [b, hq, sq, dv] and lse [b, hq, sq], both in the accumulation dtype (fp64 for fp64 inputs,
// else fp32). A query that sees no key has out 0 and lse -inf.
struct AttentionOutput {
  at::Tensor out, lse;
};

// In the accumulation dtype.
struct AttentionGrads {
  at::Tensor dq, dk, dv;
};

// q [b, hq, sq, dqk], k [b, hkv, sk, dqk], v [b, hkv, sk, dv] with hq a multiple of hkv (grouped
// query attention: query head i uses key/value head i / (hq / hkv)). The qk and v head dims may
// differ. Inputs must not require grad (the caller records autograd).
class AttentionKernel {
 public:
  virtual ~AttentionKernel() = default;
  virtual AttentionOutput forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionMask& mask, double scale) const = 0;
  // The gradients of sum(dout * out) for these keys, with the probabilities exp(scores - lse):
  // `out` and `lse` may be those of attention over a superset of these keys.
  virtual AttentionGrads backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask,
                                  double scale) const = 0;
  // backward()'s gradients added into `sum` (tensors of q's, k's and v's shapes in the
  // accumulation dtype), for a caller that sums them over blocks of keys (ring attention): a
  // kernel that adds as it goes holds no gradients of its own. This one adds backward()'s.
  virtual void backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                             const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask, double scale,
                             const AttentionGrads& sum) const;
};

// The CPU kernel: blocks of `query_block` query rows (sorted by position) against the keys they
// can see (sorted by position, so a causal block skips every key after its last query);
// probabilities never exist beyond one block.
std::shared_ptr<const AttentionKernel> cpu_attention_kernel(int64_t query_block = 256);

// The kernel CoreAttention starts with: cpu_attention_kernel(); in the device build (HP_CUDA), ATen's
// flash attention instead for the problems it computes alike: CUDA tensors in bf16 or fp16 on a GPU of
// compute capability 8.0 or newer, one head dim for q, k and v (a multiple of 8, at most 192, or 256
// on sm80 and sm90), no dropout, and, when causal, positions 0..n-1 for both queries and keys. Every
// other call goes to the blockwise kernel. HP_ATTENTION_KERNEL=blockwise keeps the blockwise kernel
// everywhere (to compare); the default is auto.
std::shared_ptr<const AttentionKernel> default_attention_kernel();

// Folds a partial result over more keys into (out, lse), both in the accumulation dtype:
// lse' = logaddexp(lse, lse_b), out' = out exp(lse - lse') + out_b exp(lse_b - lse'). Rows that
// see no key on either side stay 0 / -inf. Returns the merged pair.
AttentionOutput merge_attention(const AttentionOutput& acc, const AttentionOutput& block);

// Differentiable attention on one rank through `kernel`: returns out (in q's dtype), whose backward
// gives q, k and v their gradients (in their dtypes). Saves q, k, v, out and lse.
at::Tensor attention(std::shared_ptr<const AttentionKernel> kernel, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const AttentionMask& mask, double scale);

// Counts the score elements the kernel's forward computes unmasked (one per query, key and head
// of each batch row), on this thread while alive; for balance tests and benchmarks. Nests like
// hp::comm::CommDebugMode.
class AttentionWorkCounter {
 public:
  AttentionWorkCounter();
  ~AttentionWorkCounter();
  AttentionWorkCounter(const AttentionWorkCounter&) = delete;
  AttentionWorkCounter& operator=(const AttentionWorkCounter&) = delete;
  int64_t unmasked_scores() const { return unmasked_; }

 private:
  friend void note_attention_work(int64_t unmasked);
  int64_t unmasked_ = 0;
  AttentionWorkCounter* outer_;
};
void note_attention_work(int64_t unmasked);

// A call's keys and values handed over before the call (CoreAttention::begin), and whatever a
// compute started with them (an exchange between ranks in flight).
class KeysInFlight {
 public:
  KeysInFlight(at::Tensor k, at::Tensor v)
      : k_(std::move(k)), v_(std::move(v)), k_version_(k_._version()), v_version_(v_._version()) {}
  virtual ~KeysInFlight() = default;
  KeysInFlight(const KeysInFlight&) = delete;
  KeysInFlight& operator=(const KeysInFlight&) = delete;
  // Whether the call's k and v are the ones handed over, unchanged since (a hook may have replaced
  // them, or written into them).
  bool began_with(const at::Tensor& k, const at::Tensor& v) const {
    return k.is_same(k_) && v.is_same(v_) && k._version() == k_version_ && v._version() == v_version_;
  }
  // Completes what was started, for nothing (the call's keys are other ones, or begin() came again):
  // every rank does, so that what follows on the group meets its match.
  virtual void finish() {}

 private:
  at::Tensor k_, v_;
  int64_t k_version_, v_version_;
};

// How CoreAttention computes over the sequence: alone by default; a context-parallel plan installs
// one that works across its group.
class AttentionCompute {
 public:
  virtual ~AttentionCompute() = default;
  // q [b, hq, s, dqk], k and v [b, hkv, s, d] for this rank's `s` tokens; differentiable. A
  // compute that moves heads between ranks moves `dropout.first_head` with them. `early` is what
  // begin() returned for this k and v, or null.
  virtual at::Tensor attend(std::shared_ptr<const AttentionKernel> kernel, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, bool causal, double scale, const AttentionDropout& dropout,
                            std::shared_ptr<KeysInFlight> early) const = 0;
  // Starts what the call will do with k and v alone (moving them between ranks), while the caller
  // computes the queries. Null (the default): nothing to start.
  virtual std::shared_ptr<KeysInFlight> begin(const at::Tensor& k, const at::Tensor& v) const {
    (void)k, (void)v;
    return nullptr;
  }
  // The global positions (int64 [local_len]) of this rank's tokens.
  virtual at::Tensor positions(int64_t local_len) const = 0;
  virtual std::string name() const = 0;
};

// forward_inputs({q, k, v}) -> out [b, hq, s, dv]. Holds no parameters. With `dropout` > 0 it drops
// probabilities in training (AttentionDropout), with the rows and the step's stream of the token
// coordinates in effect (hp/nn/token_coordinates.h), this module's seed (init_parameters derives it
// from the model seed and the FQN; 0 until then) and its heads' place among the model's. A plan
// that splits the heads over ranks (tensor parallelism) must say which are this rank's with
// set_heads, or every rank would draw head 0's masks for its own first head; given the model's
// query head count, a dropping forward that receives fewer heads with no set_heads is an error.
class CoreAttention : public Module {
 public:
  // scale 0: 1 / sqrt(qk head dim). heads: the model's query heads (0: not checked).
  explicit CoreAttention(bool causal = true, double scale = 0.0, double dropout = 0.0, int64_t heads = 0);
  bool causal;
  double scale;
  double dropout;
  void seed(uint64_t seed);
  // This rank's query heads are heads [first, first + local heads) of the model's `total`.
  void set_heads(int64_t first, int64_t total);

  // Where this rank's `local_len` tokens sit in the sequence (for rotary embeddings).
  at::Tensor positions(int64_t local_len) const { return compute_->positions(local_len); }
  // Hands the next call's k and v over as soon as they are computed, before the queries are: a
  // plan that moves them between ranks (asynchronous context parallelism) starts doing so, on its
  // groups, without waiting, while the caller computes the queries. Optional, but like a
  // collective: every rank of the plan's group calls it at the same point, or none does. The call
  // then takes the same k and v, unchanged; other ones (a hook replaced or wrote into them) finish
  // what begin started, for nothing, and exchange their own, on every rank alike when the ranks run
  // the same hooks. A module with a call wrapper (checkpointed alone) starts nothing here.
  void begin(const at::Tensor& k, const at::Tensor& v);
  void set_kernel(std::shared_ptr<const AttentionKernel> kernel);
  const std::shared_ptr<const AttentionKernel>& kernel() const { return kernel_; }
  void set_compute(std::shared_ptr<const AttentionCompute> compute);
  const AttentionCompute& compute() const { return *compute_; }

 protected:
  at::Tensor forward_inputs(const Inputs& inputs) override;

 private:
  std::shared_ptr<const AttentionKernel> kernel_;
  std::shared_ptr<const AttentionCompute> compute_;
  uint64_t seed_ = 0;
  int64_t model_heads_ = 0;             // from the constructor; 0: not checked
  int64_t first_head_ = 0, heads_ = 0;  // heads_ 0: this rank holds them all
  DrawCounter draws_;
  std::shared_ptr<KeysInFlight> early_;  // from begin(), for the next call
};

}  // namespace hp::nn
