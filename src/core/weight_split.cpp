#include "hp/core/weight_split.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "hp/core/error.h"

namespace hp {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// One node where branches leave the I path, and what it received during I.
struct Branching {
  std::shared_ptr<Node> node;
  std::vector<size_t> path_edges;  // its next edges into the I path, cut before W
  variable_list grads;             // what the node received during I, one per node input
  bool recording = true;
};

// Held by the node, so it holds its slot weakly: the slot holds the node, and a cycle would keep
// the node, and through it the whole graph with its saved activations, alive for good.
struct RecordingHook : torch::autograd::FunctionPreHook {
  explicit RecordingHook(const std::shared_ptr<Branching>& slot) : slot(slot) {}
  variable_list operator()(const variable_list& grads) override {
    if (auto s = slot.lock(); s && s->recording) s->grads = grads;
    return grads;
  }
  std::weak_ptr<Branching> slot;
};

// The graph below an output: each node's parents (the nodes that send it gradients), and the
// shared pointer that owns it.
struct GraphBelow {
  explicit GraphBelow(const std::shared_ptr<Node>& root) {
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
  }

  // The nodes from which one of `targets` is reachable (the targets included).
  std::unordered_set<Node*> reaching(const std::vector<Node*>& targets) {
    std::unordered_set<Node*> found;
    std::vector<Node*> stack = targets;
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      if (!found.insert(node).second) continue;
      for (Node* p : parents[node]) stack.push_back(p);
    }
    return found;
  }

  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::unordered_map<Node*, std::shared_ptr<Node>> owner;
};

}  // namespace

struct WeightGradientSplit::Impl {
  std::vector<std::shared_ptr<Branching>> branching;
  // The nodes of the I path without a branch: W never runs them, so what they saved for backward
  // (softmax outputs, activations' inputs, attention's statistics) goes when I is done with it.
  std::vector<std::shared_ptr<Node>> only_for_i;
  edge_list param_edges;  // W's outputs
  Edge input_root;        // a non-leaf input's node, with the gradient I computed for it
  at::Tensor input_root_grad;

  // Hooks every node of the I path (the nodes below `root` that reach an input, the inputs' own
  // nodes aside) with an edge off the path toward a parameter. Nothing else needs restarting: each
  // node off the path is reached from the path through such an edge (the output's node is on the
  // path), and no node on the path is reached from off it. The path's other nodes go to
  // only_for_i. False when the output reaches no input.
  bool hook_branches(GraphBelow& graph, Node* root, const std::vector<Node*>& input_nodes,
                     const std::vector<Node*>& param_nodes) {
    const std::unordered_set<Node*> on_path = graph.reaching(input_nodes);
    if (!on_path.count(root)) return false;
    const std::unordered_set<Node*> toward_params = graph.reaching(param_nodes);
    for (Node* node : on_path) {
      if (!graph.owner.count(node)) continue;  // not below the output
      if (std::find(input_nodes.begin(), input_nodes.end(), node) != input_nodes.end()) continue;  // I's end
      auto slot = std::make_shared<Branching>();
      bool branches = false;
      const auto& edges = node->next_edges();
      for (size_t i = 0; i < edges.size(); ++i) {
        Node* next = edges[i].function.get();
        if (!next) continue;
        if (on_path.count(next))
          slot->path_edges.push_back(i);
        else
          branches = branches || toward_params.count(next);
      }
      if (!branches) {
        only_for_i.push_back(graph.owner.at(node));
        continue;
      }
      slot->node = graph.owner.at(node);
      node->add_pre_hook(std::make_unique<RecordingHook>(slot));
      branching.push_back(std::move(slot));
    }
    return true;
  }
};

WeightGradientSplit::WeightGradientSplit() : impl_(std::make_unique<Impl>()) {}
WeightGradientSplit::~WeightGradientSplit() = default;

