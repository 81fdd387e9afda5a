// The tests use the library's Llama tensor-parallel plan (hp/models/llama/parallelize.h).
#pragma once

#include <hp/models/llama/parallelize.h>

namespace hp::test {
using models::llama_tp_plan;
using models::TpOptions;
}  // namespace hp::test
