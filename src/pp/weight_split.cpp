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

struct WeightGradientSplit::Branching {
  std::shared_ptr<Node> node;
  std::vector<size_t> path_edges;  // its next edges into the I path, cut before W
  variable_list grads;             // what the node received during I, one per node input
  bool recording = true;
};

namespace {

// Held by the node, so it holds its slot weakly: the slot holds the node, and a cycle would keep
// the node, and through it the stage's whole graph with its saved activations, alive for good.
struct RecordingHook : torch::autograd::FunctionPreHook {
  explicit RecordingHook(const std::shared_ptr<WeightGradientSplit::Branching>& slot) : slot(slot) {}
  variable_list operator()(const variable_list& grads) override {
    if (auto s = slot.lock(); s && s->recording) s->grads = grads;
    return grads;
  }
  std::weak_ptr<WeightGradientSplit::Branching> slot;
};

// The nodes from which one of `targets` is reachable (the targets included), walking `parents`.
std::unordered_set<Node*> reaching(const std::vector<Node*>& targets,
                                   std::unordered_map<Node*, std::vector<Node*>>& parents) {
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

}  // namespace

std::shared_ptr<WeightGradientSplit> WeightGradientSplit::prepare(const at::Tensor& output, const at::Tensor& input,
                                                                  const std::vector<at::Tensor>& params) {
  const std::shared_ptr<Node> root = output.grad_fn();
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  if (!root || !input_edge.function) return nullptr;
  // A non-leaf input's node finishes in W from the gradient I captured at its one input; a node
  // with other inputs would lose what reached those.
  if (!input.is_leaf() && input_edge.function->num_inputs() != 1) return nullptr;

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
  const std::unordered_set<Node*> on_path = reaching({input_edge.function.get()}, parents);
  if (!on_path.count(root.get())) return nullptr;

  auto split = std::make_shared<WeightGradientSplit>();
  std::vector<Node*> param_nodes;
  for (const at::Tensor& p : params) {
    const Edge edge = torch::autograd::impl::gradient_edge(p);
    if (!edge.function || !owner.count(edge.function.get())) continue;  // not used by this stage's graph
    param_nodes.push_back(edge.function.get());
    split->params_.push_back(p);
  }
  const std::unordered_set<Node*> toward_params = reaching(param_nodes, parents);

  // Every node of the I path with an edge off the path toward a parameter branches. Nothing else
  // needs restarting: each node off the path is reached from the path through such an edge (the
  // output's node is on the path), and no node on the path is reached from off it.
  for (Node* node : on_path) {
    if (!owner.count(node) || node == input_edge.function.get()) continue;  // not below the output; I's end
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
    if (!branches) continue;
    slot->node = owner.at(node);
    node->add_pre_hook(std::make_unique<RecordingHook>(slot));
    split->branching_.push_back(std::move(slot));
  }
  return split;
}

at::Tensor WeightGradientSplit::input_gradient(const at::Tensor& output, const at::Tensor& input,
                                               const at::Tensor& grad_output) {
  const std::vector<at::Tensor> grads =
      grad_output.defined() ? std::vector<at::Tensor>{grad_output} : std::vector<at::Tensor>{};
  at::Tensor dx = torch::autograd::grad({output}, {input}, grads, /*retain_graph=*/true)[0];
  for (auto& b : branching_) b->recording = false;
  // A non-leaf input (a stand-in on a stage whose real input has no gradient) leads on to
  // parameters: W continues from it with this gradient.
  if (!input.is_leaf() && dx.defined()) {
    input_root_ = torch::autograd::impl::gradient_edge(input);
    input_root_grad_ = dx;
  }
  return dx;
}

void WeightGradientSplit::weight_gradients() {
  // One pass from every branching node at once. With their edges into the I path cut, no gradient
  // flows from one of them to another (which would count the I path twice), and each computes
  // only its weight side (nodes skip the outputs whose edges are invalid).
  torch::autograd::edge_list roots;
  variable_list grads;
  for (const auto& b : branching_) {
    HP_CHECK(!b->recording, "pipeline: W ran before its I");
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
  if (input_root_.function) {
    roots.push_back(std::move(input_root_));
    grads.push_back(std::move(input_root_grad_));
  }
  if (!roots.empty()) {
    torch::autograd::edge_list outputs;
    for (const at::Tensor& p : params_) outputs.push_back(torch::autograd::impl::gradient_edge(p));
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, outputs);
  }
  branching_.clear();  // drops the graph
  params_.clear();
}

}  // namespace hp::pp