std::shared_ptr<WeightGradientSplit> WeightGradientSplit::prepare(const at::Tensor& output, const at::Tensor& input,
                                                                  const std::vector<at::Tensor>& params) {
  const std::shared_ptr<Node> root = output.grad_fn();
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  if (!root || !input_edge.function) return nullptr;
  // A non-leaf input's node finishes in W from the gradient I captured at its one input; a node
  // with other inputs would lose what reached those.
  if (!input.is_leaf() && input_edge.function->num_inputs() != 1) return nullptr;
  GraphBelow graph(root);
  auto split = std::make_shared<WeightGradientSplit>();
  std::vector<Node*> param_nodes;
  for (const at::Tensor& p : params) {
    Edge edge = torch::autograd::impl::gradient_edge(p);
    if (!edge.function || !graph.owner.count(edge.function.get())) continue;  // not used by this graph
    param_nodes.push_back(edge.function.get());
    split->impl_->param_edges.push_back(std::move(edge));
  }
  if (!split->impl_->hook_branches(graph, root.get(), {input_edge.function.get()}, param_nodes)) return nullptr;
  return split;
}

std::shared_ptr<WeightGradientSplit> WeightGradientSplit::prepare_for_leaves(const at::Tensor& output,
                                                                             const std::vector<at::Tensor>& inputs) {
  const std::shared_ptr<Node> root = output.grad_fn();
  if (!root) return nullptr;
  std::vector<Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    HP_CHECK(x.is_leaf(), "WeightGradientSplit::prepare_for_leaves: input ", i,
             " is no leaf (it has a grad_fn); give the leaves I ends at");
    if (const Edge edge = torch::autograd::impl::gradient_edge(x); edge.function)
      input_nodes.push_back(edge.function.get());
  }
  GraphBelow graph(root);
  auto split = std::make_shared<WeightGradientSplit>();
  std::vector<Node*> param_nodes;
  for (const auto& [node, owner] : graph.owner)
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr &&
        std::find(input_nodes.begin(), input_nodes.end(), node) == input_nodes.end()) {
      param_nodes.push_back(node);
      split->impl_->param_edges.emplace_back(owner, 0);
    }
  if (!split->impl_->hook_branches(graph, root.get(), input_nodes, param_nodes)) return nullptr;
  return split;
}

at::Tensor WeightGradientSplit::input_gradient(const at::Tensor& output, const at::Tensor& input,
                                               const at::Tensor& grad_output) {
  return input_gradients(output, {input}, grad_output)[0];
}

std::vector<at::Tensor> WeightGradientSplit::input_gradients(const at::Tensor& output,
                                                             const std::vector<at::Tensor>& inputs,
                                                             const at::Tensor& grad_output) {
  const std::vector<at::Tensor> grads =
      grad_output.defined() ? std::vector<at::Tensor>{grad_output} : std::vector<at::Tensor>{};
  std::vector<at::Tensor> dx = torch::autograd::grad({output}, inputs, grads, /*retain_graph=*/true,
                                                     /*create_graph=*/false, /*allow_unused=*/inputs.size() > 1);
  for (auto& b : impl_->branching) b->recording = false;
  for (const auto& node : std::exchange(impl_->only_for_i, {})) node->release_variables();
  // A non-leaf input (a stand-in on a stage whose real input has no gradient) leads on to
  // parameters: W continues from it with this gradient.
  if (inputs.size() == 1 && !inputs[0].is_leaf() && dx[0].defined()) {
    impl_->input_root = torch::autograd::impl::gradient_edge(inputs[0]);
    impl_->input_root_grad = dx[0];
  }
  return dx;
}

void WeightGradientSplit::weight_gradients() {
  // One pass from every branching node at once. With their edges into the I path cut, no gradient
  // flows from one of them to another (which would count the I path twice), and each computes
  // only its weight side (nodes skip the outputs whose edges are invalid).
  Impl& s = *impl_;
  edge_list roots;
  variable_list grads;
  for (const auto& b : s.branching) {
    HP_CHECK(!b->recording, "WeightGradientSplit: W ran before its I");
    for (size_t i : b->path_edges) b->node->next_edges()[i] = Edge();
    // The node's pre-hooks (tensor hooks such as register_hook or retain_grad on its output, and
    // the recorder) saw these gradients during I; running them again would apply them twice.
    b->node->pre_hooks().clear();
    for (size_t i = 0; i < b->grads.size(); ++i) {
      if (!b->grads[i].defined()) continue;  // no gradient reached this input of the node
      roots.emplace_back(b->node, static_cast<uint32_t>(i));
      grads.push_back(b->grads[i]);
    }
  }
  if (s.input_root.function) {
    roots.push_back(std::move(s.input_root));
    grads.push_back(std::move(s.input_root_grad));
  }
  if (!roots.empty())
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, s.param_edges);
  s.branching.clear();  // drops the graph
  s.param_edges.clear();
}

}  // namespace hp
