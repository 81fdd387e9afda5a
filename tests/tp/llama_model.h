// The tests' Llama is the library's (hp/models/llama/model.h); the tests only pick small sizes.
#pragma once

#include <hp/models/llama/model.h>

namespace hp::test {
using models::Attention;
using models::Block;
using models::Llama;
using models::LlamaConfig;
using models::Mlp;
}  // namespace hp::test
