// A DTensor's local piece, for the layers that work on it directly (optimizers, FSDP, gradient
// clipping, parameter initialization, pipelines): read it or give it storage without autograd, and
// wrap a piece whose layout is already known. Everything else uses DTensor's checked API
// (hp/dtensor/dtensor.h). None of these communicate.
#pragma once

#include <c10/core/Device.h>

#include <optional>

#include <ATen/core/Tensor.h>

#include "hp/dtensor/spec.h"

namespace hp {

// This rank's storage of `t`: a DTensor's local piece (not recorded by autograd), else `t` itself.
const at::Tensor& local_tensor(const at::Tensor& t);

// A DTensor laid out by `spec` over `local`, which must already be this rank's piece
// (spec.local_shape()): no checks, not recorded by autograd. DTensor::from_local is the checked form.
at::Tensor from_local_unchecked(at::Tensor local, DTensorSpec spec);

// Gives a DTensor whose local piece has no storage yet (a meta piece, from deferred initialization)
// a piece of the same shape and dtype on its mesh's device, in place: the tensor keeps its identity, so hooks and
// autograd metadata registered on it stay. Does nothing when the piece has storage. With `device`
// meta (a dry run) the piece is a new meta piece, so that a meta MemoryTracker counts it. A piece
// placed in a storage tier (hp/core/storage_tier.h: parameter offload) gets its storage in that tier.
void materialize_local(const at::Tensor& dtensor, std::optional<c10::Device> device = std::nullopt);

}  // namespace hp
