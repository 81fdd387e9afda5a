// Recording a differentiable step whose backward is a C++ lambda. Used by the layers above core for
// collectives (hp::comm::functional), DTensor conversions (from_local, to_local, redistribute),
// FSDP's all-gather and checkpointed regions, whose backward needs C++ state (groups, specs, a
// recomputation) that autograd::Function's IValue context cannot hold. The lambda, with what it
// captured, goes once autograd will not run its node again.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace hp {

using BackwardFn = std::function<at::Tensor(const at::Tensor& grad_output)>;

// If `input` requires grad (and grad mode is on), makes `output` depend on it through `backward`.
// `output` must be a fresh tensor computed without recording. Returns `output`.
at::Tensor record_backward(const std::string& name, const at::Tensor& input, at::Tensor output, BackwardFn backward);

// The same for several inputs: `backward` returns one gradient per input (undefined = none).
using MultiBackwardFn = std::function<std::vector<at::Tensor>(const at::Tensor& grad_output)>;
at::Tensor record_backward(const std::string& name, const std::vector<at::Tensor>& inputs, at::Tensor output,
                           MultiBackwardFn backward);

// The same, where `backward` also gets which inputs' gradients the running backward asks for (one
// flag per input): the engine trims the rest when asked for some tensors' gradients only
// (torch::autograd::grad, the I and W passes of hp/core/weight_split.h). It may leave the others
// undefined.
using TrimmedBackwardFn =
    std::function<std::vector<at::Tensor>(const at::Tensor& grad_output, const std::vector<bool>& asked)>;
at::Tensor record_trimmed_backward(const std::string& name, const std::vector<at::Tensor>& inputs, at::Tensor output,
                                   TrimmedBackwardFn backward);

// Several outputs from several inputs: `backward` gets one gradient per output (undefined where
// an output received none; it owns them, so it can free each as soon as it is used) and returns one
// per input. The outputs must be fresh tensors computed
// without recording; returns them.
using ManyToManyBackwardFn = std::function<std::vector<at::Tensor>(std::vector<at::Tensor> grad_outputs)>;
std::vector<at::Tensor> record_backward(const std::string& name, const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, ManyToManyBackwardFn backward);

// The same, where `backward` also gets which inputs' gradients the running backward asks for (as
// record_trimmed_backward's).
using TrimmedManyToManyBackwardFn =
    std::function<std::vector<at::Tensor>(std::vector<at::Tensor> grad_outputs, const std::vector<bool>& asked)>;
std::vector<at::Tensor> record_trimmed_backward(const std::string& name, const std::vector<at::Tensor>& inputs,
                                                std::vector<at::Tensor> outputs, TrimmedManyToManyBackwardFn backward);

}  // namespace hp
