#include "hp/train/config.h"

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <utility>
#include <variant>

#include "hp/comm/failure_report.h"
#include "hp/comm/wire_format.h"
#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/data/text_data.h"
#include "hp/models/hf_config.h"
#include "hp/models/model_spec.h"
#include "hp/optim/lr_scheduler.h"
#include "train/fault_injector.h"
#include "train/recipe_options.h"

namespace hp::train {
namespace {

template <typename T>
std::string type_name() {
  if constexpr (std::is_same_v<T, bool>)
    return "true or false";
  else if constexpr (std::is_integral_v<T>)
    return "an integer";
  else if constexpr (std::is_floating_point_v<T>)
    return "a number";
  else if constexpr (std::is_same_v<T, std::string>)
    return "a string";
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
    return "a list of integers";
  else
    return "a list of strings";
}

template <typename T>
T convert(const YAML::Node& node, const std::string& key) {
  try {
    if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      if (node.IsScalar()) return {node.as<std::string>()};
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      HP_CHECK(node.IsSequence(), "config: ", key, ": expected ", type_name<T>());
      T values;
      for (const auto& item : node) values.push_back(convert<int64_t>(item, key));
      return values;
    } else {
      HP_CHECK(node.IsScalar(), "config: ", key, ": expected ", type_name<T>());
    }
    return node.as<T>();
  } catch (const YAML::Exception&) {
    HP_FAIL("config: ", key, ": expected ", type_name<T>(), ", got '", YAML::Dump(node), "'");
  }
}

// One row per key: how to set it from YAML and read it back as JSON.
struct Field {
  std::string key;
  std::function<void(TrainConfig&, const YAML::Node&)> set;
  std::function<nlohmann::json(const TrainConfig&)> get;
};

#define HP_CONFIG_FIELD(key, member)                                                                  \
  Field {                                                                                             \
    key, [](TrainConfig& c, const YAML::Node& n) { c.member = convert<decltype(c.member)>(n, key); }, \
        [](const TrainConfig& c) { return nlohmann::json(c.member); }                                 \
  }

// The trainer's own keys.
const std::vector<Field>& trainer_fields() {
  static const std::vector<Field> all = {
      HP_CONFIG_FIELD("run_dir", run_dir),
      HP_CONFIG_FIELD("seed", seed),
      HP_CONFIG_FIELD("model.from_hf", model_from_hf),
      // The family is read before any key applies (parse_config); its own keys follow it.
      Field{"model.family", [](TrainConfig&, const YAML::Node&) {},
            [](const TrainConfig& c) { return nlohmann::json(c.model->family()); }},
      HP_CONFIG_FIELD("parallel.dp_replicate", parallel.dp_replicate),
      HP_CONFIG_FIELD("parallel.dp_shard", parallel.dp_shard),
      HP_CONFIG_FIELD("parallel.tp", parallel.tp),
      HP_CONFIG_FIELD("parallel.pp", parallel.pp),
      HP_CONFIG_FIELD("parallel.cp", parallel.cp),
      HP_CONFIG_FIELD("parallel.cp_mode", cp_mode),
      HP_CONFIG_FIELD("parallel.cp_ulysses", cp_ulysses),
      HP_CONFIG_FIELD("parallel.cp_async", cp_async),
      HP_CONFIG_FIELD("parallel.ep", parallel.ep),
      HP_CONFIG_FIELD("parallel.sequence_parallel", sequence_parallel),
      HP_CONFIG_FIELD("parallel.loss_parallel", loss_parallel),
      HP_CONFIG_FIELD("parallel.async_tp", async_tp),
      HP_CONFIG_FIELD("parallel.reshard_after_forward", reshard_after_forward),
      HP_CONFIG_FIELD("parallel.reshard_after_forward_to", reshard_after_forward_to),
      HP_CONFIG_FIELD("parallel.pp_schedule", pp_schedule),
      HP_CONFIG_FIELD("parallel.pp_stages_per_rank", pp_stages_per_rank),
      HP_CONFIG_FIELD("parallel.pp_layers_per_stage", pp_layers_per_stage),
      HP_CONFIG_FIELD("parallel.pp_costs", pp_costs),
      HP_CONFIG_FIELD("parallel.pp_timeline_step", pp_timeline_step),
      HP_CONFIG_FIELD("data.sources", data.sources),
      HP_CONFIG_FIELD("data.cache_dir", data.cache_dir),
      HP_CONFIG_FIELD("data.eval_fraction", data.eval_fraction),
      HP_CONFIG_FIELD("data.seq_len", data.seq_len),
      HP_CONFIG_FIELD("train.steps", train.steps),
      HP_CONFIG_FIELD("train.global_batch", train.global_batch),
      HP_CONFIG_FIELD("train.micro_batch", train.micro_batch),
      HP_CONFIG_FIELD("train.max_grad_norm", train.max_grad_norm),
      HP_CONFIG_FIELD("train.deterministic", train.deterministic),
      HP_CONFIG_FIELD("train.cpu_threads", train.cpu_threads),
      HP_CONFIG_FIELD("train.on_nonfinite", train.on_nonfinite),
      HP_CONFIG_FIELD("train.dtype", train.dtype),
      HP_CONFIG_FIELD("train.mixed_precision_reduce", train.mixed_precision_reduce),
      HP_CONFIG_FIELD("train.device", train.device),
      HP_CONFIG_FIELD("memory.checkpoint", memory.checkpoint),
      HP_CONFIG_FIELD("memory.swap", memory.swap),
      HP_CONFIG_FIELD("memory.swap_prefetch", memory.swap_prefetch),
      HP_CONFIG_FIELD("memory.swap_dir", memory.swap_dir),
      HP_CONFIG_FIELD("memory.offload", memory.offload),
      HP_CONFIG_FIELD("memory.offload_dir", memory.offload_dir),
      HP_CONFIG_FIELD("memory.offload_units", memory.offload_units),
      HP_CONFIG_FIELD("memory.offload_prefetch", memory.offload_prefetch),
      HP_CONFIG_FIELD("memory.blocks", memory.blocks),
      HP_CONFIG_FIELD("memory.budget_mb", memory.budget_mb),
      HP_CONFIG_FIELD("optimizer.name", optimizer.name),
      HP_CONFIG_FIELD("optimizer.lr", optimizer.lr),
      HP_CONFIG_FIELD("optimizer.weight_decay", optimizer.weight_decay),
      HP_CONFIG_FIELD("optimizer.beta1", optimizer.beta1),
      HP_CONFIG_FIELD("optimizer.beta2", optimizer.beta2),
      HP_CONFIG_FIELD("optimizer.eps", optimizer.eps),
      HP_CONFIG_FIELD("optimizer.muon_lr", optimizer.muon_lr),
      HP_CONFIG_FIELD("optimizer.muon_momentum", optimizer.muon_momentum),
      HP_CONFIG_FIELD("schedule.decay", schedule.decay),
      HP_CONFIG_FIELD("schedule.warmup_steps", schedule.warmup_steps),
      HP_CONFIG_FIELD("schedule.min_lr_ratio", schedule.min_lr_ratio),
      HP_CONFIG_FIELD("schedule.decay_fraction", schedule.decay_fraction),
      HP_CONFIG_FIELD("checkpoint.interval", checkpoint.interval),
      HP_CONFIG_FIELD("checkpoint.dir", checkpoint.dir),
      HP_CONFIG_FIELD("checkpoint.async", checkpoint.async),
      HP_CONFIG_FIELD("checkpoint.keep", checkpoint.keep),
      HP_CONFIG_FIELD("eval.interval", eval.interval),
      HP_CONFIG_FIELD("eval.batches", eval.batches),
      HP_CONFIG_FIELD("log.interval", log.interval),
      HP_CONFIG_FIELD("log.profile_step", log.profile_step),
      HP_CONFIG_FIELD("resilience.collective_timeout_s", resilience.collective_timeout_s),
      HP_CONFIG_FIELD("resilience.watchdog_s", resilience.watchdog_s),
      HP_CONFIG_FIELD("resilience.replica_check_interval", resilience.replica_check_interval),
      HP_CONFIG_FIELD("resilience.in_memory_checkpoint_interval", resilience.in_memory_checkpoint_interval),
      HP_CONFIG_FIELD("resilience.on_replica_mismatch", resilience.on_replica_mismatch),
      HP_CONFIG_FIELD("resilience.rerun_on_anomaly", resilience.rerun_on_anomaly),
      HP_CONFIG_FIELD("resilience.spike_factor", resilience.spike_factor),
      HP_CONFIG_FIELD("resilience.on_transient_fault", resilience.on_transient_fault),
      HP_CONFIG_FIELD("resilience.faults", resilience.faults),
      HP_CONFIG_FIELD("comm.transport", comm_settings.transport),
      HP_CONFIG_FIELD("comm.gradient_wire", comm_settings.gradient_wire),
      HP_CONFIG_FIELD("comm.tp_wire", comm_settings.tp_wire),
      HP_CONFIG_FIELD("sample.prompt", sample.prompt),
      HP_CONFIG_FIELD("sample.tokens", sample.tokens),
  };
  return all;
}
#undef HP_CONFIG_FIELD

// The model family's field `name` in `config`.
models::ConfigFieldRef model_field(TrainConfig& config, const std::string& name) {
  for (const auto& [field, ref] : config.model->fields())
    if (field == name) return ref;
  HP_FAIL("config: model family ", config.model->family(), " has no field ", name);
}

// Every key of `config`: the trainer's, with its model family's after model.family.
std::vector<Field> fields(const TrainConfig& config) {
  std::vector<Field> all;
  for (const Field& f : trainer_fields()) {
    all.push_back(f);
    if (f.key != "model.family") continue;
    for (const auto& [name, ref] : const_cast<TrainConfig&>(config).model->fields()) {
      const std::string key = "model." + name;
      all.push_back(Field{key,
                          [name = name, key](TrainConfig& c, const YAML::Node& n) {
                            std::visit([&](auto* value) { *value = convert<std::decay_t<decltype(*value)>>(n, key); },
                                       model_field(c, name));
                          },
                          [name = name](const TrainConfig& c) {
                            return std::visit([](auto* value) { return nlohmann::json(*value); },
                                              model_field(const_cast<TrainConfig&>(c), name));
                          }});
    }
  }
  return all;
}

std::optional<Field> find_field(const TrainConfig& config, const std::string& key) {
  for (const auto& f : fields(config))
    if (f.key == key) return f;
  return std::nullopt;
}

std::string known_keys_under(const TrainConfig& config, const std::string& section) {
  std::string out;
  for (const auto& f : fields(config))
    if (section.empty() ? f.key.find('.') == std::string::npos : f.key.rfind(section + ".", 0) == 0)
      out += (out.empty() ? "" : ", ") + f.key;
  return out;
}

// Keys that were renamed, so that the config.json of an older run still loads (hp-ckpt reads it).
const std::map<std::string, std::string>& renamed_keys() {
  static const std::map<std::string, std::string> renamed = {{"train.mixed_precision_param", "train.dtype"}};
  return renamed;
}

void apply(TrainConfig& config, const std::string& given_key, const YAML::Node& node, const std::string& source) {
  const auto renamed = renamed_keys().find(given_key);
  const std::string& key = renamed == renamed_keys().end() ? given_key : renamed->second;
  if (renamed != renamed_keys().end())
    log::warn("config: '", given_key, "' in ", source, " is now '", key, "'; read as that");
  const std::optional<Field> field = find_field(config, key);
  if (!field) {
    const auto dot = key.find('.');
    const std::string section = dot == std::string::npos ? "" : key.substr(0, dot);
    const std::string known = known_keys_under(config, section);
    HP_FAIL("config: unknown key '", key, "' in ", source, " (known", section.empty() ? "" : " under " + section, ": ",
            known.empty() ? known_keys_under(config, "") : known, ")");
  }
  field->set(config, node);
}

// Applies every leaf of `node` (a mapping), keys joined with dots.
void apply_tree(TrainConfig& config, const YAML::Node& node, const std::string& prefix, const std::string& source) {
  for (const auto& item : node) {
    const std::string key = prefix + item.first.as<std::string>();
    if (item.second.IsMap() && !find_field(config, key))
      apply_tree(config, item.second, key + ".", source);
    else
      apply(config, key, item.second, source);
  }
}

// An override "dotted.key=value": the key, and the value read as YAML.
std::pair<std::string, YAML::Node> parse_override(const std::string& o) {
  const auto eq = o.find('=');
  HP_CHECK(eq != std::string::npos && eq > 0, "config: override '", o, "' is not key=value");
  try {
    return {o.substr(0, eq), YAML::Load(o.substr(eq + 1))};
  } catch (const YAML::Exception& e) {
    HP_FAIL("config: override '", o, "': ", e.what());
  }
}

// model.<name> (a string) as the file or, last one winning, an override sets it; empty when neither
// does. The file may nest it (model: {family: ...}) or spell it out ("model.family": ..., as the
// run's config.json does, whose keys may come in any order).
std::string model_key_in(const YAML::Node& root, const std::vector<std::string>& overrides, const std::string& name) {
  const std::string key = "model." + name;
  std::string value;
  if (root && root.IsMap() && root["model"] && root["model"].IsMap() && root["model"][name])
    value = convert<std::string>(root["model"][name], key);
  else if (root && root.IsMap() && root[key])
    value = convert<std::string>(root[key], key);
  for (const auto& o : overrides)
    if (o.rfind(key + "=", 0) == 0) value = convert<std::string>(parse_override(o).second, key);
  return value;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  HP_CHECK(in, "config: cannot read ", path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The model.* keys a Hugging Face directory's config.json gives (model.from_hf), family included.
YAML::Node hf_model_keys(const std::string& dir) {
  const std::string path = dir + "/config.json";
  HP_CHECK(std::ifstream(path).good(), "config: model.from_hf: cannot read ", path,
           " (model.from_hf names a Hugging Face model directory)");
  try {
    return YAML::Load(models::model_keys_from_hf_config(read_text(path)))["model"];
  } catch (const Error& e) {
    HP_FAIL("config: model.from_hf: ", path, ": ", e.what());
  }
}

}  // namespace

TrainConfig parse_config(const std::string& yaml, const std::vector<std::string>& overrides,
                         const std::string& source) {
  TrainConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    HP_FAIL("config: ", source, " is not valid YAML: ", e.what());
  }
  std::string family = model_key_in(root, overrides, "family");
  // model.from_hf: the architecture comes from the directory's config.json; a key the config also
  // sets must agree with it.
  const std::string from_hf = model_key_in(root, overrides, "from_hf");
  YAML::Node hf_keys;
  std::map<std::string, nlohmann::json> hf_values;
  if (!from_hf.empty()) {
    hf_keys = hf_model_keys(from_hf);
    const std::string hf_family = hf_keys["family"].as<std::string>();
    HP_CHECK(family.empty() || family == hf_family, "config: model.family is ", family, " but ", from_hf,
             "/config.json describes a ", hf_family, " model (model.from_hf sets the architecture)");
    family = hf_family;
  }
  if (!family.empty()) config.model = models::ModelConfig(family);
  if (hf_keys) {
    apply_tree(config, hf_keys, "model.", from_hf + "/config.json");
    for (const auto& item : hf_keys) {
      const std::string key = "model." + item.first.as<std::string>();
      hf_values[key] = find_field(config, key)->get(config);
    }
  }
  if (root && !root.IsNull()) {
    HP_CHECK(root.IsMap(), "config: ", source, " must be a mapping of sections (model:, parallel:, train:, ...)");
    apply_tree(config, root, "", source);
  }
  for (const auto& o : overrides) {
    const auto [key, value] = parse_override(o);
    apply(config, key, value, "--set");
  }
  for (const auto& [key, value] : hf_values) {
    const nlohmann::json set = find_field(config, key)->get(config);
    HP_CHECK(set == value, "config: ", key, " is ", set.dump(), " but ", from_hf, "/config.json gives ", value.dump(),
             ": model.from_hf sets the architecture (drop ", key, " or make it agree)");
  }
  return config;
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_text(path), overrides, path);
}

