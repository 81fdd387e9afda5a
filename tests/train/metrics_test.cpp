// metrics.jsonl: every record is a line of valid JSON, whatever bytes its strings hold.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "scratch_dir.h"
#include "train/metrics.h"

namespace hp::train::detail {
namespace {

// Guards the end of a short run: the greedy sample of a barely trained byte-level model is often
// not UTF-8 (a lone continuation byte here), and writing it once threw at the run's last step.
TEST(MetricsLog, WritesBytesThatAreNotUtf8AsReplacementCharacters) {
  const std::string dir = test::scratch_dir("hp_metrics_utf8");
  {
    MetricsLog log(dir, -1, /*progress=*/false);
    log.write({{"kind", "final"}, {"sample", std::string("The \xBF cat")}});
  }
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const nlohmann::json record = nlohmann::json::parse(line);
  EXPECT_EQ(record.at("sample").get<std::string>(), "The \xEF\xBF\xBD cat");
}

}  // namespace
}  // namespace hp::train::detail
