#include "hp/dcp/hf.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <vector>

#include "dcp/file_io.h"
#include "dcp/metadata.h"
#include "dcp/reader.h"
#include "dcp/safetensors.h"
#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"

namespace hp::dcp {
namespace fs = std::filesystem;
namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string shard_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// The HF tensors of `dir` as checkpoint records: one unchecked chunk per tensor covering it whole.
std::map<std::string, detail::TensorRecord> hf_records(const std::string& dir) {
  std::vector<std::string> files;
  if (fs::exists(fs::path(dir) / kIndexFile)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(detail::read_file((fs::path(dir) / kIndexFile).string()));
      for (const auto& [name, entry] : index.at("weight_map").items()) {
        const std::string file = entry.get<std::string>();
        // A file name in the directory, never a path out of it.
        HP_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", "hf: ", dir, "/",
                 kIndexFile, " maps '", name, "' to '", file, "', which is not a file name in that directory");
        if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
      }
    } catch (const nlohmann::json::exception& e) {
      HP_FAIL("hf: ", dir, "/", kIndexFile, " is not a valid index: ", e.what());
    }
  } else {
    HP_CHECK(fs::exists(fs::path(dir) / kSingleFile), "hf: ", dir, " has neither ", kSingleFile, " nor ", kIndexFile);
    files.push_back(kSingleFile);
  }
  std::map<std::string, detail::TensorRecord> records;
  for (const auto& file : files) {
    const detail::SafetensorsFile header = detail::read_safetensors_header((fs::path(dir) / file).string());
    for (const auto& e : header.entries) {
      detail::TensorRecord record;
      record.dtype = e.dtype;
      record.shape = e.shape;
      if (e.end > e.begin) {
        detail::ChunkRecord chunk;
        chunk.offsets.assign(e.shape.size(), 0);
        chunk.sizes = e.shape;
        chunk.file = file;
        chunk.byte_offset = header.data_start + e.begin;
        chunk.nbytes = e.end - e.begin;
        record.chunks.push_back(std::move(chunk));
      }
      HP_CHECK(records.emplace(e.name, std::move(record)).second, "hf: tensor '", e.name, "' appears twice in ", dir);
    }
  }
  return records;
}

// Our tensor's record as `hf` places it in `records`: that tensor's, or for a stack, a record of
// the stacked shape whose chunks are the pieces' bytes at their offsets along dim 0.
detail::TensorRecord record_of(const std::map<std::string, detail::TensorRecord>& records, const HfName& hf,
                               const std::string& ours, const std::string& dir) {
  const auto find = [&](const std::string& name) -> const detail::TensorRecord& {
    const auto it = records.find(name);
    HP_CHECK(it != records.end(), "hf.load: ", dir, " has no tensor '", name, "' (for '", ours, "')");
    return it->second;
  };
  if (!hf.stacks) return find(hf.names.at(0));
  const detail::TensorRecord& first = find(hf.names.at(0));
  detail::TensorRecord stacked;
  stacked.dtype = first.dtype;
  stacked.shape = first.shape;
  stacked.shape.insert(stacked.shape.begin(), static_cast<int64_t>(hf.names.size()));
  for (size_t i = 0; i < hf.names.size(); ++i) {
    const detail::TensorRecord& piece = find(hf.names[i]);
    HP_CHECK(piece.dtype == first.dtype && piece.shape == first.shape, "hf.load: '", hf.names[i], "' in ", dir,
             " differs in dtype or shape from '", hf.names[0], "', which '", ours, "' stacks with it");
    for (detail::ChunkRecord chunk : piece.chunks) {
      chunk.offsets.insert(chunk.offsets.begin(), static_cast<int64_t>(i));
      chunk.sizes.insert(chunk.sizes.begin(), 1);
      stacked.chunks.push_back(std::move(chunk));
    }
  }
  return stacked;
}

}  // namespace

HfName::HfName(std::string name) {
  if (!name.empty()) names.push_back(std::move(name));
}

HfName::HfName(std::vector<std::string> names_, bool stacks_) : names(std::move(names_)), stacks(stacks_) {
  const bool named = std::none_of(names.begin(), names.end(), [](const std::string& n) { return n.empty(); });
  if (stacks)
    HP_CHECK(!names.empty() && named, "hf: a stacked tensor needs a name for each of its pieces");
  else
    HP_CHECK(names.size() == 1 && named, "hf: a tensor that is not stacked has one name, got ", names.size());
}

