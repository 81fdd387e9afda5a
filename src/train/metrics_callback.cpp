#include "train/metrics_callback.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "hp/train/trainer.h"

namespace hp::train::detail {
namespace {

const char* rerun_name(Rerun rerun) { return rerun == Rerun::kTransient ? "transient" : "persistent"; }

nlohmann::json step_json(const StepRecord& r) {
  nlohmann::json j = {{"kind", "train"},
                      {"step", r.step},
                      {"loss", r.loss},
                      {"grad_norm", r.grad_norm},
                      {"lr", r.lr},
                      {"tokens_per_s", r.tokens_per_s},
                      {"mfu", r.mfu},
                      {"step_s", r.seconds},
                      {"peak_mem_mb", r.peak_mem_bytes / 1e6},
                      {"local_losses", r.local_losses},
                      {"local_grad_norms", r.local_grad_norms},
                      {"largest_local_grad_norm_rank", r.largest_local_grad_norm_rank}};
  if (r.skipped) j["skipped"] = true;
  if (r.rerun != Rerun::kNone) j["rerun"] = rerun_name(r.rerun);
  for (const auto& [name, value] : r.model_values) j[name] = value;
  return j;
}

std::string progress_line(const StepRecord& r, int64_t steps, double eta_seconds) {
  std::ostringstream out;
  out << std::fixed << "step " << std::setw(5) << r.step << "/" << steps << "  loss " << std::setprecision(4) << r.loss
      << "  grad " << std::setprecision(3) << r.grad_norm << "  lr " << std::scientific << std::setprecision(2) << r.lr
      << std::fixed << "  " << std::setprecision(0) << r.tokens_per_s << " tok/s  MFU " << std::setprecision(1)
      << 100.0 * r.mfu << "%  mem " << std::setprecision(1) << r.peak_mem_bytes / 1e6 << " MB  eta "
      << format_duration(eta_seconds);
  if (r.skipped) out << "  skipped";
  if (r.rerun != Rerun::kNone) out << "  rerun: " << rerun_name(r.rerun);
  if (!r.model_summary.empty()) out << "  " << r.model_summary;
  if (r.eval_loss) out << "  eval " << std::setprecision(4) << *r.eval_loss;
  return out.str();
}

}  // namespace

MetricsCallback::MetricsCallback(const TrainConfig& config, RunFacts facts) : config_(config), facts_(facts) {}

void MetricsCallback::on_train_begin(int64_t first_step) {
  first_step_ = first_step;
  start_ = std::chrono::steady_clock::now();
  log_.emplace(config_.run_dir, facts_.resume ? first_step : -1, facts_.progress);
  const nlohmann::json config = nlohmann::json::parse(to_json(config_));
  log_->write({{"kind", "config"},
               {"step", first_step},
               {"world_size", facts_.world_size},
               {"config", config},
               {"unigram_entropy", facts_.unigram_entropy}});
  std::ofstream(std::filesystem::path(config_.run_dir) / "config.json") << config.dump(1) << "\n";
}

void MetricsCallback::on_step_end(const StepRecord& record) {
  log_->write(step_json(record));
  const int64_t steps = config_.train.steps;
  if (record.step % config_.log.interval == 0 || record.step == steps || record.eval_loss) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double eta =
        elapsed / static_cast<double>(record.step - first_step_) * static_cast<double>(steps - record.step);
    log_->progress(progress_line(record, steps, eta), record.eval_loss.has_value());
  }
}

void MetricsCallback::on_eval(int64_t step, double eval_loss) {
  log_->write({{"kind", "eval"}, {"step", step}, {"eval_loss", eval_loss}});
}

void MetricsCallback::on_train_end(const TrainResult& result) {
  log_->finish_progress();
  log_->write({{"kind", "summary"},
               {"step", config_.train.steps},
               {"eval_loss", result.eval_loss},
               {"unigram_entropy", facts_.unigram_entropy},
               {"tokens_per_s", result.tokens_per_s},
               {"mfu", result.mfu},
               {"sample", result.sample}});
}

}  // namespace hp::train::detail
