// Rules declared in YAML: a user's file adds an op, and mistakes in a file are errors naming it.
#include <hp/core/error.h>
#include <hp/dtensor/dtensor.h>
#include <hp/dtensor/sharding_rule.h>

#include <filesystem>
#include <fstream>

#include "test_util.h"

namespace hp::test {
namespace {

// A fresh directory holding one rules file with `text`.
std::string rules_dir(const std::string& name, const std::string& text) {
  const std::filesystem::path dir = scratch_dir("yaml_rules_" + name);
  std::ofstream(dir / "rules.yaml") << text;
  return dir.string();
}

// An op with no built-in rule works on DTensors once a YAML file declares it.
TEST(YamlRules, UserFileAddsAnOp) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor a = at::randn({5, 3}) * 3;
    const at::Tensor full = g.broadcast(a.clone(), 0);
    DTensor d = distribute_tensor(full, mesh, {Shard(0)});
    if (g.rank() == 0) expect_error([&] { at::frac(d); }, "no sharding rule for aten::frac");
    g.barrier();
    if (g.rank() == 0) load_sharding_rules(rules_dir("frac", "pointwise:\n  nonlinear: [aten::frac]\n"));
    g.barrier();  // the registry is per process: rank 0 loaded it for every rank thread
    check_close(DTensor(at::frac(d)).full_tensor(), at::frac(full), "frac from a YAML rule", /*bitwise=*/true);
  });
}

// Mistakes are errors that name the file and what would be valid.
TEST(YamlRules, MistakesNameTheFile) {
  auto fails = [](const std::string& name, const std::string& text, const std::string& needle) {
    const std::string dir = rules_dir(name, text);
    try {
      load_sharding_rules(dir);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rules.yaml"), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error for " << name;
  };
  fails("family", "softmaxy:\n  nonlinear: [aten::exp]\n",
        "unknown rule family 'softmaxy'; valid: pointwise, reduction");
  fails("linearity", "pointwise:\n  mostly_linear: [aten::exp]\n", "unknown pointwise linearity 'mostly_linear'");
  fails("op", "pointwise:\n  nonlinear: [aten::no_such_op]\n", "'aten::no_such_op' is not an ATen op");
  fails("key", "reduction:\n  - {op: aten::sum, kind: sum, dim: 1}\n", "unknown reduction key 'dim'");
  fails("syntax", "pointwise: [unclosed\n", "not valid YAML");
}

}  // namespace
}  // namespace hp::test
