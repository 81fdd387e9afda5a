// hp-ckpt: look into, check and convert checkpoints without the model code.
//
//   hp-ckpt inspect CKPT                  tensors, shapes, dtypes, chunks, bytes, values
//   hp-ckpt verify CKPT                   read everything, check every checksum
//   hp-ckpt consolidate CKPT OUT          the same checkpoint with one chunk per tensor (one file)
//   hp-ckpt convert --to hf CKPT OUT      the model's tensors as Hugging Face safetensors (Llama, Qwen3,
//                                         Qwen3-MoE names; hp/models/hf_state.h)
//   hp-ckpt convert --from hf HF OUT      Hugging Face safetensors as a checkpoint hp-train can load
//   (convert --dtype fp32|bf16|fp16 casts the floating-point tensors)
#include <hp/comm/init.h>
#include <hp/core/error.h>
#include <hp/dcp/checkpoint.h>
#include <hp/dcp/hf.h>
#include <hp/models/hf_config.h>
#include <hp/models/hf_state.h>
#include <hp/train/config.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/flags.h"

namespace {
namespace fs = std::filesystem;

constexpr const char* kModelPrefix = "model.";  // hp::dcp::model_state_dict's default prefix

// The flags; the command and its directories are positional.
struct Args {
  std::string to, from;                 // convert's format, "hf"
  std::optional<at::ScalarType> dtype;  // convert: floating-point tensors cast to this
};

// --dtype's names, with Hugging Face's for config.json.
struct DtypeName {
  const char* flag;
  at::ScalarType type;
  const char* torch_dtype;
};
constexpr DtypeName kDtypes[] = {
    {"fp32", at::kFloat, "float32"}, {"bf16", at::kBFloat16, "bfloat16"}, {"fp16", at::kHalf, "float16"}};

// Casts the floating-point tensors to `dtype` (nothing without one).
void cast_floats(std::map<std::string, at::Tensor>& tensors, const std::optional<at::ScalarType>& dtype) {
  if (!dtype) return;
  for (auto& [name, t] : tensors)
    if (at::isFloatingType(t.scalar_type())) t = t.to(*dtype);
}

const std::vector<hp::tools::Flag<Args>>& flags() {
  const auto format = [](const char* flag) {
    return [flag](const std::string& v) {
      if (v != "hf") throw hp::tools::UsageError(std::string(flag) + " takes hf, got '" + v + "'");
      return v;
    };
  };
  static const std::vector<hp::tools::Flag<Args>> table = {
      {{"--to"},
       "hf",
       "convert: write a Hugging Face directory (safetensors)",
       [check = format("--to")](Args& a, const std::string& v) { a.to = check(v); }},
      {{"--from"},
       "hf",
       "convert: read a Hugging Face directory into a checkpoint",
       [check = format("--from")](Args& a, const std::string& v) { a.from = check(v); }},
      {{"--dtype"},
       "fp32|bf16|fp16",
       "convert: cast the floating-point tensors (default: keep each tensor's dtype)",
       [](Args& a, const std::string& v) {
         for (const DtypeName& d : kDtypes)
           if (v == d.flag) {
             a.dtype = d.type;
             return;
           }
         throw hp::tools::UsageError("--dtype takes fp32, bf16 or fp16, got '" + v + "'");
       }},
  };
  return table;
}

int usage(std::ostream& out, int code) {
  out << "usage:\n"
         "  hp-ckpt inspect CKPT\n"
         "  hp-ckpt verify CKPT\n"
         "  hp-ckpt consolidate CKPT OUT\n"
         "  hp-ckpt convert --to hf CKPT OUT\n"
         "  hp-ckpt convert --from hf HF_DIR OUT\n"
         "  (convert takes --dtype fp32|bf16|fp16 to cast the floating-point tensors)\n\n"
         "CKPT is one checkpoint directory (e.g. runs/tiny_llama/checkpoints/step-000300) or a run's\n"
         "checkpoints/ directory (its latest checkpoint is used).\n\noptions:\n"
      << hp::tools::flag_help(flags());
  return code;
}

// A checkpoint directory, or the latest one under a checkpoints/ directory.
std::string resolve(const std::string& path) {
  if (auto latest = hp::dcp::latest_checkpoint(path)) return *latest;
  return path;
}

int inspect(const std::string& dir) {
  const hp::dcp::StateDict state = hp::dcp::load_whole(dir);
  int64_t bytes = 0;
  std::cout << dir << "\n";
  for (const auto& [name, t] : state.tensors) {
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
    std::cout << "  " << std::left << std::setw(48) << name << " " << std::setw(10) << c10::toString(t.scalar_type())
              << " " << t.sizes() << "\n";
  }
  std::cout << state.tensors.size() << " tensors, " << bytes << " bytes\nvalues: " << state.values.dump() << "\n";
  return 0;
}

int verify(const std::string& dir) {
  const hp::dcp::VerifyReport r = hp::dcp::verify(dir);
  std::cout << dir << ": ok (" << r.tensors << " tensors, " << r.chunks << " chunks, " << r.bytes
            << " bytes, every checksum matches)\n";
  return 0;
}

int consolidate(const std::string& dir, const std::string& out, const hp::comm::ProcessGroup& world) {
  hp::dcp::save(hp::dcp::load_whole(dir), out, world);
  std::cout << "wrote " << out << "\n";
  return 0;
}

int to_hf(const std::string& dir, const std::string& out, const hp::comm::ProcessGroup& world,
          const std::optional<at::ScalarType>& dtype) {
  const hp::dcp::StateDict state = hp::dcp::load_whole(dir);
  hp::dcp::StateDict model;
  for (const auto& [name, t] : state.tensors)
    if (name.rfind(kModelPrefix, 0) == 0) model.tensors[name.substr(std::string(kModelPrefix).size())] = t;
  HP_CHECK(!model.tensors.empty(), "convert: ", dir, " has no tensors named ", kModelPrefix, "*");
  hp::dcp::StateDict hf;
  hf.tensors = hp::models::to_hf_tensors(model.tensors);
  cast_floats(hf.tensors, dtype);
  std::string torch_dtype = "float32";  // what hp-train trains in
  for (const DtypeName& d : kDtypes)
    if (dtype == d.type) torch_dtype = d.torch_dtype;
  // hp-train keeps the run's config beside its checkpoints/ directory. Read first, so that a
  // config we cannot map stops before anything is written.
  fs::path checkpoint = fs::absolute(dir).lexically_normal();
  if (checkpoint.filename().empty()) checkpoint = checkpoint.parent_path();  // a trailing '/'
  const fs::path run_config = checkpoint.parent_path().parent_path() / "config.json";
  hp::dcp::HfSaveOptions options;
  if (fs::exists(run_config)) {
    const hp::train::TrainConfig run = hp::train::load_config(run_config.string());
    options.files = {{"config.json", hp::models::to_hf_config(*run.model, torch_dtype)},
                     {"generation_config.json", hp::models::to_hf_generation_config(*run.model)}};
  }
  hp::dcp::save_hf(
      hf, out, world, [](const std::string& name) { return name; }, options);
  std::cout << "wrote " << hf.tensors.size() << " tensors to " << out << "\n";
  if (options.files.empty())
    std::cout << "no config.json written: " << run_config.string() << " (the run's config) does not exist\n";
  else
    std::cout << "wrote config.json and generation_config.json from " << run_config.string() << "\n";
  return 0;
}

int from_hf(const std::string& dir, const std::string& out, const hp::comm::ProcessGroup& world,
            const std::optional<at::ScalarType>& dtype) {
  hp::dcp::StateDict state;
  for (const auto& [name, t] : hp::models::from_hf_tensors(hp::dcp::load_hf_whole(dir).tensors))
    state.tensors[kModelPrefix + name] = t;
  cast_floats(state.tensors, dtype);
  state.values["source"] = "hf:" + dir;
  // The model keys first, so that a config we cannot build stops before anything is written.
  const fs::path hf_config = fs::path(dir) / "config.json";
  std::string model_keys;
  if (fs::exists(hf_config)) {
    std::ostringstream text;
    text << std::ifstream(hf_config).rdbuf();
    model_keys = hp::models::model_keys_from_hf_config(text.str());
  }
  hp::dcp::save(state, out, world);
  std::cout << "wrote " << state.tensors.size() << " tensors to " << out << "\n";
  if (model_keys.empty()) {
    std::cout << "no model.yaml written: " << hf_config.string() << " does not exist\n";
    return 0;
  }
  std::ofstream(fs::path(out) / "model.yaml") << "# hp-train's model keys for " << hf_config.string() << "\n"
                                              << model_keys;
  std::cout << "wrote " << out << "/model.yaml (the model keys for hp-train)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args flags_given;
  std::vector<std::string> args;  // the command and its directories
  try {
    if (!hp::tools::parse_flags(argc, argv, flags(), flags_given, args)) return usage(std::cout, 0);
  } catch (const hp::tools::UsageError& e) {
    std::cerr << "hp-ckpt: " << e.what() << "\n\n";
    return usage(std::cerr, 2);
  }
  if (args.empty()) return usage(std::cerr, 2);
  const bool converting = !flags_given.to.empty() || !flags_given.from.empty() || flags_given.dtype.has_value();
  try {
    const std::string& command = args[0];
    if (command == "inspect" && args.size() == 2 && !converting) return inspect(resolve(args[1]));
    if (command == "verify" && args.size() == 2 && !converting) return verify(resolve(args[1]));
    const bool known = (command == "consolidate" && args.size() == 3 && !converting) ||
                       (command == "convert" && args.size() == 3 && flags_given.to.empty() != flags_given.from.empty());
    if (!known) {
      std::cerr << "hp-ckpt: unknown command or wrong arguments\n\n";
      return usage(std::cerr, 2);
    }
    const hp::comm::ProcessGroup world = hp::comm::init_process_group();
    HP_CHECK(world.size() == 1, "hp-ckpt runs as one process (no hprun)");
    if (command == "consolidate") return consolidate(resolve(args[1]), args[2], world);
    if (!flags_given.to.empty()) return to_hf(resolve(args[1]), args[2], world, flags_given.dtype);
    return from_hf(args[1], args[2], world, flags_given.dtype);
  } catch (const hp::Error& e) {
    std::cerr << "hp-ckpt: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {  // LibTorch's c10::Error, out of memory, a filesystem error
    std::cerr << "hp-ckpt: error: " << e.what() << "\n";
    return 1;
  }
}
