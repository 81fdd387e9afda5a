#include "hp/train/trainer.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "hp/core/cpu_threads.h"
#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/core/memory_tracker.h"
#include "hp/data/text_data.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dcp/state_dict.h"
#include "hp/dtensor/dtensor.h"
#include "hp/models/parallelize.h"
#include "hp/nn/init.h"
#include "hp/optim/adamw.h"
#include "hp/optim/chained.h"
#include "hp/optim/clip_grad.h"
#include "hp/optim/lr_scheduler.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/pp/executor.h"
#include "train/metrics.h"

namespace hp::train {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double scalar(const at::Tensor& t) { return (is_dtensor(t) ? DTensor(t).full_tensor() : t).detach().item<double>(); }

// The world mean of a per-rank value (ranks of one tensor-parallel group hold the same value, so
// this is the data-parallel mean).
double world_mean(double value, const comm::ProcessGroup& world) {
  at::Tensor t = at::scalar_tensor(value, at::kDouble).reshape({1});
  world.all_reduce(t, {comm::ReduceOp::kAvg});
  return t.item<double>();
}

// FLOPs per trained token: 6 per matmul weight (forward + backward) plus attention scores and mixing.
double flops_per_token(const models::LlamaConfig& m, int64_t seq) {
  const double matmul_params = static_cast<double>(m.parameter_count() - m.vocab * m.dim * (m.tie_embeddings ? 0 : 1));
  return 6.0 * matmul_params + 12.0 * static_cast<double>(m.layers * m.dim * seq);
}

std::unique_ptr<ChainedOptimizer> make_optimizer(const TrainConfig& c, models::Llama& model,
                                                 const std::vector<at::Tensor>& params) {
  torch::optim::AdamWOptions adamw(c.optimizer.lr);
  adamw.betas({c.optimizer.beta1, c.optimizer.beta2}).eps(c.optimizer.eps).weight_decay(c.optimizer.weight_decay);
  if (c.optimizer.name == "adamw")
    return std::make_unique<ChainedOptimizer>(std::vector<std::shared_ptr<torch::optim::Optimizer>>{
        std::make_shared<AdamW>(params, adamw)});
  MuonOptions muon(c.optimizer.muon_lr);
  muon.momentum(c.optimizer.muon_momentum).weight_decay(c.optimizer.weight_decay);
  std::vector<std::string> muon_params, adamw_params = {"*.weight", "layers.*.*.weight"};
  for (const char* m : {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate", "mlp.up", "mlp.down"})
    muon_params.push_back(std::string("layers.*.") + m + ".weight");
  for (const char* n : {"q_norm", "k_norm"}) adamw_params.push_back(std::string("layers.*.attn.") + n + ".weight");
  return std::make_unique<ChainedOptimizer>(get_hyper_optimizer(model, muon_params, adamw_params, muon, adamw));
}

std::string step_dir_name(int64_t step) {
  std::ostringstream out;
  out << "step-" << std::setw(6) << std::setfill('0') << step;
  return out.str();
}

// Keeps the `keep` newest step-* checkpoints (rank 0, after a commit).
void prune_checkpoints(const std::string& root, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> dirs;  // by step number: names outgrow their zero padding
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 && name.size() > 5 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos)
      dirs.emplace_back(std::stoll(name.substr(5)), e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (size_t i = 0; i + keep < dirs.size(); ++i) fs::remove_all(dirs[i].second);
}

pp::Schedule make_schedule(const TrainConfig& c) {
  const int p = static_cast<int>(c.parallel.pp), m = static_cast<int>(c.micro_batches());
  if (c.pp_schedule == "gpipe") return pp::gpipe(p, m);
  if (c.pp_schedule == "interleaved") return pp::interleaved_1f1b(p, static_cast<int>(c.pp_stages_per_rank), m);
  if (c.pp_schedule == "zbv") return pp::zero_bubble_v(p, m);
  return pp::one_f_one_b(p, m);
}

// Everything a run is made of, built from the config in a fixed order on every rank.
struct Setup {
  DeviceMesh mesh;
  int64_t dp_rank = 0;
  std::shared_ptr<models::Llama> model;
  std::vector<std::shared_ptr<nn::Module>> stages;  // with pp > 1: the pipeline stages this rank runs
  std::unique_ptr<pp::PipelineExecutor> pipe;       // with pp > 1
  std::vector<at::Tensor> params;                   // what this rank trains
  std::unique_ptr<ChainedOptimizer> optimizer;
  std::unique_ptr<LRScheduler> scheduler;
};

Setup build(const TrainConfig& c, const comm::ProcessGroup& world, bool allocate) {
  Setup s{models::build_mesh(world, c.parallel)};
  const auto coord = s.mesh.get_coordinate().value();  // (pp, dp_replicate, dp_shard, tp)
  s.dp_rank = coord[1] * c.parallel.dp_shard + coord[2];
  s.model = std::make_shared<models::Llama>(c.model);
  models::LlamaParallelOptions parallel;
  parallel.tp = {c.sequence_parallel, c.loss_parallel};
  parallel.fsdp.reshard_after_forward = c.reshard_after_forward;
  parallel.fsdp.reshard_after_forward_to = static_cast<int>(c.reshard_after_forward_to);
  if (c.parallel.pp > 1) {
    // Tensor parallelism first (on every rank, over the whole model: each rank then runs its
    // stages' share). Each stage this rank runs is one fully_shard unit on the data-parallel mesh
    // (of one rank when dp = 1, which keeps gradients, clipping and checkpoints on the same DTensor path).
    if (c.parallel.tp > 1) parallelize_module(*s.model, s.mesh["tp"], models::llama_tp_plan(parallel.tp));
    const pp::Schedule schedule = make_schedule(c);
    const auto all = models::split_llama(*s.model, std::vector<int64_t>(schedule.stages, c.model.layers / schedule.stages));
    const DeviceMesh dp_mesh = c.parallel.dp_replicate > 1 ? s.mesh[{"dp_replicate", "dp_shard"}] : s.mesh["dp_shard"];
    // Between stages, the residual stream is whole on every TP rank, or sharded on the sequence with SP.
    const int64_t boundary_dim = c.sequence_parallel ? 1 : -1;
    std::vector<pp::PipelineStage> local;
    for (int st = 0; st < schedule.stages; ++st)
      if (schedule.stage_rank[st] == coord[0]) {
        fully_shard(*all[st], dp_mesh, parallel.fsdp);
        pp::PipelineStage stage{all[st], st};
        if (st > 0) stage.input_shard_dim = boundary_dim;
        if (st < schedule.stages - 1) stage.output_shard_dim = boundary_dim;
        local.push_back(stage);
        s.stages.push_back(all[st]);
      }
    // The pipeline of this data-parallel replica: its (pp, tp) ranks, row-major, so position p
    // (pipeline rank p) is run by the tp ranks of pp index p.
    const DeviceMesh pipeline_mesh = s.mesh[{"pp", "tp"}];
    pp::PipelineOptions placement;
    for (int64_t p = 0; p < c.parallel.pp; ++p) {
      placement.position_ranks.emplace_back();
      for (int64_t t = 0; t < c.parallel.tp; ++t) placement.position_ranks.back().push_back(static_cast<int>(p * c.parallel.tp + t));
    }
    const comm::ProcessGroup pipeline_group =
        c.parallel.tp > 1 ? world.new_group(pipeline_mesh.ranks(), "pp_tp") : s.mesh.get_group("pp");
    if (c.model.tie_embeddings) placement.tied = {{"embed.weight", {0, schedule.stages - 1}}};
    s.pipe = std::make_unique<pp::PipelineExecutor>(
        schedule, local, pipeline_group,
        [](const at::Tensor& logits, const at::Tensor& targets) { return cross_entropy(logits, targets); }, placement);
  } else {
    models::parallelize_llama(*s.model, s.mesh, c.parallel, parallel);
  }
  if (!allocate) return s;
  nn::init_parameters(*s.model, c.seed);
  if (s.pipe) {
    for (const auto& stage : s.stages)
      for (const at::Tensor& p : stage->parameters()) s.params.push_back(p);
  } else {
    s.params = s.model->parameters();
  }
  s.optimizer = make_optimizer(c, *s.model, s.params);
  LRSchedule schedule;
  schedule.warmup_steps = c.schedule.warmup_steps;
  schedule.total_steps = c.train.steps;
  schedule.decay = parse_decay(c.schedule.decay);
  schedule.min_lr_ratio = c.schedule.min_lr_ratio;
  schedule.decay_fraction = c.schedule.decay_fraction;
  s.scheduler = std::make_unique<LRScheduler>(get_hyper_lr_scheduler(*s.optimizer, schedule));
  return s;
}

// parallel.pp_timeline_step: that step's measured pipeline timeline, drawn as hp-pp-viz draws
// schedules. Collective over the pipeline's ranks; the lead writes its pipeline's.
void draw_pipeline_timeline(const pp::PipelineExecutor& pipe, int64_t step, const std::string& run_dir, bool lead) {
  const pp::Simulation measured = pipe.measured_step();
  if (!lead) return;
  std::filesystem::create_directories(run_dir);
  const std::string path = run_dir + "/pp_timeline.svg";
  std::ofstream(path) << pp::to_svg(pipe.schedule(), measured,
                                    pipe.schedule().name + ", step " + std::to_string(step) + " (measured)");
  log::info("pipeline timeline of step ", step, ": bubble ", 100.0 * measured.bubble, "% over ",
            1e3 * measured.makespan, " ms, drawn in ", path);
}

void print_plan(const TrainConfig& c, const comm::ProcessGroup& world, Setup& s) {
  // Per rank: parameters (local elements), parameter bytes, and an estimate of training memory:
  // parameters + gradients + AdamW's two moments, plus ~14 activations of [micro_batch, seq, dim]
  // kept per layer for backward, and the logits.
  int64_t param_bytes = 0;
  if (s.pipe)
    for (const auto& stage : s.stages) param_bytes += nn::local_parameter_bytes(*stage);
  else
    param_bytes = nn::local_parameter_bytes(*s.model);
  const double activations = 4.0 * static_cast<double>(c.train.micro_batch * c.data.seq_len) *
                             (14.0 * c.model.layers * c.model.dim / c.parallel.tp + 2.0 * c.model.vocab / c.parallel.tp);
  at::Tensor mine = at::tensor({static_cast<double>(param_bytes / 4), static_cast<double>(param_bytes),
                                4.0 * param_bytes + activations}, at::kDouble);
  const at::Tensor all = world.all_gather(mine);
  if (world.rank() != 0) return;
  std::cout << "plan: " << c.parallel.str() << " on " << world.size() << " ranks, " << s.mesh.str() << "\n"
            << "model: llama dim " << c.model.dim << ", " << c.model.layers << " layers, " << c.model.heads
            << " heads (" << c.model.kv_heads << " KV), ffn " << c.model.ffn_hidden << ", vocab " << c.model.vocab
            << ": " << c.model.parameter_count() << " parameters\n"
            << "batch: " << c.train.global_batch << " sequences x " << c.data.seq_len << " tokens, "
            << c.per_rank_batch() << " per data-parallel rank in " << c.micro_batches() << " micro-batch(es)\n";
  for (int r = 0; r < world.size(); ++r) {
    const auto row = all.view({world.size(), 3})[r];
    std::cout << "  rank " << r << ": " << static_cast<int64_t>(row[0].item<double>()) << " parameter elements ("
              << std::fixed << std::setprecision(2) << row[1].item<double>() / 1e6 << " MB), estimated training memory "
              << row[2].item<double>() / 1e6 << " MB\n";
  }
  std::cout << std::defaultfloat;
}

}  // namespace

double machine_peak_flops() {
  if (const char* env = std::getenv("HP_PEAK_FLOPS")) return std::stod(env);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const char* home = std::getenv("HOME");
  const fs::path cache = fs::path(home ? home : "/tmp") / ".cache/hyperparallel/peak_flops.json";
  const std::string key = "fp32_matmul_threads_" + std::to_string(threads);
  nlohmann::json cached = nlohmann::json::object();
  if (fs::exists(cache)) {
    std::ifstream in(cache);
    cached = nlohmann::json::parse(in, nullptr, false);
    if (cached.is_object() && cached.contains(key)) return cached.at(key).get<double>();
    if (!cached.is_object()) cached = nlohmann::json::object();
  }
  CpuThreadsGuard all_cores(threads);
  const int64_t n = 1024;
  const at::Tensor a = at::ones({n, n}), b = at::ones({n, n});
  at::Tensor out = at::empty({n, n});
  for (int i = 0; i < 3; ++i) at::mm_out(out, a, b);
  const int reps = 10;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) at::mm_out(out, a, b);
  const double flops = 2.0 * n * n * n * reps / seconds_since(t0);
  cached[key] = flops;
  fs::create_directories(cache.parent_path());
  std::ofstream(cache) << cached.dump(1);
  return flops;
}

TrainResult train(const TrainConfig& c, const comm::ProcessGroup& world, const TrainOptions& options) {
  validate(c, world.size());
  log::LogRankGuard log_rank(world.rank());
  const bool lead = world.rank() == 0;

  if (options.dry_run) {
    Setup s = build(c, world, /*allocate=*/false);
    print_plan(c, world, s);
    return {};
  }

  // Data: rank 0 prepares the token files, the others wait and read them.
  if (lead) data::prepare_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction);
  world.barrier();
  const data::CorpusInfo corpus = data::prepare_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction);
  const data::TokenSampler train_data(data::load_tokens(corpus.train_path), c.data.seq_len, c.seed);
  const data::TokenSampler eval_data(data::load_tokens(corpus.eval_path), c.data.seq_len, c.seed);

  double peak = 0.0;
  if (lead) peak = machine_peak_flops();
  world.barrier();

  MemoryTracker memory;
  Setup s = build(c, world, /*allocate=*/true);
  models::Llama& model = *s.model;
  const std::vector<at::Tensor>& params = s.params;

  // The checkpoint's tensors alias the live model and optimizer state, so save and load act on them.
  // With a pipeline, a rank's checkpoint holds its own stages only.
  dcp::StateDict state = dcp::model_state_dict(model);
  if (s.pipe) {
    std::set<const void*> mine;
    for (const at::Tensor& p : params) mine.insert(p.unsafeGetTensorImpl());
    for (auto it = state.tensors.begin(); it != state.tensors.end();)
      it = mine.count(it->second.unsafeGetTensorImpl()) ? std::next(it) : state.tensors.erase(it);
  }
  dcp::add_optimizer_state(state, *s.optimizer, model);
  // Tied embeddings across a pipeline: the last stage's copy equals the first stage's, so only the
  // first stage saves it (loading fills both), and its gradient, already summed by the pipeline,
  // is counted once in the global gradient norm.
  std::vector<at::Tensor> counted_params = params, tied_copies;
  const bool saves_tied_copy = !(s.pipe && c.model.tie_embeddings) || s.mesh.get_coordinate().value()[0] == 0;
  const auto to_save = [&](const dcp::StateDict& all) {
    if (saves_tied_copy) return all;
    dcp::StateDict out = all;
    for (auto it = out.tensors.begin(); it != out.tensors.end();) {
      const std::string& key = it->first;
      const bool tied = key == "model.embed.weight" || key.rfind("optim.embed.weight.", 0) == 0;
      it = tied ? out.tensors.erase(it) : std::next(it);
    }
    return out;
  };
  if (!saves_tied_copy)
    for (const auto& stage : s.stages)
      for (const auto& item : stage->named_parameters())
        if (item.key() == "embed.weight") {
          tied_copies.push_back(item.value());
          counted_params.erase(std::remove_if(counted_params.begin(), counted_params.end(),
                                              [&](const at::Tensor& p) { return p.is_same(item.value()); }),
                               counted_params.end());
        }

  TrainResult result;
  result.unigram_entropy = corpus.unigram_entropy_nats;
  int64_t step = 0;
  if (options.resume) {
    if (auto latest = dcp::latest_checkpoint(c.checkpoint_dir())) {
      dcp::load(state, *latest);
      dcp::restore_optimizer_values(state, *s.optimizer, model);
      step = state.values.at("step").get<int64_t>();
      s.scheduler->set_step(step);
      if (lead) log::info("resumed from ", *latest, " at step ", step);
    }
  }
  result.first_step = step;
  std::optional<detail::MetricsLog> metrics;
  if (lead) {
    metrics.emplace(c.run_dir, options.resume ? step : -1, options.progress);
    metrics->write({{"kind", "config"}, {"step", step}, {"world_size", world.size()},
                    {"config", nlohmann::json::parse(to_json(c))}, {"unigram_entropy", corpus.unigram_entropy_nats}});
    std::ofstream(fs::path(c.run_dir) / "config.json") << nlohmann::json::parse(to_json(c)).dump(1) << "\n";
  }

  const auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    double sum = 0.0;
    for (int64_t b = 0; b < c.eval.batches; ++b) {
      auto [x, y] = eval_data.eval_batch(b, c.train.global_batch, s.dp_rank * c.per_rank_batch(), c.per_rank_batch());
      sum += s.pipe ? s.pipe->evaluate(x, y) : scalar(cross_entropy(model(x), y));
    }
    return world_mean(sum / static_cast<double>(c.eval.batches), world);
  };

  const double tokens_per_step = static_cast<double>(c.train.global_batch * c.data.seq_len);
  const double flops_token = flops_per_token(c.model, c.data.seq_len);
  dcp::AsyncSave pending;
  int64_t pending_step = -1;
  const auto finish_save = [&]() {
    if (!pending.pending()) return;
    pending.wait();
    if (lead) prune_checkpoints(c.checkpoint_dir(), c.checkpoint.keep);
    pending_step = -1;
  };
  double timed_seconds = 0.0;
  int64_t timed_steps = 0;
  const auto run_start = Clock::now();
  const int64_t micro = c.micro_batches();
  for (; step < c.train.steps; ++step) {
    const auto t0 = Clock::now();
    memory.reset_peak();
    s.optimizer->zero_grad();
    double loss_sum = 0.0;
    if (s.pipe) {  // the schedule splits this rank's rows into `micro` micro-batches
      auto [x, y] = train_data.train_batch(step, c.train.global_batch, s.dp_rank * c.per_rank_batch(), c.per_rank_batch());
      const bool draw = step + 1 == c.pp_timeline_step;
      s.pipe->record_timeline(draw);
      loss_sum = s.pipe->step(x, y) * static_cast<double>(micro);
      if (draw) draw_pipeline_timeline(*s.pipe, step + 1, c.run_dir, lead);
    } else {
      for (int64_t m = 0; m < micro; ++m) {
        auto [x, y] = train_data.train_batch(step, c.train.global_batch,
                                             s.dp_rank * c.per_rank_batch() + m * c.train.micro_batch, c.train.micro_batch);
        at::Tensor loss = cross_entropy(model(x), y);
        loss_sum += scalar(loss);
        (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
      }
    }
    const double grad_norm =
        clip_grad_norm_(counted_params, c.train.max_grad_norm > 0 ? c.train.max_grad_norm : 1e30, world, 2.0, tied_copies);
    const double lr = s.scheduler->lr();
    pending.wait_staged();  // a checkpoint staging in the background still reads what the optimizer changes
    s.optimizer->step();
    s.scheduler->step();
    const double loss = world_mean(loss_sum / static_cast<double>(micro), world);
    // A save started last step has overlapped this one; commit it now (the same step on every rank).
    if (pending_step >= 0 && pending_step < step + 1) finish_save();
    const double seconds = seconds_since(t0);
    if (step > result.first_step) timed_seconds += seconds, ++timed_steps;
    const double tokens_per_s = tokens_per_step / seconds;
    const double mfu = peak > 0 ? flops_token * tokens_per_s / peak : 0.0;
    result.losses.push_back(loss);
    result.grad_norms.push_back(grad_norm);

    std::optional<double> eval_loss;
    if (c.eval.interval > 0 && (step + 1) % c.eval.interval == 0 && step + 1 < c.train.steps) eval_loss = evaluate();
    if (c.checkpoint.interval > 0 && (step + 1) % c.checkpoint.interval == 0) {
      finish_save();
      state.values = {{"step", step + 1}, {"seed", c.seed}, {"data", {{"sampler", "stateless"}, {"step", step + 1}}},
                      {"scheduler_step", s.scheduler->last_step()}, {"world_size", world.size()}};
      dcp::add_optimizer_state(state, *s.optimizer, model);  // refreshes the step counts in values
      dcp::SaveOptions save_options;
      save_options.update_latest = true;
      save_options.stage_in_background = true;  // the copies overlap the next step's forward and backward
      pending = dcp::save_async(to_save(state), c.checkpoint_dir() + "/" + step_dir_name(step + 1), world, save_options);
      pending_step = step + 1;
      if (!c.checkpoint.async) finish_save();
    }
    if (lead) {
      nlohmann::json record = {{"kind", "train"},         {"step", step + 1},      {"loss", loss},
                               {"grad_norm", grad_norm},  {"lr", lr},              {"tokens_per_s", tokens_per_s},
                               {"mfu", mfu},              {"step_s", seconds},     {"peak_mem_mb", memory.peak() / 1e6}};
      metrics->write(record);
      if (eval_loss) metrics->write({{"kind", "eval"}, {"step", step + 1}, {"eval_loss", *eval_loss}});
      if ((step + 1) % c.log.interval == 0 || step + 1 == c.train.steps || eval_loss) {
        const double eta = seconds_since(run_start) / static_cast<double>(step + 1 - result.first_step) *
                           static_cast<double>(c.train.steps - step - 1);
        std::ostringstream line;
        line << std::fixed << "step " << std::setw(5) << step + 1 << "/" << c.train.steps << "  loss "
             << std::setprecision(4) << loss << "  grad " << std::setprecision(3) << grad_norm << "  lr "
             << std::scientific << std::setprecision(2) << lr << std::fixed << "  " << std::setprecision(0)
             << tokens_per_s << " tok/s  MFU " << std::setprecision(1) << 100.0 * mfu << "%  mem "
             << std::setprecision(1) << memory.peak() / 1e6 << " MB  eta " << detail::format_duration(eta);
        if (eval_loss) line << "  eval " << std::setprecision(4) << *eval_loss;
        metrics->progress(line.str(), eval_loss.has_value());
      }
    }
    if (options.after_step) options.after_step(step + 1);
  }
  finish_save();

  result.eval_loss = evaluate();
  result.tokens_per_s = timed_steps ? tokens_per_step * static_cast<double>(timed_steps) / timed_seconds : 0.0;
  result.mfu = peak > 0 ? flops_token * result.tokens_per_s / peak : 0.0;
  if (c.sample.tokens > 0) {
    const data::ByteTokenizer tokenizer;
    const at::Tensor prompt = tokenizer.encode(c.sample.prompt);
    result.sample = tokenizer.decode(
        s.pipe ? models::generate_greedy([&](const at::Tensor& t) { return s.pipe->forward(t); }, prompt,
                                         c.sample.tokens, c.model.max_seq)
               : models::generate_greedy(model, prompt, c.sample.tokens));
  }
  if (lead) {
    metrics->finish_progress();
    metrics->write({{"kind", "eval"}, {"step", c.train.steps}, {"eval_loss", result.eval_loss}});
    metrics->write({{"kind", "summary"}, {"step", c.train.steps}, {"eval_loss", result.eval_loss},
                    {"unigram_entropy", corpus.unigram_entropy_nats}, {"tokens_per_s", result.tokens_per_s},
                    {"mfu", result.mfu}, {"sample", result.sample}});
  }
  return result;
}

}  // namespace hp::train
