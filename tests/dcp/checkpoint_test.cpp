// hp::dcp: save under one layout, load under any other (exact), damage detection, atomic commit,
// async save and optimizer state.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "dcp/xxhash64.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dcp/state_dict.h"
#include "hp/mesh/device_mesh.h"
#include "test_util.h"

namespace hp {
namespace {
namespace fs = std::filesystem;
using test::run;

// A fresh directory per test (ctest runs tests in parallel processes).
std::string scratch_dir() {
  return test::scratch_dir("dcp_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
}

// The layouts of the reshard matrix: a mesh shape and placements (an empty mesh = a plain tensor).
struct Layout {
  std::vector<int64_t> mesh;
  Placements placements;
  std::string name() const {
    if (mesh.empty()) return "plain";
    std::string s = "mesh";
    for (int64_t m : mesh) s += "_" + std::to_string(m);
    return s + "_" + to_string(placements);
  }
  int world() const {
    int w = 1;
    for (int64_t m : mesh) w *= static_cast<int>(m);
    return w;
  }
};

std::vector<Layout> layouts() {
  std::vector<Layout> all = {{{}, {}}};
  for (int64_t w : {1, 2, 4})
    for (const Placement& p : {Shard(0), Shard(1), Replicate()}) all.push_back({{w}, {p}});
  for (const Placements& p : std::vector<Placements>{{Shard(0), Shard(1)},
                                                     {Shard(0), Shard(0)},
                                                     {Shard(1), Replicate()},
                                                     {Replicate(), Shard(0)},
                                                     {Replicate(), Replicate()}})
    all.push_back({{2, 2}, p});
  return all;
}

// The tensors of the matrix: uneven shapes (empty pieces on 4 ranks) and three dtypes.
std::map<std::string, at::Tensor> globals() {
  return {{"f32", test::rank_data(0, {7, 5}, at::kFloat, 1)},
          {"i64", test::rank_data(0, {5, 9}, at::kLong, 2)},
          {"bf16", test::rank_data(0, {9, 3}, at::kBFloat16, 3)}};
}

at::Tensor place(const at::Tensor& global, const comm::ProcessGroup& world, const Layout& layout) {
  if (layout.mesh.empty()) return global.clone();
  return distribute_tensor(global, init_device_mesh(world, "cpu", layout.mesh), layout.placements);
}

// Runs fn(group, layout) for every layout, on that layout's ranks.
void on_every_layout(const std::vector<Layout>& all,
                     const std::function<void(const comm::ProcessGroup&, const Layout&)>& fn) {
  for (int world : {1, 2, 4})
    run(world, [&](const comm::ProcessGroup& group) {
      for (const Layout& layout : all)
        if (layout.world() == world) fn(group, layout);
    });
}

// Runs fn(group, saved, loaded) for every pair of layouts, on the loading layout's ranks; returns
// how many pairs ran.
int on_every_pair(const std::vector<Layout>& all,
                  const std::function<void(const comm::ProcessGroup&, const Layout&, const Layout&)>& fn) {
  int pairs = 0;
  on_every_layout(all, [&](const comm::ProcessGroup& group, const Layout& loaded) {
    for (const Layout& saved : all) fn(group, saved, loaded);
    if (group.rank() == 0) pairs += static_cast<int>(all.size());
  });
  return pairs;
}

TEST(Xxhash64, KnownVectors) {
  EXPECT_EQ(dcp::detail::xxhash64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(dcp::detail::xxhash64("abc", 3), 0x44BC2CF5AD770999ULL);
}

// Every layout saves; every layout loads every save; the loaded whole tensor equals the original bitwise.
TEST(Checkpoint, ReshardMatrixIsExact) {
  const std::string root = scratch_dir();
  const auto all = layouts();
  dcp::SaveOptions options;
  options.checksum_block_bytes = 16;  // many blocks: loads read partial block ranges
  on_every_layout(all, [&](const comm::ProcessGroup& group, const Layout& a) {
    dcp::StateDict state;
    for (const auto& [name, g] : globals()) state.tensors[name] = place(g, group, a);
    state.values["layout"] = a.name();
    dcp::save(state, root + "/" + a.name(), group, options);
  });
  const int loads = on_every_pair(all, [&](const comm::ProcessGroup& group, const Layout& a, const Layout& b) {
    dcp::StateDict state;
    for (const auto& [name, g] : globals()) state.tensors[name] = place(at::zeros_like(g), group, b);
    dcp::load(state, root + "/" + a.name());
    if (state.values.at("layout") != a.name()) throw std::runtime_error("values were not loaded");
    for (const auto& [name, g] : globals())
      test::check_close(test::whole(state.tensors.at(name)), g, a.name() + " -> " + b.name() + " " + name,
                        /*bitwise=*/true);
  });
  EXPECT_EQ(loads, static_cast<int>(all.size() * all.size()));  // 15 x 15 pairs
}

TEST(Checkpoint, ReplicatedDataIsWrittenOnce) {
  const std::string dir = scratch_dir() + "/ckpt";
  run(4, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["r"] = place(at::ones({64, 64}), group, {{2, 2}, {Replicate(), Shard(0)}});
    state.tensors["plain"] = at::ones({64});
    dcp::save(state, dir, group);
  });
  uint64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") bytes += fs::file_size(entry.path());
  const uint64_t payload = (64 * 64 + 64) * 4;
  EXPECT_GE(bytes, payload);
  EXPECT_LT(bytes, payload + 2048) << "replicas written more than once";
  // Ranks 2 and 3 hold replicas of ranks 0 and 1 (plain tensors: rank 0 writes).
  EXPECT_TRUE(fs::exists(dir + "/rank-00001.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/rank-00002.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/rank-00003.safetensors"));
  EXPECT_EQ(dcp::verify(dir).chunks, 3);
}

// Plain tensors that only some ranks hold (a pipeline stage's buffers): each is written once, by
// the lowest rank that holds it, and loads back bitwise.
TEST(Checkpoint, PlainTensorsOfSomeRanksAreWrittenOnceByTheLowest) {
  const std::string dir = scratch_dir() + "/ckpt";
  const auto plain = [](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["everywhere"] = test::rank_data(0, {8}, at::kFloat, 1);
    if (group.rank() >= 2) state.tensors["stage_1.bias"] = test::rank_data(0, {6}, at::kFloat, 2);
    if (group.rank() == 3) state.tensors["last.step"] = test::rank_data(0, {3}, at::kLong, 3);
    return state;
  };
  run(4, [&](const comm::ProcessGroup& group) { dcp::save(plain(group), dir, group); });
  EXPECT_TRUE(fs::exists(dir + "/rank-00000.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/rank-00001.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/rank-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/rank-00003.safetensors"));
  EXPECT_EQ(dcp::verify(dir).chunks, 3) << "each plain tensor once";
  const dcp::StateDict whole = dcp::load_whole(dir);
  ASSERT_EQ(whole.tensors.size(), 3u);
  run(4, [&](const comm::ProcessGroup& group) {
    const dcp::StateDict want = plain(group);
    dcp::StateDict got = want;
    for (auto& [name, t] : got.tensors) t = at::zeros_like(t);
    dcp::load(got, dir);
    for (const auto& [name, t] : want.tensors) {
      EXPECT_TRUE(at::equal(got.tensors.at(name), t)) << name << " on rank " << group.rank();
      EXPECT_TRUE(at::equal(whole.tensors.at(name), t)) << name;
    }
  });
}

// Flip one byte of tensor data: loading fails and names the file and the tensor.
TEST(Checkpoint, DamageIsDetected) {
  const std::string root = scratch_dir();
  const std::string dir = root + "/ckpt";
  run(2, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["w"] = place(test::rank_data(0, {6, 4}, at::kFloat, 7), group, {{2}, {Shard(0)}});
    dcp::save(state, dir, group);
  });
  const auto load_into_fresh = [&](const std::string& from) {
    dcp::StateDict state;
    state.tensors["w"] = at::zeros({6, 4});
    dcp::load(state, from);
  };
  load_into_fresh(dir);  // intact

  fs::copy(dir, root + "/flipped", fs::copy_options::recursive);
  {
    std::fstream f(root + "/flipped/rank-00001.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }
  test::expect_error([&] { load_into_fresh(root + "/flipped"); },
                     {"checksum mismatch", "rank-00001.safetensors", "tensor 'w'"});
  test::expect_error([&] { dcp::verify(root + "/flipped"); }, {"checksum mismatch", "rank-00001.safetensors"});

  fs::copy(dir, root + "/truncated_data", fs::copy_options::recursive);
  fs::resize_file(root + "/truncated_data/rank-00001.safetensors",
                  fs::file_size(root + "/truncated_data/rank-00001.safetensors") - 8);
  test::expect_error([&] { load_into_fresh(root + "/truncated_data"); }, {"truncated", "tensor 'w'"});

  fs::copy(dir, root + "/truncated_meta", fs::copy_options::recursive);
  fs::resize_file(root + "/truncated_meta/metadata.json", fs::file_size(root + "/truncated_meta/metadata.json") / 2);
  test::expect_error([&] { load_into_fresh(root + "/truncated_meta"); }, {"metadata.json", "damaged"});

  fs::copy(dir, root + "/no_meta", fs::copy_options::recursive);
  fs::remove(root + "/no_meta/metadata.json");
  test::expect_error([&] { load_into_fresh(root + "/no_meta"); }, {"has no metadata.json"});

  test::expect_error(
      [&] {
        dcp::StateDict state;
        state.tensors["w"] = at::zeros({4, 6});
        dcp::load(state, dir);
      },
      {"tensor 'w' has shape [4, 6]", "[6, 4]"});
  test::expect_error(
      [&] {
        dcp::StateDict state;
        state.tensors["v"] = at::zeros({6, 4});
        dcp::load(state, dir);
      },
      {"has no tensor 'v'"});
}

// An abandoned save never touches the committed checkpoint; the next save clears its leftovers.
TEST(Checkpoint, InterruptedSaveLeavesPreviousCheckpoint) {
  const std::string root = scratch_dir();
  const std::string dir = root + "/step-1";
  run(2, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["w"] = place(at::full({8, 8}, 1.0), group, {{2}, {Shard(0)}});
    dcp::SaveOptions options;
    options.update_latest = true;
    dcp::save(state, dir, group, options);
    state.tensors["w"] = place(at::full({8, 8}, 2.0), group, {{2}, {Shard(0)}});
    { dcp::AsyncSave abandoned = dcp::save_async(state, dir, group, options); }  // dropped without wait()
  });
  EXPECT_TRUE(fs::exists(dir + ".tmp"));
  ASSERT_EQ(dcp::latest_checkpoint(root).value_or(""), dir);
  dcp::StateDict state;
  state.tensors["w"] = at::zeros({8, 8});
  dcp::load(state, dir);
  test::check_close(state.tensors["w"], at::full({8, 8}, 1.0), "previous checkpoint", true);
  dcp::verify(dir);

  run(2, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["w"] = place(at::full({8, 8}, 3.0), group, {{2}, {Shard(0)}});
    dcp::save(state, dir, group);
  });
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  dcp::load(state, dir);
  test::check_close(state.tensors["w"], at::full({8, 8}, 3.0), "overwritten checkpoint", true);

  // A crash while replacing it, after the old version moved aside: latest falls back to it.
  fs::rename(dir, dir + ".old");
  EXPECT_EQ(dcp::latest_checkpoint(root).value_or(""), dir + ".old");
  // latest naming a checkpoint that is gone is an error, not a silent fresh start.
  fs::remove_all(dir + ".old");
  test::expect_error([&] { dcp::latest_checkpoint(root); }, {"names step-1", "holds no committed checkpoint"});
}

// The caller may change its tensors as soon as save_async returns, even with a staging budget far
// smaller than the state (staging then waits for the writer).
TEST(Checkpoint, AsyncSaveStagesBeforeReturning) {
  const std::string dir = scratch_dir() + "/ckpt";
  const at::Tensor a = test::rank_data(0, {64, 32}, at::kFloat, 4), b = test::rank_data(0, {32, 64}, at::kFloat, 5);
  run(2, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["a"] = place(a, group, {{2}, {Shard(0)}});
    state.tensors["b"] = place(b, group, {{2}, {Shard(1)}});
    state.values["step"] = 5;
    dcp::SaveOptions options;
    options.max_staging_bytes = 1024;
    dcp::AsyncSave pending = dcp::save_async(state, dir, group, options);
    for (auto& [name, t] : state.tensors) DTensor(t).to_local().fill_(-1.0f);
    pending.wait();
  });
  dcp::StateDict state;
  state.tensors["a"] = at::zeros_like(a);
  state.tensors["b"] = at::zeros_like(b);
  dcp::load(state, dir);
  test::check_close(state.tensors["a"], a, "a", true);
  test::check_close(state.tensors["b"], b, "b", true);
  EXPECT_EQ(state.values.at("step").get<int>(), 5);
}

// Background staging: save_async returns before copying; after wait_staged() the caller may
// change the tensors and the checkpoint still holds the values at save time. A tensor changed
// before wait_staged() fails the save on every rank, naming it, and commits nothing.
TEST(Checkpoint, BackgroundStagingSavesValuesAtSaveTimeOrFailsLoudly) {
  const std::string dir = scratch_dir() + "/ckpt";
  const at::Tensor a = test::rank_data(0, {64, 32}, at::kFloat, 4), b = test::rank_data(0, {32, 64}, at::kFloat, 5);
  const auto make_state = [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["a"] = place(a, group, {{2}, {Shard(0)}});
    state.tensors["b"] = place(b, group, {{2}, {Shard(1)}});
    state.values["step"] = 5;
    return state;
  };
  dcp::SaveOptions options;
  options.max_staging_bytes = 1024;  // the stager waits for the writer many times
  options.stage_in_background = true;
  run(2, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state = make_state(group);
    dcp::AsyncSave pending = dcp::save_async(state, dir, group, options);
    pending.wait_staged();
    for (auto& [name, t] : state.tensors) t.mul_(-1.0f);  // through the DTensor, as an optimizer would
    pending.wait();
  });
  dcp::StateDict loaded;
  loaded.tensors["a"] = at::zeros_like(a);
  loaded.tensors["b"] = at::zeros_like(b);
  dcp::load(loaded, dir);
  test::check_close(loaded.tensors["a"], a, "a", true);
  test::check_close(loaded.tensors["b"], b, "b", true);

