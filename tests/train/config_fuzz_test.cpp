// A seeded fuzzer over training configs: every key set to hostile values (huge, negative, NaN,
// infinities, wrong types, lists, maps, nulls), one to three at a time, on several world sizes.
// Parsing, validation and to_json either succeed or throw hp::Error; never another exception, a
// crash or a hang. Under scripts/sanitize the same runs check memory safety and undefined behaviour
// (signed overflow in the size arithmetic included).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>

#include "hp/core/error.h"
#include "hp/train/config.h"

namespace hp::train {
namespace {

const char* kValid = R"(
model: {dim: 64, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 128, max_seq: 32}
parallel: {dp_shard: 2, tp: 2}
data: {seq_len: 32}
train: {steps: 20, global_batch: 8, micro_batch: 2}
checkpoint: {interval: 5}
)";

// A MoE family: its own keys (experts, capacity, auxiliary losses, ...) get the same treatment.
const char* kValidMoe = R"(
model: {family: qwen3_moe, dim: 64, layers: 2, heads: 4, kv_heads: 2, max_seq: 32, experts: 4, top_k: 2}
parallel: {dp_shard: 2, ep: 2}
data: {seq_len: 32}
train: {steps: 20, global_batch: 8, micro_batch: 2}
checkpoint: {interval: 5}
)";

const std::vector<std::string> kHostile = {"-1",
                                           "0",
                                           "1",
                                           "3",
                                           "9223372036854775807",
                                           "-9223372036854775808",
                                           "99999999999999999999",
                                           "4611686018427387904",
                                           "2147483648",
                                           "1e308",
                                           "-1e308",
                                           "1e-320",
                                           ".nan",
                                           ".inf",
                                           "-.inf",
                                           "1.5",
                                           "true",
                                           "yes",
                                           "~",
                                           "null",
                                           "''",
                                           "'x'",
                                           "[1, 2]",
                                           "{a: 1}",
                                           "[]",
                                           "{}",
                                           "0x10",
                                           "'../../etc/passwd'",
                                           "\"\\0\"",
                                           "[[[[1]]]]",
                                           "&a 1",
                                           "*a",
                                           "!!binary aGVsbG8=",
                                           "gpipe",
                                           "zbv",
                                           "interleaved",
                                           "muon",
                                           "wsd"};

void fuzz(const char* valid, uint64_t seed) {
  std::vector<std::string> keys;
  const nlohmann::json every_key = nlohmann::json::parse(to_json(parse_config(valid, {})));
  for (const auto& item : every_key.items())
    if (item.key() != "model.family") keys.push_back(item.key());  // another family: other keys
  ASSERT_GT(keys.size(), 40u);
  std::mt19937_64 random(seed);
  int accepted = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<std::string> overrides;
    for (int n = 1 + static_cast<int>(random() % 3); n > 0; --n)
      overrides.push_back(keys[random() % keys.size()] + "=" + kHostile[random() % kHostile.size()]);
    const int64_t world = int64_t{1} << (random() % 4);
    std::string where;
    for (const auto& o : overrides) where += " --set " + o;
    try {
      const TrainConfig c = parse_config(valid, overrides);
      validate(c, world);
      (void)to_json(c);
      ++accepted;
    } catch (const hp::Error&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "world " << world << where << ": a " << typeid(e).name() << " escaped: " << e.what();
    }
  }
  std::cout << "config fuzz: " << accepted << " accepted, " << refused << " refused\n";
  EXPECT_GT(refused, 1000) << "most hostile values should be refused";
}

TEST(ConfigFuzz, HostileValuesAreAcceptedOrRefusedCleanly) {
  fuzz(kValid, 20261201);
  fuzz(kValidMoe, 20261202);
}

}  // namespace
}  // namespace hp::train
