// What a dry run assumes the routers of a mixture of experts choose. A dry run computes no scores,
// but a MoE layer's memory and its expert-parallel exchange depend on how many (token, choice) rows
// each expert gets: a routing model says, per router and forward.
//
//   hp::train::DryRunOptions options;
//   options.routing = hp::train::RoutingModel::parse("skewed:0.4");
//   hp::train::dry_run(config, 8, 0, options);
//
// Every forward of a layer, on every rank, gets the same counts: under expert parallelism each
// rank then sends every expert's rank the same rows, and the rank that holds a hot expert receives
// that expert's rows from all of them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hp::train {

class RoutingModel {
 public:
  // The rows spread evenly over the experts (what load balancing aims for).
  static RoutingModel balanced();
  // Expert 0 of every layer takes `hot_share` (in (0, 1)) of the rows, but at most one row per
  // token (so a share above 1 / top_k gives it every token), and the other experts share what is
  // left evenly. Under expert parallelism the rank holding expert 0 is the hot rank.
  static RoutingModel skewed(double hot_share);
  // Each router's relative loads (any scale, e.g. rows counted in a real run), by its FQN
  // ("layers.0.mlp.router"): counts in proportion, at most one row per token.
  static RoutingModel histogram(std::map<std::string, std::vector<double>> loads_by_router);
  // "balanced", "skewed:S", or "histogram:FILE" with FILE a JSON object of router FQN -> loads.
  static RoutingModel parse(const std::string& spec);

  // How many of `tokens` tokens' top_k choices each of `experts` experts of router `router_fqn`
  // gets: counts adding up to tokens * top_k, none above tokens, shared out by largest remainder
  // (ties to the lower expert).
  std::vector<int64_t> counts(const std::string& router_fqn, int64_t tokens, int64_t top_k, int64_t experts) const;
  // "balanced", "skewed:0.4", "histogram (3 routers)".
  std::string str() const;

 private:
  enum class Kind { kBalanced, kSkewed, kHistogram };
  Kind kind_ = Kind::kBalanced;
  double hot_share_ = 0.0;
  std::map<std::string, std::vector<double>> loads_;
};

}  // namespace hp::train
