// DTensor as an at::Tensor: construction and conversion round trips, ops through sharding rules
// against the same ops on full tensors, autograd at the global level, AdamW on DTensor parameters,
// and clear errors.
#include <hp/core/error.h>
#include <hp/dtensor/dtensor.h>
#include <hp/dtensor/sharding_rule.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "test_util.h"

namespace hp::test {
namespace {

at::Tensor global_data(std::vector<int64_t> shape, int seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed));
}

at::Tensor full(const at::Tensor& t) { return DTensor(t).full_tensor(); }

// distribute_tensor then full_tensor gives the tensor back bitwise, for uneven shapes too, and
// the local piece has the spec's local shape.
TEST(DTensor, DistributeAndFullTensorRoundTrip) {
  for (int world : {1, 2, 3, 4}) {
    run(world, [](const comm::ProcessGroup& g) {
      DeviceMesh mesh = init_device_mesh(g, "cpu", {g.size()}, {"x"});
      const at::Tensor full = global_data({7, 5}, 1);
      for (const Placements& p : std::vector<Placements>{{Shard(0)}, {Shard(1)}, {Replicate()}}) {
        DTensor d = distribute_tensor(full, mesh, p);
        if (d.sizes() != full.sizes() || !is_dtensor(d)) throw std::runtime_error("not a DTensor of the global shape");
        if (d.to_local().sizes().vec() != d.spec().local_shape()) throw std::runtime_error("local shape");
        check_close(d.full_tensor(), full, "round trip " + to_string(p), /*bitwise=*/true);
      }
    });
  }
}

// from_local finds the global shape from the pieces and rejects pieces torch.chunk would not make.
TEST(DTensor, FromLocalInfersAndChecksTheGlobalShape) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor full = global_data({5, 3}, 2);
    const at::Tensor piece = g.rank() == 0 ? full.narrow(0, 0, 3) : full.narrow(0, 3, 2);
    DTensor d = DTensor::from_local(piece, mesh, {Shard(0)});
    if (d.sizes() != full.sizes()) throw std::runtime_error("inferred shape");
    check_close(d.full_tensor(), full, "from_local round trip", true);
    const at::Tensor wrong = at::zeros({g.rank() == 0 ? 2 : 3, 3});  // 2 | 3 is not how 5 splits
    expect_error([&] { DTensor::from_local(wrong, mesh, {Shard(0)}); },
                 "hold pieces of sizes [2, 3], which are not the torch.chunk pieces of 5 ([3, 2])");
  });
}

// Ops on DTensors equal the ops on full tensors, for every placement of the operands on a 1-D
// mesh of 3 (uneven pieces) and a (2, 2) mesh; sums split across ranks within fp32 rtol 1e-5.
TEST(DTensor, OpsMatchFullTensorOps) {
  for (int world : {3, 4}) {
    run(world, [world](const comm::ProcessGroup& g) {
      DeviceMesh mesh =
          world == 4 ? init_device_mesh(g, "cpu", {2, 2}, {"a", "b"}) : init_device_mesh(g, "cpu", {3}, {"a"});
      std::vector<Placements> choices;
      for (const Placement& p : {Shard(0), Shard(1), Replicate()}) {
        if (mesh.ndim() == 1)
          choices.push_back({p});
        else
          for (const Placement& q : {Shard(0), Shard(1), Replicate()}) choices.push_back({p, q});
      }
      const at::Tensor a = global_data({7, 6}, 3), b = global_data({7, 6}, 4), m = global_data({6, 5}, 5);
      const at::Tensor row = global_data({6}, 6);
      for (const Placements& pa : choices) {
        const DTensor da = distribute_tensor(a, mesh, pa);
        const std::string tag = " with a " + to_string(pa);
        check_close(full(at::gelu(da)), at::gelu(a), "gelu" + tag);
        check_close(full((da * 2.5 - 1.0)), a * 2.5 - 1.0, "scalar arithmetic" + tag);
        check_close(full(da.sum()), a.sum(), "sum" + tag);
        check_close(full(da.sum(1)), a.sum(1), "sum(1)" + tag);
        check_close(full(da.mean(0, /*keepdim=*/true)), a.mean(0, true), "mean(0, keepdim)" + tag);
        check_close(full(da.amax(1)), a.amax(1), "amax(1)" + tag);
        check_close(full(da.t()), a.t(), "t" + tag, true);
        check_close(full(da.unsqueeze(1)), a.unsqueeze(1), "unsqueeze" + tag, true);
        check_close(full(da.view({7, 2, 3})), a.view({7, 2, 3}), "view split" + tag, true);
        check_close(full(da.reshape({-1})), a.reshape({-1}), "view flatten" + tag, true);
        check_close(full(at::ones_like(da)), at::ones_like(a), "ones_like" + tag, true);
        for (const Placements& pb : choices) {
          const DTensor db = distribute_tensor(b, mesh, pb);
          const std::string tag2 = tag + ", b " + to_string(pb);
          check_close(full((da + db)), a + b, "add" + tag2, true);
          check_close(full((da * db)), a * b, "mul" + tag2, true);
          check_close(full(at::maximum(da, db)), at::maximum(a, b), "maximum" + tag2, true);
          check_close(full(at::mm(da, distribute_tensor(m, mesh, pb))), at::mm(a, m), "mm" + tag2);
          Placements prow;  // the row spans a's dim 1: shard it where b shards dim 1
          for (const Placement& p : pb) prow.push_back(p.is_shard(1) ? Shard(0) : Replicate());
          const DTensor drow = distribute_tensor(row, mesh, prow);
          check_close(full(da + drow), a + row, "broadcast add" + tag2, true);
        }
      }
    });
  }
}

