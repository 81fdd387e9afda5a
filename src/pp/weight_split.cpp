#include "pp/weight_split.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <unordered_map>
#include <unordered_set>

#include "hp/core/error.h"

namespace hp::pp {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct WeightGradientSplit::Recorded {
  std::shared_ptr<Node> node;
  torch::autograd::edge_list params;  // the parameters on this node's branch
  variable_list grads;                // what the node received during I, one per node input
  bool recording = true;
};

namespace {

// Held by the node, so it holds its slot weakly: the slot holds the node, and a cycle would keep
// the node, and through it the stage's whole graph with its saved activations, alive for good.
struct RecordingHook : torch::autograd::FunctionPreHook {
  explicit RecordingHook(const std::shared_ptr<WeightGradientSplit::Recorded>& slot) : slot(slot) {}
  variable_list operator()(const variable_list& grads) override {
    if (auto s = slot.lock(); s && s->recording) s->grads = grads;
    return grads;
  }
  std::weak_ptr<WeightGradientSplit::Recorded> slot;
};

}  // namespace

std::shared_ptr<WeightGradientSplit> WeightGradientSplit::prepare(const at::Tensor& output, const at::Tensor& input,
                                                                 const std::vector<at::Tensor>& params) {
  const std::shared_ptr<Node> root = output.grad_fn();
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  if (!root || !input_edge.function) return nullptr;

  // The graph below the output, with each node's parents (the nodes that send it gradients).
  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::unordered_map<Node*, std::shared_ptr<Node>> owner;
  std::vector<Node*> stack = {root.get()};
  owner[root.get()] = root;
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& e : node->next_edges()) {
      if (!e.function) continue;
      parents[e.function.get()].push_back(node);
      if (owner.emplace(e.function.get(), e.function).second) stack.push_back(e.function.get());
    }
  }
  // The I path: nodes from which the input's gradient node is reachable.
  std::unordered_set<Node*> on_path;
  stack = {input_edge.function.get()};
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!on_path.insert(node).second) continue;
    for (Node* p : parents[node]) stack.push_back(p);
  }
  if (!on_path.count(root.get())) return nullptr;

  // From each parameter, walk up its branch until it meets the I path: the meeting nodes branch.
  // W restarts each branching node on its own, asking only for its branch's parameters; that is
  // exact only when each parameter hangs off one branching node. A parameter met through several
  // (a weight used twice, or parameters joined by one node such as an FSDP unit's gather) could
  // have a branching node's I-path gradient recomputed and counted twice, so such graphs are not
  // split (the caller falls back to one plain backward for W).
  std::unordered_map<Node*, torch::autograd::edge_list> branch_params;
  for (const at::Tensor& p : params) {
    const Edge edge = torch::autograd::impl::gradient_edge(p);
    if (!edge.function || !owner.count(edge.function.get())) continue;  // not used by this stage's graph
    std::unordered_set<Node*> met, seen;
    stack = {edge.function.get()};
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      if (on_path.count(node)) {
        met.insert(node);
        continue;
      }
      if (!seen.insert(node).second) continue;
      for (Node* parent : parents[node]) stack.push_back(parent);
    }
    if (met.size() != 1) return nullptr;
    branch_params[*met.begin()].push_back(edge);
  }
  auto split = std::make_shared<WeightGradientSplit>();
  for (auto& [node, edges] : branch_params) {
    auto slot = std::make_shared<Recorded>();
    slot->node = owner.at(node);
    slot->params = std::move(edges);
    node->add_pre_hook(std::make_unique<RecordingHook>(slot));
    split->recorded_.push_back(std::move(slot));
  }
  return split;
}

at::Tensor WeightGradientSplit::input_gradient(const at::Tensor& output, const at::Tensor& input,
                                               const at::Tensor& grad_output) {
  const std::vector<at::Tensor> grads = grad_output.defined() ? std::vector<at::Tensor>{grad_output}
                                                              : std::vector<at::Tensor>{};
  at::Tensor dx = torch::autograd::grad({output}, {input}, grads, /*retain_graph=*/true)[0];
  for (auto& r : recorded_) r->recording = false;
  return dx;
}

void WeightGradientSplit::weight_gradients() {
  for (const auto& r : recorded_) {
    HP_CHECK(!r->recording, "pipeline: W ran before its I");
    torch::autograd::edge_list roots;
    variable_list grads;
    for (size_t i = 0; i < r->grads.size(); ++i) {
      if (!r->grads[i].defined()) continue;
      roots.emplace_back(r->node, static_cast<uint32_t>(i));
      grads.push_back(r->grads[i]);
    }
    if (roots.empty()) continue;  // no gradient reached this node
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, r->params);
  }
  recorded_.clear();  // drops the graph
}

}  // namespace hp::pp