void validate(const TrainConfig& c, int64_t world_size) {
  c.model->validate();
  c.parallel.validate(world_size);
  HP_CHECK(c.model->vocab() >= data::ByteTokenizer::kVocab, "model.vocab (", c.model->vocab(),
           ") is smaller than the byte tokenizer's ", data::ByteTokenizer::kVocab, " tokens");
  HP_CHECK(c.data.seq_len > 0 && c.data.seq_len <= c.model->max_seq(), "data.seq_len (", c.data.seq_len,
           ") must be in 1..model.max_seq (", c.model->max_seq(), ")");
  HP_CHECK(c.train.steps > 0, "train.steps must be positive, got ", c.train.steps);
  HP_CHECK(c.train.micro_batch > 0 && c.train.global_batch > 0,
           "train.global_batch and train.micro_batch must be positive");
  HP_CHECK(c.train.global_batch % c.parallel.dp() == 0, "train.global_batch (", c.train.global_batch,
           ") must be divisible by the data-parallel degree dp_replicate x dp_shard (", c.parallel.dp(), ")");
  HP_CHECK(c.per_rank_batch() % c.train.micro_batch == 0, "train.micro_batch (", c.train.micro_batch,
           ") must divide the per-rank batch global_batch / dp (", c.per_rank_batch(), ")");
  HP_CHECK(checkpoint_mode_named(c.memory.checkpoint).has_value(), "memory.checkpoint '", c.memory.checkpoint,
           "' is unknown (available: none, full, selective)");
  HP_CHECK(c.train.device == "cpu" || c.train.device == "cuda", "train.device '", c.train.device,
           "' is unknown (available: cpu, cuda)");
  HP_CHECK(c.memory.swap == "none" || c.memory.swap == "host" || c.memory.swap == "file", "memory.swap '",
           c.memory.swap, "' is unknown (available: none, host, file)");
  HP_CHECK(c.memory.swap_dir.empty() || c.memory.swap == "file", "memory.swap_dir is the file tier's directory; ",
           "it needs memory.swap file, not ", c.memory.swap);
  HP_CHECK(c.memory.offload == "none" || c.memory.offload == "host" || c.memory.offload == "file", "memory.offload '",
           c.memory.offload, "' is unknown (available: none, host, file)");
  HP_CHECK(c.memory.offload_dir.empty() || c.memory.offload == "file",
           "memory.offload_dir is the file tier's directory; it needs memory.offload file, not ", c.memory.offload);
  HP_CHECK(c.memory.offload_units.empty() || c.memory.offload != "none",
           "memory.offload_units chooses the units memory.offload moves to its tier; it needs memory.offload host or "
           "file");
  HP_CHECK(c.memory.offload_prefetch >= 0, "memory.offload_prefetch (", c.memory.offload_prefetch, ") must be >= 0");
  HP_CHECK(c.memory.offload_prefetch == 1 || c.memory.offload != "none",
           "memory.offload_prefetch is how far ahead memory.offload's units gather; it needs memory.offload host or "
           "file");
  HP_CHECK(c.memory.offload_prefetch == 1 || c.parallel.pp == 1,
           "memory.offload_prefetch orders the gathers of a model's blocks; with parallel.pp > 1 each pipeline stage "
           "is one FSDP unit that gathers at its use: leave it at 1");
  if (c.train.device == "cuda") {
#ifndef HP_WITH_CUDA
    HP_FAIL("train.device cuda needs the device build (cmake -DHP_CUDA=ON against a CUDA LibTorch 2.x, docs/gpu.md)");
#endif
    // What the GPU path does not cover yet fails here, by name, rather than mid-run (docs/gpu.md).
    HP_CHECK(world_size == 1, "train.device cuda trains one rank for now (collectives on GPU tensors are not ",
             "implemented yet); this run has ", world_size, " ranks");
    HP_CHECK(c.model->family() == "llama", "train.device cuda supports the llama family for now, not ",
             c.model->family());
    HP_CHECK(c.memory.swap == "none", "memory.swap ", c.memory.swap, " is for the CPU; train.device cuda needs none");
    HP_CHECK(c.memory.offload == "none", "memory.offload ", c.memory.offload,
             " is for the CPU; train.device cuda needs none");
  }
  HP_CHECK(c.memory.swap == "none" || c.memory.checkpoint == "none", "memory.swap ", c.memory.swap,
           " and memory.checkpoint ", c.memory.checkpoint, " both say what blocks keep for backward; set one of them");
  HP_CHECK(c.memory.swap_prefetch >= 0, "memory.swap_prefetch (", c.memory.swap_prefetch, ") must be >= 0");
  const auto& blocks = c.memory.blocks;
  if (!blocks.empty()) {
    HP_CHECK(static_cast<int64_t>(blocks.size()) == c.model->layers(), "memory.blocks has ", blocks.size(),
             " entries for the ", c.model->layers(), " layers of the model (one per layer, in layer order)");
    for (const std::string& block : blocks) {
      HP_CHECK(checkpoint_mode_named(block, /*swap=*/true).has_value(), "memory.blocks: '", block,
               "' is unknown (available: none, full, selective, swap)");
      HP_CHECK(block != "swap" || c.memory.swap != "none",
               "memory.blocks: swap needs memory.swap to name its tier (host or file)");
    }
    HP_CHECK(c.memory.checkpoint == "none", "memory.blocks and memory.checkpoint ", c.memory.checkpoint,
             " both say what blocks keep for backward; set one of them");
  }
  HP_CHECK(c.memory.budget_mb >= 0, "memory.budget_mb (", c.memory.budget_mb, ") must be >= 0");
  if (c.memory.budget_mb > 0) {
    HP_CHECK(blocks.empty() && c.memory.checkpoint == "none",
             "memory.budget_mb chooses memory.blocks itself; leave memory.blocks and memory.checkpoint unset");
    HP_CHECK(c.train.device == "cpu", "memory.budget_mb plans with dry runs, which cover train.device cpu only");
  }
  const bool splits_backward = pp::orders_for_costs(c.pp_schedule);
  detail::pipeline_costs(c);  // names what is wrong with parallel.pp_costs
  HP_CHECK(c.pp_costs == "measured" || (c.parallel.pp > 1 && splits_backward), "parallel.pp_costs (", c.pp_costs,
           ") orders the zero-bubble schedules (", pp::cost_ordered_schedule_names(),
           ") of parallel.pp > 1; this run has parallel.pp ", c.parallel.pp, " and parallel.pp_schedule ",
           c.pp_schedule);
  HP_CHECK(c.cp_mode == "ring" || c.cp_mode == "allgather" || c.cp_mode == "ulysses" || c.cp_mode == "hybrid",
           "parallel.cp_mode '", c.cp_mode, "' is unknown (available: ring, allgather, ulysses, hybrid)");
  const CpMode cp_mode = cp_mode_named(c.cp_mode);
  HP_CHECK(c.parallel.cp == 1 || c.data.seq_len % (2 * c.parallel.cp) == 0, "data.seq_len (", c.data.seq_len,
           ") must be divisible by 2 x parallel.cp (", 2 * c.parallel.cp,
           "): context parallelism cuts each sequence into 2 x cp pieces, an early and a late one per rank");
  HP_CHECK(c.parallel.cp > 1 || (c.cp_mode == "ring" && c.cp_ulysses == 0 && !c.cp_async),
           "parallel.cp_mode, parallel.cp_ulysses and parallel.cp_async need parallel.cp > 1");
  HP_CHECK(cp_mode == CpMode::kHybrid || c.cp_ulysses == 0, "parallel.cp_ulysses is the Ulysses degree of ",
           "parallel.cp_mode hybrid; parallel.cp_mode is ", c.cp_mode);
  HP_CHECK(c.parallel.cp == 1 || c.sample.tokens == 0 || c.model->max_seq() % (2 * c.parallel.cp) == 0,
           "sample.tokens under parallel.cp needs model.max_seq (", c.model->max_seq(),
           ") divisible by 2 x parallel.cp (", 2 * c.parallel.cp,
           "): the context, padded at its end to such a multiple, must fit in max_seq");
  c.model->validate_parallel(c.parallel, detail::recipe_options(c));  // needs the batch split checked
  // FSDP shards over dp_shard x cp (context-parallel ranks hold the same parameters).
  HP_CHECK(c.reshard_after_forward_to >= 0 && (c.reshard_after_forward_to == 0 ||
                                               (c.parallel.dp_shard * c.parallel.cp) % c.reshard_after_forward_to == 0),
           "parallel.reshard_after_forward_to (", c.reshard_after_forward_to, ") must divide parallel.dp_shard (",
           c.parallel.dp_shard, ")", c.parallel.cp > 1 ? " x parallel.cp (" + std::to_string(c.parallel.cp) + ")" : "");
  HP_CHECK(!c.sequence_parallel || c.parallel.tp > 1, "parallel.sequence_parallel needs parallel.tp > 1");
  HP_CHECK(!c.async_tp || c.sequence_parallel,
           "parallel.async_tp fuses sequence parallelism's gathers and reduce-scatters with the matmuls: it needs "
           "parallel.sequence_parallel: true (and parallel.tp > 1)");
  HP_CHECK(!c.sequence_parallel || (c.data.seq_len / c.parallel.cp) % c.parallel.tp == 0, "data.seq_len (",
           c.data.seq_len, ") / parallel.cp (", c.parallel.cp, ") must be divisible by parallel.tp (", c.parallel.tp,
           ") with sequence_parallel");
  HP_CHECK(c.train.on_nonfinite == "stop" || c.train.on_nonfinite == "skip", "train.on_nonfinite '",
           c.train.on_nonfinite, "' is unknown (available: stop, skip)");
  for (const std::string* dtype : {&c.train.dtype, &c.train.mixed_precision_reduce})
    HP_CHECK(*dtype == "fp32" || *dtype == "bf16",
             dtype == &c.train.dtype ? "train.dtype" : "train.mixed_precision_reduce", " '", *dtype,
             "' is unknown (available: fp32, bf16)");
  HP_CHECK(
      c.train.mixed_precision_reduce == "fp32" || c.parallel.dp() * c.parallel.cp > 1,
      "train.mixed_precision_reduce is the dtype of the gradient reduction across data-parallel ranks, which this ",
      "run does not have: it needs parallel.dp_shard x dp_replicate x cp > 1");
  HP_CHECK(c.train.cpu_threads >= 0 && c.train.cpu_threads <= 1024, "train.cpu_threads must be in 0..1024 (0: as ",
           "launched), got ", c.train.cpu_threads);
  HP_CHECK(c.optimizer.name == "adamw" || c.optimizer.name == "muon", "optimizer.name '", c.optimizer.name,
           "' is unknown (available: adamw, muon)");
  HP_CHECK(c.log.profile_step >= 0 && c.log.profile_step <= c.train.steps, "log.profile_step (", c.log.profile_step,
           ") must be a step of the run, 1 to train.steps (", c.train.steps, "), or 0 for none");
  HP_CHECK(c.pp_timeline_step >= 0 && c.pp_timeline_step <= c.train.steps, "parallel.pp_timeline_step (",
           c.pp_timeline_step, ") must be a step of the run, 1 to train.steps (", c.train.steps, "), or 0 for none");
  HP_CHECK(c.pp_timeline_step == 0 || c.parallel.pp > 1, "parallel.pp_timeline_step needs parallel.pp > 1");
  if (c.parallel.pp > 1) {
    const int64_t stages = c.pipeline_stages();
    HP_CHECK(stages > 0, "parallel.pp_schedule '", c.pp_schedule, "' is unknown (available: ", pp::schedule_names(),
             ")");
    if (c.pp_layers_per_stage.empty()) {
      HP_CHECK(c.model->layers() % stages == 0, "model.layers (", c.model->layers(), ") must be divisible by the ",
               stages, " pipeline stages of parallel.pp_schedule ", c.pp_schedule, " on ", c.parallel.pp,
               " ranks (or set parallel.pp_layers_per_stage)");
    } else {
      const auto& split = c.pp_layers_per_stage;
      HP_CHECK(static_cast<int64_t>(split.size()) == stages, "parallel.pp_layers_per_stage has ", split.size(),
               " entries for the ", stages, " pipeline stages of parallel.pp_schedule ", c.pp_schedule, " on ",
               c.parallel.pp, " ranks");
      int64_t total = 0;
      for (const int64_t layers : split) {
        HP_CHECK(layers >= 1 && layers <= c.model->layers(), "parallel.pp_layers_per_stage: every stage needs 1 to ",
                 c.model->layers(), " layers, got ", layers);
        total += layers;
      }
      HP_CHECK(total == c.model->layers(), "parallel.pp_layers_per_stage adds up to ", total,
               " layers, but model.layers is ", c.model->layers());
    }
  }
  HP_CHECK(c.optimizer.lr > 0, "optimizer.lr must be positive, got ", c.optimizer.lr);
  parse_decay(c.schedule.decay);  // names the valid decays on error
  HP_CHECK(c.schedule.warmup_steps >= 0 && c.schedule.warmup_steps <= c.train.steps, "schedule.warmup_steps (",
           c.schedule.warmup_steps, ") must be in 0..train.steps (", c.train.steps, ")");
  HP_CHECK(c.checkpoint.interval >= 0 && c.eval.interval >= 0 && c.log.interval > 0 && c.checkpoint.keep > 0,
           "checkpoint.interval and eval.interval must be >= 0, log.interval and checkpoint.keep > 0");
  HP_CHECK(c.data.eval_fraction > 0 && c.data.eval_fraction < 0.5, "data.eval_fraction must be in (0, 0.5), got ",
           c.data.eval_fraction);
  const TrainConfig::Resilience& r = c.resilience;
  const int64_t report_s = comm::kFailureReportWindow.count();
  HP_CHECK(r.collective_timeout_s > 0 && r.watchdog_s >= 0,
           "resilience.collective_timeout_s must be > 0 and resilience.watchdog_s >= 0 (0: derived)");
  HP_CHECK(r.watchdog_s == 0 || r.watchdog_s > r.collective_timeout_s + report_s, "resilience.watchdog_s ",
           r.watchdog_s, " is too short for resilience.collective_timeout_s ", r.collective_timeout_s,
           ": the timeouts must nest, collective_timeout_s + ", report_s,
           " s (naming the missing ranks) < watchdog_s, so that a stuck collective is reported before the "
           "watchdog ends the process. Raise watchdog_s above ",
           r.collective_timeout_s + report_s, " or set it to 0 (derived)");
  HP_CHECK(r.replica_check_interval >= 0, "resilience.replica_check_interval must be >= 0 (0: off), got ",
           r.replica_check_interval);
  HP_CHECK(r.in_memory_checkpoint_interval >= 0, "resilience.in_memory_checkpoint_interval must be >= 0 (0: off), got ",
           r.in_memory_checkpoint_interval);
  HP_CHECK(r.in_memory_checkpoint_interval == 0 || world_size >= 2,
           "resilience.in_memory_checkpoint_interval needs at least 2 ranks (each rank's copy is kept by another), "
           "got a world of ",
           world_size);
  HP_CHECK(r.on_replica_mismatch == "stop" || r.on_replica_mismatch == "warn", "resilience.on_replica_mismatch '",
           r.on_replica_mismatch, "' is unknown (available: stop, warn)");
  HP_CHECK(std::isfinite(r.spike_factor) && (r.spike_factor == 0 || r.spike_factor > 1),
           "resilience.spike_factor must be 0 (off) or above 1, got ", r.spike_factor);
  HP_CHECK(r.on_transient_fault == "continue" || r.on_transient_fault == "stop", "resilience.on_transient_fault '",
           r.on_transient_fault, "' is unknown (available: continue, stop)");
  HP_CHECK(r.rerun_on_anomaly || (r.spike_factor == 0 && r.on_transient_fault == "continue"),
           "resilience.spike_factor and on_transient_fault say what a rerun on an anomaly does: set "
           "resilience.rerun_on_anomaly: true");
  // Without deterministic kernels a GPU step does not recompute bitwise: every rerun would read as
  // a transient fault.
  HP_CHECK(!r.rerun_on_anomaly || c.train.device != "cuda" || c.train.deterministic,
           "resilience.rerun_on_anomaly on cuda needs train.deterministic: true (a rerun tells a transient fault "
           "from the data by recomputing the step bitwise, which only deterministic kernels do)");
  detail::check_faults_fire(detail::parse_faults(r.faults, "resilience.faults"), static_cast<int>(world_size),
                            c.train.steps);
  transport_of(c);  // names the transports when it is none of them
  HP_CHECK(gradient_wire_of(c) == comm::WireFormat::kNative || c.parallel.dp() * c.parallel.cp > 1,
           "comm.gradient_wire is the format of the gradient reduction across data-parallel ranks, which this run ",
           "does not have: it needs parallel.dp_shard x dp_replicate x cp > 1");
  HP_CHECK(tp_wire_of(c) == comm::WireFormat::kNative || c.parallel.tp > 1,
           "comm.tp_wire is the format of tensor parallelism's reductions, which this run does not have: it needs ",
           "parallel.tp > 1");
  HP_CHECK(!c.async_tp || tp_wire_of(c) == comm::WireFormat::kNative,
           "parallel.async_tp is not combined with comm.tp_wire (the fused reductions add in the data's own dtype)");
  HP_CHECK(!c.async_tp || transport_of(c) != comm::Transport::kGloo,
           "parallel.async_tp fuses through the memory the tp ranks share, which comm.transport: gloo turns off (the ",
           "fused ops would run unfused, with more collectives than plain sequence parallelism)");
}

comm::Transport transport_of(const TrainConfig& config) {
  for (comm::Transport t : {comm::Transport::kAuto, comm::Transport::kGloo, comm::Transport::kShm})
    if (comm::to_string(t) == config.comm_settings.transport) return t;
  HP_FAIL("comm.transport '", config.comm_settings.transport, "' is unknown (available: auto, gloo, shm)");
}

namespace {

comm::WireFormat wire_format_of(const char* key, const std::string& name) {
  const std::optional<comm::WireFormat> format = comm::wire_format_named(name);
  HP_CHECK(format, key, " '", name, "' is unknown (available: native, bf16, fp8_e4m3)");
  return *format;
}

}  // namespace

comm::WireFormat gradient_wire_of(const TrainConfig& config) {
  return wire_format_of("comm.gradient_wire", config.comm_settings.gradient_wire);
}

comm::WireFormat tp_wire_of(const TrainConfig& config) {
  return wire_format_of("comm.tp_wire", config.comm_settings.tp_wire);
}

std::string to_json(const TrainConfig& config) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& f : fields(config)) out[f.key] = f.get(config);
  return out.dump();
}

}  // namespace hp::train