  // Changed too early, through the DTensor or its local tensor: refused, and the checkpoint above stays.
  for (const bool through_local : {false, true}) {
    test::expect_error(
        [&] {
          try {
            testing::run_ranks(2, [&](const comm::ProcessGroup& group) {
              dcp::StateDict state = make_state(group);
              dcp::AsyncSave pending = dcp::save_async(state, dir, group, options);
              at::Tensor b_now = state.tensors["b"];
              (through_local ? DTensor(b_now).to_local() : b_now).add_(1.0f);
              pending.wait();
            });
          } catch (const TimeoutError& e) {  // a rank left waiting is a failure of its own
            throw std::runtime_error(std::string("a rank hung: ") + e.what());
          }
        },
        {"tensor 'b' changed while the save was staging it", "wait_staged()"});
    dcp::load(loaded, dir);
    test::check_close(loaded.tensors["b"], b, "b after a refused save", true);
  }
}

struct OneWeight : torch::nn::Module {
  explicit OneWeight(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor weight;
};

// AdamW state (with amsgrad: exp_avg, exp_avg_sq, max_exp_avg_sq, and the step count) saved from
// every layout of the reshard matrix loads into every layout bitwise, and the step after the load
// gives bitwise the weight an uninterrupted run gives (AdamW is elementwise, so every layout computes
// the same values).
TEST(Checkpoint, AdamWStateReshardsAcrossTheMatrix) {
  const std::string root = scratch_dir();
  const at::Tensor init = test::rank_data(0, {7, 6}, at::kFloat, 9);
  const auto adamw = [](const at::Tensor& w) {
    return torch::optim::AdamW({w}, torch::optim::AdamWOptions(0.1).amsgrad(true).weight_decay(0.01));
  };
  const auto train = [](const at::Tensor& w, torch::optim::AdamW& opt, int steps) {
    for (int i = 0; i < steps; ++i) {
      opt.zero_grad();
      test::whole((w * w * w).sum()).backward();
      opt.step();
    }
  };
  const std::vector<std::string> moments = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  // The uninterrupted run, on one device: the state after 2 steps, the weight after 3.
  std::map<std::string, at::Tensor> want;
  {
    auto model = std::make_shared<OneWeight>(init.clone().set_requires_grad(true));
    torch::optim::AdamW opt = adamw(model->weight);
    train(model->weight, opt, 2);
    auto state = dcp::model_state_dict(*model);
    dcp::add_optimizer_state(state, opt, *model);
    for (const std::string& m : moments) want[m] = state.tensors.at("optim.weight." + m).clone();
    train(model->weight, opt, 1);
    want["weight"] = model->weight.detach().clone();
  }
  const auto all = layouts();
  on_every_layout(all, [&](const comm::ProcessGroup& group, const Layout& a) {
    auto model = std::make_shared<OneWeight>(place(init, group, a).set_requires_grad(true));
    torch::optim::AdamW opt = adamw(model->weight);
    train(model->weight, opt, 2);
    auto state = dcp::model_state_dict(*model);
    dcp::add_optimizer_state(state, opt, *model);
    dcp::save(state, root + "/" + a.name(), group);
  });
  const int loads = on_every_pair(all, [&](const comm::ProcessGroup& group, const Layout& a, const Layout& b) {
    const std::string what = a.name() + " -> " + b.name();
    auto model = std::make_shared<OneWeight>(place(at::zeros_like(init), group, b).set_requires_grad(true));
    torch::optim::AdamW opt = adamw(model->weight);
    auto state = dcp::model_state_dict(*model);
    dcp::add_optimizer_state(state, opt, *model);
    dcp::load(state, root + "/" + a.name());
    dcp::restore_optimizer_values(state, opt, *model);
    for (const std::string& m : moments)
      test::check_close(test::whole(state.tensors.at("optim.weight." + m)), want.at(m), what + " " + m, true);
    dcp::StateDict restored;
    dcp::add_optimizer_state(restored, opt, *model);
    if (restored.values.at("optim.step").at("weight") != 2) throw std::runtime_error(what + ": step count");
    train(model->weight, opt, 1);
    test::check_close(test::whole(model->weight.detach()), want.at("weight"), what + ": the next step", true);
  });
  EXPECT_EQ(loads, static_cast<int>(all.size() * all.size()));
}

TEST(Checkpoint, BadSaveInputIsRefused) {
  const std::string dir = scratch_dir();
  run(1, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["u"] = at::Tensor();
    test::expect_error([&] { dcp::save(state, dir + "/x", group); }, {"tensor 'u' is undefined"});
  });
}

}  // namespace
}  // namespace hp
