// shard_module: the general, per-tensor form of a parallel plan (MindSpore HyperParallel's
// shard_module). Where the TP styles know one module type each, a ShardingPlan names placements
// directly, on a mesh of any rank:
//
//   hp::ShardingPlan plan;
//   plan.plan = {{"layers.*.w1.weight", {hp::Shard(0), hp::Replicate()}},
//                {"layers.*.w2.weight", {hp::Shard(1), hp::Replicate()}}};
//   plan.input_plan = {{"", {hp::Placements{hp::Replicate(), hp::Shard(0)}}}};  // the model's input
//   plan.output_plan = {{"", {hp::Replicate(), hp::Replicate()}}};
//   hp::shard_module(*model, mesh, plan);
//
// Every parameter becomes a DTensor: placed as the first matching plan entry says, Replicate on
// every mesh dim if no entry matches (so a module computes on DTensors throughout). Inputs named by
// input_plan are laid out before the module runs: a plain tensor is taken as the whole value (the
// same on every rank) and each rank keeps its piece without communication; a DTensor is
// redistributed. Outputs named by output_plan are redistributed after it runs and stay DTensors.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/dtensor/placement.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/module.h"

namespace hp {

struct ShardingPlan {
  // Parameter FQN pattern ('*' = one segment) -> one placement per mesh dim.
  std::vector<std::pair<std::string, Placements>> plan;
  // Module FQN pattern ("" = the root) -> placements of each input; nullopt leaves that input alone.
  std::vector<std::pair<std::string, std::vector<std::optional<Placements>>>> input_plan;
  // Module FQN pattern -> placements of its output.
  std::vector<std::pair<std::string, Placements>> output_plan;
};

// Checks the whole plan (patterns match, placements fit the mesh and the shapes), then applies it.
void shard_module(nn::Module& model, const DeviceMesh& mesh, const ShardingPlan& plan);

}  // namespace hp
