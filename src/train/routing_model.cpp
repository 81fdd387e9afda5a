#include "hp/train/routing_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hp/core/error.h"

namespace hp::train {
namespace {

// `total` rows over len(weights) experts in proportion to the weights, none above `cap`: an expert
// whose share reaches the cap gets it and leaves, the rest share what is left (evenly where their
// weights are all zero), then floors plus one for the largest remainders.
std::vector<int64_t> apportion(std::vector<double> weights, int64_t total, int64_t cap) {
  const size_t n = weights.size();
  HP_CHECK(total <= cap * static_cast<int64_t>(n), "routing model: ", total, " rows do not fit ", n,
           " experts of at most ", cap, " each");
  std::vector<int64_t> counts(n, 0);
  std::vector<bool> full(n, false);
  int64_t remaining = total;
  double sum = 0.0;
  for (bool capped = true; capped;) {
    capped = false;
    sum = 0.0;
    for (size_t i = 0; i < n; ++i)
      if (!full[i]) sum += weights[i];
    if (sum <= 0.0) {
      for (size_t i = 0; i < n; ++i)
        if (!full[i]) weights[i] = 1.0, sum += 1.0;
    }
    for (size_t i = 0; i < n; ++i)
      if (!full[i] && static_cast<double>(remaining) * weights[i] / sum >= static_cast<double>(cap)) {
        counts[i] = cap;
        full[i] = true;
        remaining -= cap;
        capped = true;
      }
  }
  std::vector<std::pair<double, size_t>> remainders;
  int64_t given = 0;
  for (size_t i = 0; i < n; ++i) {
    if (full[i]) continue;
    const double share = static_cast<double>(remaining) * weights[i] / sum;
    counts[i] = static_cast<int64_t>(std::floor(share));
    given += counts[i];
    remainders.emplace_back(share - std::floor(share), i);
  }
  // Largest remainder first; ties to the lower expert.
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t j = 0; given < remaining && j < remainders.size(); ++j, ++given) ++counts[remainders[j].second];
  HP_CHECK(given == remaining, "routing model: could not share out ", remaining, " rows");
  return counts;
}

std::map<std::string, std::vector<double>> read_histogram(const std::string& path) {
  std::ifstream in(path);
  HP_CHECK(in.good(), "routing model: cannot read the histogram file '", path, "'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);  // strict: nothing may follow the object
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("routing model: '", path, "' is not JSON: ", e.what());
  }
  HP_CHECK(j.is_object(), "routing model: '", path,
           "' must hold a JSON object of router FQN -> loads, e.g. {\"layers.0.mlp.router\": [12, 30, 9, 13]}");
  std::map<std::string, std::vector<double>> loads;
  for (const auto& [router, values] : j.items()) {
    HP_CHECK(
        values.is_array() && std::all_of(values.begin(), values.end(), [](const auto& v) { return v.is_number(); }),
        "routing model: '", path, "': the loads of '", router, "' must be an array of numbers");
    loads[router] = values.get<std::vector<double>>();
  }
  return loads;
}

}  // namespace

RoutingModel RoutingModel::balanced() { return RoutingModel(); }

RoutingModel RoutingModel::skewed(double hot_share) {
  HP_CHECK(hot_share > 0.0 && hot_share < 1.0, "routing model: skewed needs a hot share in (0, 1), got ", hot_share);
  RoutingModel m;
  m.kind_ = Kind::kSkewed;
  m.hot_share_ = hot_share;
  return m;
}

RoutingModel RoutingModel::histogram(std::map<std::string, std::vector<double>> loads_by_router) {
  HP_CHECK(!loads_by_router.empty(), "routing model: a histogram with no routers");
  for (auto& [router, loads] : loads_by_router) {
    HP_CHECK(
        !loads.empty() && std::all_of(loads.begin(), loads.end(), [](double v) { return std::isfinite(v) && v >= 0; }),
        "routing model: the loads of '", router, "' must be finite numbers >= 0, one per expert");
    // Relative to the largest, so that their sum is finite whatever their scale.
    const double largest = *std::max_element(loads.begin(), loads.end());
    if (largest > 0)
      for (double& v : loads) v /= largest;
  }
  RoutingModel m;
  m.kind_ = Kind::kHistogram;
  m.loads_ = std::move(loads_by_router);
  return m;
}

RoutingModel RoutingModel::parse(const std::string& spec) {
  if (spec == "balanced") return balanced();
  if (spec.rfind("skewed:", 0) == 0) {
    const std::string share = spec.substr(7);
    size_t used = 0;
    double value = 0.0;
    // A plain decimal number (std::stod would also take leading blanks, hex and "inf").
    if (!share.empty() && share.find_first_not_of("0123456789.eE+-") == std::string::npos) {
      try {
        value = std::stod(share, &used);
      } catch (const std::exception&) {
        used = 0;
      }
    }
    HP_CHECK(!share.empty() && used == share.size(), "routing model '", spec,
             "': skewed:S needs S, the hot expert's share of the rows, a number in (0, 1)");
    return skewed(value);
  }
  if (spec.rfind("histogram:", 0) == 0) {
    HP_CHECK(spec.size() > 10, "routing model '", spec, "': histogram:FILE needs the file");
    return histogram(read_histogram(spec.substr(10)));
  }
  HP_FAIL("routing model '", spec, "' is unknown: balanced, skewed:S (S in (0, 1)), or histogram:FILE");
}

std::vector<int64_t> RoutingModel::counts(const std::string& router_fqn, int64_t tokens, int64_t top_k,
                                          int64_t experts) const {
  HP_CHECK(tokens >= 0 && top_k > 0 && experts >= top_k, "routing model: ", tokens, " tokens choosing ", top_k, " of ",
           experts, " experts");
  std::vector<double> weights(experts, 1.0);
  if (kind_ == Kind::kSkewed && experts > 1) {
    std::fill(weights.begin(), weights.end(), (1.0 - hot_share_) / static_cast<double>(experts - 1));
    weights[0] = hot_share_;
  }
  if (kind_ == Kind::kHistogram) {
    const auto it = loads_.find(router_fqn);
    HP_CHECK(it != loads_.end(), "routing model: the histogram has no loads for router '", router_fqn, "'");
    HP_CHECK(static_cast<int64_t>(it->second.size()) == experts, "routing model: the histogram gives router '",
             router_fqn, "' ", it->second.size(), " loads; it has ", experts, " experts");
    weights = it->second;
  }
  return apportion(std::move(weights), tokens * top_k, tokens);
}

std::string RoutingModel::str() const {
  std::ostringstream out;
  switch (kind_) {
    case Kind::kBalanced:
      out << "balanced";
      break;
    case Kind::kSkewed:
      out << "skewed:" << hot_share_;
      break;
    case Kind::kHistogram:
      out << "histogram (" << loads_.size() << " routers)";
      break;
  }
  return out.str();
}

}  // namespace hp::train