void save_hf(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group, const NameMap& to_hf,
             HfSaveOptions options) {
  for (const auto& file : options.files)  // checked on every rank, before any collective
    HP_CHECK(!file.first.empty() && fs::path(file.first).filename() == file.first, "hf.save: '", file.first,
             "' is not a file name (a file goes into ", dir, " itself)");
  // Plan the files from shapes alone (every rank knows them), so no rank ever holds more than one
  // gathered tensor: tensors in name order, a new shard when the current one would exceed the limit.
  struct Item {
    std::string ours;
    HfName hf;
    at::Tensor tensor;
  };
  std::vector<std::vector<Item>> shards(1);
  uint64_t in_shard = 0, total = 0;
  std::map<std::string, bool> seen;
  for (const auto& [name, t] : state.tensors) {
    const HfName hf = to_hf(name);
    if (hf.names.empty()) continue;
    HP_CHECK(!hf.stacks || (t.dim() >= 1 && t.size(0) == static_cast<int64_t>(hf.names.size())), "hf.save: '", name,
             "' of shape ", t.sizes(), " cannot stack ", hf.names.size(), " tensors on its dim 0");
    for (const std::string& n : hf.names) {
      HP_CHECK(!seen[n], "hf.save: two tensors map to the Hugging Face name '", n, "'");
      seen[n] = true;
    }
    if (in_shard > 0 && in_shard + nbytes(t) > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({name, hf, t});
    in_shard += nbytes(t);
    total += nbytes(t);
  }
  const bool lead = group.rank() == 0;
  if (lead) fs::create_directories(dir);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? kSingleFile : shard_name(s, shards.size());
    std::optional<detail::FileWriter> out;
    if (lead) {
      std::vector<detail::SafetensorsEntry> entries;
      // A stack's pieces back to back: the bytes of the whole tensor, in order.
      for (const auto& item : shards[s]) {
        const std::string dtype = detail::safetensors_dtype(item.tensor.scalar_type());
        const std::vector<int64_t> shape = item.tensor.sizes().vec();
        if (!item.hf.stacks) entries.push_back({item.hf.names[0], dtype, shape});
        for (size_t i = 0; item.hf.stacks && i < item.hf.names.size(); ++i)
          entries.push_back({item.hf.names[i], dtype, std::vector<int64_t>(shape.begin() + 1, shape.end())});
      }
      const std::string header = detail::safetensors_header(entries, {{"format", "pt"}});
      out.emplace((fs::path(dir) / (file + ".tmp")).string());
      out->write(header.data(), header.size());
    }
    for (const auto& item : shards[s]) {
      at::NoGradGuard no_grad;
      const at::Tensor whole = (is_dtensor(item.tensor) ? DTensor(item.tensor).full_tensor() : item.tensor)
                                   .detach()
                                   .to(at::kCPU)
                                   .contiguous();
      if (lead) out->write(whole.data_ptr(), nbytes(whole));
      for (const std::string& n : item.hf.names) weight_map[n] = file;
    }
    if (lead) {
      out->sync_and_close();
      fs::rename(fs::path(dir) / (file + ".tmp"), fs::path(dir) / file);
    }
  }
  if (lead && shards.size() > 1)
    detail::write_file_atomically(
        (fs::path(dir) / kIndexFile).string(),
        nlohmann::json({{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}).dump(1));
  if (lead)
    for (const auto& [name, contents] : options.files)
      detail::write_file_atomically((fs::path(dir) / name).string(), contents);
  group.barrier();  // the files exist for every rank once save_hf returns
}

void load_hf(StateDict& state, const std::string& dir, const NameMap& to_hf) {
  const auto records = hf_records(dir);
  detail::Files files(dir);
  for (auto& [name, tensor] : state.tensors) {
    const HfName hf = to_hf(name);
    HP_CHECK(!hf.names.empty(), "hf.load: '", name, "' has no Hugging Face name");
    if (hf.optional && !records.count(hf.names[0])) continue;
    detail::read_tensor(files, record_of(records, hf, name, dir), /*block_bytes=*/0, name, tensor,
                        "the Hugging Face files in " + dir, /*convert_floats=*/true);
  }
}

StateDict load_hf_whole(const std::string& dir) {
  StateDict state;
  for (const auto& [name, record] : hf_records(dir))
    state.tensors[name] = at::zeros(record.shape, at::TensorOptions().dtype(detail::scalar_type_of(record.dtype)));
  load_hf(state, dir, [](const std::string& n) { return n; });
  return state;
}

}  // namespace hp::dcp