// Partial values: a sum over a sharded dim is Partial until it is reduced, and linear ops keep it
// Partial (no communication) with the right value.
TEST(DTensor, PartialResultsStayPartialThroughLinearOps) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor a = global_data({6, 4}, 7);
    DTensor total(distribute_tensor(a, mesh, {Shard(0)}).sum(0));
    if (!total.placements()[0].is_partial()) throw std::runtime_error("sum over the sharded dim is not Partial");
    DTensor scaled((total * 3.0) + total);
    if (!scaled.placements()[0].is_partial()) throw std::runtime_error("linear ops did not keep Partial");
    check_close(full(scaled), a.sum(0) * 3.0 + a.sum(0), "partial arithmetic");
    DTensor shifted(total + 1.0);  // not linear: reduced first
    if (!shifted.placements()[0].is_replicate()) throw std::runtime_error("Partial + scalar was not reduced");
    check_close(full(shifted), a.sum(0) + 1.0, "partial + scalar");
  });
}

// Gradients through DTensor ops equal single-device gradients (fp32 rtol 1e-5), and the
// gradients of DTensor leaves are DTensors with the leaves' shapes.
TEST(DTensor, BackwardMatchesSingleDevice) {
  run(4, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"dp", "tp"});
    const at::Tensor x = global_data({6, 8}, 8), w1 = global_data({8, 10}, 9), w2 = global_data({10, 3}, 10);
    // Single device.
    at::Tensor rw1 = w1.clone().requires_grad_(true), rw2 = w2.clone().requires_grad_(true);
    at::Tensor ref_loss = (at::gelu(at::mm(at::gelu(at::mm(x, rw1)), rw2)) * 0.5).sum();
    ref_loss.backward();
    // Distributed: x sharded on dp rows, w1 column-wise and w2 row-wise on tp (Megatron style).
    DTensor dx = distribute_tensor(x, mesh, {Shard(0), Replicate()});
    DTensor dw1 = distribute_tensor(w1, mesh, {Replicate(), Shard(1)});
    DTensor dw2 = distribute_tensor(w2, mesh, {Replicate(), Shard(0)});
    dw1.requires_grad_(true);
    dw2.requires_grad_(true);
    at::Tensor loss = (at::gelu(at::mm(at::gelu(at::mm(dx, dw1)), dw2)) * 0.5).sum();
    loss.backward();
    check_close(DTensor(loss).full_tensor(), ref_loss.detach(), "loss");
    if (!is_dtensor(dw1.grad()) || dw1.grad().sizes() != w1.sizes()) throw std::runtime_error("grad is not a DTensor");
    check_close(DTensor(dw1.grad()).full_tensor(), rw1.grad(), "grad w1");
    check_close(DTensor(dw2.grad()).full_tensor(), rw2.grad(), "grad w2");
  });
}

