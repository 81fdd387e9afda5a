// Model files hold no parallel code: for every family under models/, the model's header and source
// (include/hp/models/<family>/model.h, src/models/<family>/model.cpp) name no mesh, placement, rank
// or DTensor, and include only hp/core, hp/kernels, hp/nn and model headers (the family's own, or another
// family's whose blocks it reuses, itself checked here). Plans are applied from outside, by the
// family's recipe.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "hp_build_paths.h"

namespace {
namespace fs = std::filesystem;

// The file's code without // comments.
std::string code_of(const fs::path& path) {
  std::ifstream in(path);
  std::string text, line;
  while (std::getline(in, line)) text += line.substr(0, line.find("//")) + "\n";
  return text;
}

// Problems of one model file: parallel words in its code, includes from other layers.
std::vector<std::string> problems(const fs::path& path) {
  std::vector<std::string> out;
  const std::string code = code_of(path);
  for (const char* word : {"DTensor", "DeviceMesh", "mesh", "Mesh", "Placement", "Shard", "Replicate", "Partial",
                           "rank", "parallel", "hp/dtensor", "hp/parallel", "hp/comm", "hp/mesh", "hp/pp"})
    if (code.find(word) != std::string::npos) out.push_back(path.string() + " mentions '" + word + "'");
  const std::regex include(R"re(#include\s*[<"](hp/[^>"]+)[>"])re");
  for (auto it = std::sregex_iterator(code.begin(), code.end(), include); it != std::sregex_iterator(); ++it) {
    const std::string header = (*it)[1];
    const bool model_header = std::regex_match(header, std::regex(R"(hp/models/[a-z0-9_]+/model\.h)"));
    const bool compute_layer =
        header.rfind("hp/core/", 0) == 0 || header.rfind("hp/kernels/", 0) == 0 || header.rfind("hp/nn/", 0) == 0;
    if (!compute_layer && !model_header) out.push_back(path.string() + " includes " + header);
  }
  return out;
}

// Every family's model files, found from the folders, so a new family is checked without editing
// this test.
TEST(ModelFiles, HaveNoParallelCode) {
  const fs::path root(HP_SOURCE_DIR);
  int families = 0;
  for (const auto& entry : fs::directory_iterator(root / "src/models")) {
    if (!entry.is_directory()) continue;
    const std::string family = entry.path().filename().string();
    const fs::path header = root / "include/hp/models" / family / "model.h", source = entry.path() / "model.cpp";
    ASSERT_TRUE(fs::exists(header)) << "family " << family << " has no " << header;
    ASSERT_TRUE(fs::exists(source)) << "family " << family << " has no " << source;
    for (const fs::path& file : {header, source})
      for (const std::string& problem : problems(file)) ADD_FAILURE() << problem;
    ++families;
  }
  EXPECT_GE(families, 1) << "no model family found under " << (root / "src/models");
}

}  // namespace
