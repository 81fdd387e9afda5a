// custom_shard runs a local function on DTensor pieces; DFunction is a distributed autograd
// function with a local forward and backward. Both against single-device values and gradients.
#include <hp/dtensor/custom.h>

#include "test_util.h"

namespace hp::test {
namespace {

// Row-wise softmax written on local pieces: rows are sharded, so each rank's rows are complete.
TEST(CustomShard, LocalFunctionOnPieces) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor full = at::randn({5, 4}, at::make_generator<at::CPUGeneratorImpl>(1));
    at::Tensor ref = full.clone().requires_grad_(true);
    (at::softmax(ref, 1) * 2.0).sum().backward();
    DTensor x = distribute_tensor(full, mesh, {Replicate()});  // custom_shard moves it to S(0)
    x.requires_grad_(true);
    at::Tensor y = custom_shard([](const std::vector<at::Tensor>& l) { return at::softmax(l[0], 1); }, mesh, {Shard(0)},
                                {{Shard(0)}}, {x});
    (y * 2.0).sum().backward();
    check_close(DTensor(y).full_tensor(), at::softmax(full, 1), "custom_shard value");
    check_close(DTensor(x.grad()).full_tensor(), ref.grad(), "custom_shard gradient");
  });
}

// A DFunction computing x * w with a hand-written local backward, on row shards of x and a
// replicated w: values and both gradients match single device.
TEST(DFunction, LocalForwardAndBackward) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const at::Tensor xf = at::randn({5, 3}, at::make_generator<at::CPUGeneratorImpl>(2));
    const at::Tensor wf = at::randn({3}, at::make_generator<at::CPUGeneratorImpl>(3));
    at::Tensor xr = xf.clone().requires_grad_(true), wr = wf.clone().requires_grad_(true);
    (xr * wr).pow(2).sum().backward();

    DFunction scale;
    scale.name = "Scale";
    scale.input_placements = {{Shard(0)}, {Replicate()}};
    scale.output_placements = {Shard(0)};
    scale.forward = [](const std::vector<at::Tensor>& l) { return l[0] * l[1]; };
    // d(x*w)/dx = w; d/dw = sum over this rank's rows of grad * x: a partial sum, reduced below.
    scale.backward = [&](const at::Tensor& grad, const std::vector<at::Tensor>& l) {
      at::Tensor dw = mesh.get_group(0).all_reduce((grad * l[0]).sum(0));
      return std::vector<at::Tensor>{grad * l[1], dw};
    };
    DTensor x = distribute_tensor(xf, mesh, {Shard(0)}), w = distribute_tensor(wf, mesh, {Replicate()});
    x.requires_grad_(true);
    w.requires_grad_(true);
    at::Tensor y = scale.apply({x, w}, std::vector<int64_t>{5, 3});
    y.pow(2).sum().backward();
    check_close(DTensor(y).full_tensor(), xf * wf, "DFunction value");
    check_close(DTensor(x.grad()).full_tensor(), xr.grad(), "DFunction grad x");
    check_close(DTensor(w.grad()).full_tensor(), wr.grad(), "DFunction grad w");
  });
}

}  // namespace
}  // namespace hp::test
