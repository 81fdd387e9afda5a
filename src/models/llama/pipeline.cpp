// Llama cut into pipeline stages by layer ranges.
#include <ATen/ATen.h>

#include <string>

#include "hp/core/error.h"
#include "hp/models/llama/pipeline.h"

namespace hp::models {
namespace {

// A range of the model's blocks under their own indices ("3", "4"), so a stage's FQNs are the
// model's ("layers.3.attn.q_proj.weight").
class LayerRange : public nn::Module {
 public:
  LayerRange(Llama& model, int64_t first, int64_t count) : nn::Module("LayerRange") {
    for (int64_t i = first; i < first + count; ++i)
      blocks_.push_back(add_module(std::to_string(i), model.layers->items()[i]));
  }

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = x;
    for (const auto& block : blocks_) h = (*block)(h);
    return h;
  }

 private:
  std::vector<std::shared_ptr<nn::Module>> blocks_;
};

// Blocks [first, first + count) of the model, with the embedding in front on the first stage and
// the final norm and head behind on the last.
class LlamaStage : public nn::Module {
 public:
  LlamaStage(Llama& model, int64_t first, int64_t count, bool has_embed, bool has_head) : nn::Module("LlamaStage") {
    if (has_embed) embed_ = add_module("embed", model.embed);
    if (count > 0) layers_ = add_module("layers", std::make_shared<LayerRange>(model, first, count));
    if (has_head) {
      norm_ = add_module("norm", model.norm);
      if (model.output) {
        output_ = add_module("output", model.output);
      } else if (!has_embed) {
        // Tied embeddings: the head's copy of the embedding, under the same FQN as on the first
        // stage ("embed.weight"), for PipelineOptions::tied.
        head_embed_ = add_module("embed", model.embed);
      }
    }
  }

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = embed_ ? (*embed_)(x) : x;
    if (layers_) h = (*layers_)(h);
    if (!norm_) return h;
    h = (*norm_)(h);
    if (output_) return (*output_)(h);
    return at::linear(h, (embed_ ? embed_ : head_embed_)->param("weight"));  // tied head
  }

 private:
  std::shared_ptr<nn::Embedding> embed_;
  std::shared_ptr<LayerRange> layers_;
  std::shared_ptr<nn::RMSNorm> norm_;
  std::shared_ptr<nn::Linear> output_;
  std::shared_ptr<nn::Embedding> head_embed_;  // tied embeddings, on a last stage without the embedding
};

}  // namespace

std::vector<std::shared_ptr<nn::Module>> split_llama(Llama& model, const std::vector<int64_t>& layers_per_stage) {
  const int64_t stages = static_cast<int64_t>(layers_per_stage.size());
  HP_CHECK(stages >= 1, "split_llama: no stages");
  int64_t total = 0;
  for (int64_t n : layers_per_stage) {
    HP_CHECK(n >= 0, "split_llama: negative layer count");
    total += n;
  }
  HP_CHECK(total == model.config().layers, "split_llama: the stages hold ", total, " layers but the model has ",
           model.config().layers);
  std::vector<std::shared_ptr<nn::Module>> out;
  int64_t first = 0;
  for (int64_t i = 0; i < stages; ++i) {
    out.push_back(std::make_shared<LlamaStage>(model, first, layers_per_stage[i], i == 0, i == stages - 1));
    first += layers_per_stage[i];
  }
  return out;
}

}  // namespace hp::models
