// Text data for language-model training: a byte-level tokenizer, corpus preparation into binary
// token files with a held-out split, and a deterministic, stateless sampler sharded by
// data-parallel rank (the batch of step s is a pure function of (seed, s), so resuming at step s
// needs nothing but s).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hp::data {

// Token = byte: vocabulary 256, no unknown tokens, any text round-trips exactly.
struct ByteTokenizer {
  static constexpr int64_t kVocab = 256;
  at::Tensor encode(const std::string& text) const;  // 1-D int64
  std::string decode(const at::Tensor& tokens) const;
};

struct CorpusInfo {
  int64_t files = 0;
  int64_t train_tokens = 0, eval_tokens = 0;
  double unigram_entropy_nats = 0.0;  // of the train split's bytes: the loss a model without context reaches
  std::string train_path, eval_path;
};

// Reads every text file under `sources` (files, or directories walked recursively in sorted order;
// files with a NUL byte in their first 4 KiB are binary and skipped), concatenates them and writes
// `<out_dir>/train.bin` and `<out_dir>/eval.bin` (raw bytes; eval = the last `eval_fraction` of
// the text) plus `<out_dir>/corpus.json`. Reuses them when corpus.json records the same sources and
// fraction. Errors name the missing source or an empty corpus.
CorpusInfo prepare_corpus(const std::vector<std::string>& sources, const std::string& out_dir, double eval_fraction);

// What prepare_corpus prepared earlier for these arguments, if it is in `out_dir`; reads only
// corpus.json and writes nothing.
std::optional<CorpusInfo> prepared_corpus(const std::vector<std::string>& sources, const std::string& out_dir,
                                          double eval_fraction);

// A binary token file in memory (uint8 tokens).
at::Tensor load_tokens(const std::string& path);

// Windows of `seq_len + 1` tokens: inputs are the first seq_len, targets the last seq_len.
class TokenSampler {
 public:
  TokenSampler(at::Tensor tokens, int64_t seq_len, uint64_t seed);
  // Rows [first, first + count) of the global training batch of `step` (global_batch rows, each at
  // a pseudo-random start drawn from (seed, step, row)): inputs and targets [count, seq_len] int64.
  std::pair<at::Tensor, at::Tensor> train_batch(int64_t step, int64_t global_batch, int64_t first, int64_t count) const;
  // Rows [first, first + count) of evaluation batch `index`: consecutive non-overlapping windows
  // from the start of the data (wrapping around), the same every time.
  std::pair<at::Tensor, at::Tensor> eval_batch(int64_t index, int64_t global_batch, int64_t first, int64_t count) const;
  int64_t windows() const;  // number of distinct window starts

 private:
  std::pair<at::Tensor, at::Tensor> gather(const std::vector<int64_t>& starts) const;
  at::Tensor tokens_;
  int64_t seq_len_;
  uint64_t seed_;
};

}  // namespace hp::data