// from_local / redistribute / to_local are differentiable; a Partial input's gradient is the
// replicated output gradient (PyTorch's rule).
TEST(DTensor, ConversionsAreDifferentiable) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor w = global_data({4, 3}, 11);  // the same upstream gradient on every rank
    for (const Placement& p : {Shard(0), Shard(1), Partial()}) {
      DTensorSpec spec(mesh, {p}, {4, 3});
      at::Tensor local = at::randn(spec.local_shape()).requires_grad_(true);
      at::Tensor full = DTensor::from_local(local, mesh, {p}, std::vector<int64_t>{4, 3})
                            .redistribute(mesh, {Replicate()})
                            .to_local();
      (full * w).sum().backward();
      at::Tensor want = w;
      if (p.is_shard()) {
        auto [shape, offset] = spec.local_shape_and_offset({g.rank()});
        want = w.narrow(p.dim(), offset[p.dim()], shape[p.dim()]);
      }
      check_close(local.grad(), want, "grad through from_local(" + p.str() + ") -> R -> to_local", true);
    }
  });
}

// torch::optim::AdamW stepping DTensor parameters gives bitwise the parameters it gives on the
// full tensors (every op of the step is elementwise, so sharding cannot change a bit).
TEST(DTensor, AdamWOnDTensorParametersIsBitwiseEqual) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor init = global_data({5, 4}, 12);
    at::Tensor full = init.clone().requires_grad_(true);
    DTensor sharded = distribute_tensor(init, mesh, {Shard(0)});
    sharded.requires_grad_(true);
    torch::optim::AdamW full_opt({full}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::AdamW dist_opt({sharded}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor grad = global_data({5, 4}, 100 + step);
      full.mutable_grad() = grad.clone();
      sharded.mutable_grad() = distribute_tensor(grad, mesh, {Shard(0)});
      full_opt.step();
      dist_opt.step();
      check_close(sharded.full_tensor(), full.detach(), "AdamW step " + std::to_string(step), /*bitwise=*/true);
    }
  });
}

// Softmax-like, joining/splitting and embedding ops, values and input gradients, for every
// placement of the input on a (2, 2) mesh.
TEST(DTensor, NnOpsMatchFullTensorOpsWithGradients) {
  run(4, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"a", "b"});
    const at::Tensor a = global_data({7, 6}, 20);
    const at::Tensor table = global_data({11, 4}, 21);
    const at::Tensor ids = at::randint(0, 11, {7, 3}, at::make_generator<at::CPUGeneratorImpl>(22));
    using Op = std::function<at::Tensor(const at::Tensor&)>;
    const std::vector<std::pair<std::string, Op>> ops = {
        {"log_softmax(1)", [](const at::Tensor& x) { return at::log_softmax(x, 1); }},
        {"softmax(0)", [](const at::Tensor& x) { return at::softmax(x, 0); }},
        {"cat(0)",
         [](const at::Tensor& x) {
           return at::cat({x, x * 2.0}, 0);
         }},
        {"stack(1)",
         [](const at::Tensor& x) {
           return at::stack({x, x * 2.0}, 1);
         }},
        {"split(4, 1)[1]", [](const at::Tensor& x) { return x.split(4, 1)[1] * 3.0; }},
    };
    for (const Placement& p : {Shard(0), Shard(1), Replicate()}) {
      for (const Placement& q : {Shard(0), Shard(1), Replicate()}) {
        const Placements pl{p, q};
        for (const auto& [name, op] : ops) {
          at::Tensor ref_in = a.clone().requires_grad_(true);
          at::Tensor ref_out = op(ref_in);
          const at::Tensor w = global_data(ref_out.sizes().vec(), 23);
          (ref_out * w).sum().backward();
          DTensor din = distribute_tensor(a, mesh, pl);
          din.requires_grad_(true);
          at::Tensor out = op(din);
          (out * distribute_tensor(w, mesh, Placements(2, Replicate()))).sum().backward();
          check_close(full(out), ref_out.detach(), name + " on " + to_string(pl));
          check_close(full(din.grad()), ref_in.grad(), "grad of " + name + " on " + to_string(pl));
        }
        // Embedding: the table replicated or sharded on its embedding dim, the indices anywhere.
        for (const Placements& tp : std::vector<Placements>{{Replicate(), Replicate()}, {Replicate(), Shard(1)}}) {
          at::Tensor ref_table = table.clone().requires_grad_(true);
          at::Tensor ref_out = at::embedding(ref_table, ids);
          const at::Tensor w = global_data(ref_out.sizes().vec(), 24);
          (ref_out * w).sum().backward();
          DTensor dtable = distribute_tensor(table, mesh, tp);
          dtable.requires_grad_(true);
          at::Tensor out = at::embedding(dtable, distribute_tensor(ids, mesh, pl));
          (out * distribute_tensor(w, mesh, Placements(2, Replicate()))).sum().backward();
          check_close(full(out), ref_out.detach(), "embedding, table " + to_string(tp) + " ids " + to_string(pl), true);
          check_close(full(dtable.grad()), ref_table.grad(), "grad of embedding table " + to_string(tp));
        }
      }
    }
  });
}

// A two-layer MLP written with torch::nn::functional and softmax cross-entropy, its weights placed
// column-wise then row-wise (Megatron) and the batch sharded on "dp": loss and every gradient
// match single device within 1e-5.
TEST(DTensor, TwoLayerMlpColwiseRowwiseMatchesSingleDevice) {
  namespace F = torch::nn::functional;
  run(4, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"dp", "tp"});
    const at::Tensor x = global_data({8, 6}, 30);
    const at::Tensor target = at::randint(0, 4, {8}, at::make_generator<at::CPUGeneratorImpl>(31));
    std::vector<at::Tensor> init = {global_data({10, 6}, 32), global_data({10}, 33), global_data({4, 10}, 34),
                                    global_data({4}, 35)};
    auto forward = [](const at::Tensor& in, const std::vector<at::Tensor>& p, const at::Tensor& t) {
      return F::cross_entropy(F::linear(at::relu(F::linear(in, p[0], p[1])), p[2], p[3]), t);
    };
    std::vector<at::Tensor> ref;
    for (const auto& t : init) ref.push_back(t.clone().requires_grad_(true));
    at::Tensor ref_loss = forward(x, ref, target);
    ref_loss.backward();

    const Placement R = Replicate();
    const std::vector<Placements> layout = {{R, Shard(0)}, {R, Shard(0)}, {R, Shard(1)}, {R, R}};  // colwise, rowwise
    std::vector<at::Tensor> params;
    for (size_t k = 0; k < init.size(); ++k)
      params.push_back(distribute_tensor(init[k], mesh, layout[k]).requires_grad_(true));
    at::Tensor loss =
        forward(distribute_tensor(x, mesh, {Shard(0), R}), params, distribute_tensor(target, mesh, {Shard(0), R}));
    loss.backward();
    check_close(full(loss), ref_loss.detach(), "MLP loss");
    for (size_t k = 0; k < params.size(); ++k) {
      if (!is_dtensor(params[k].grad()))
        throw std::runtime_error("gradient " + std::to_string(k) + " is not a DTensor");
      check_close(full(params[k].grad()), ref[k].grad(), "MLP grad " + std::to_string(k));
    }
  });
}

// Errors name the op and the placements (no rule), the meshes (different meshes), or the mix.
TEST(DTensor, ClearErrors) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    DeviceMesh other(g, "cpu", std::vector<int64_t>{2}, std::vector<int>{1, 0}, {"y"});
    DTensor a = distribute_tensor(global_data({4, 4}, 13), mesh, {Shard(0)});
    expect_error([&] { at::cumsum(a, 0); }, "no sharding rule for aten::cumsum with inputs [S(0)] shape [4, 4]");
    expect_error(
        [&] {
          a + distribute_tensor(global_data({4, 4}, 14), other, {Replicate()});
        },
        "operands on different meshes");
    expect_error([&] { a + global_data({4, 4}, 15); }, "mixes a DTensor with a plain tensor of shape [4, 4]");
    DTensor partial(a.sum(0));
    expect_error([&] { partial.add_(1.0); }, "writing into a P(sum) tensor would have to reduce it first");
  });
}

}  // namespace
}  // namespace hp::test
