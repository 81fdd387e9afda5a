// Saving: the calling thread decides which pieces this rank writes; it (or, with
// stage_in_background, a stager thread) stages copies of them; a writer thread streams them into
// this rank's safetensors file with per-block checksums. The ranks agree on the outcome through
// the group's store, not a collective: rank 0's writer waits for every rank's report, merges the
// per-rank indexes into metadata.json and, once rank 0's wait() allows it, commits by renaming the
// temporary directory; wait() reads the outcome. A save dropped before wait() commits nothing,
// however far its writers got (the caller may have found a reason not to keep it).
#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dcp/file_io.h"
#include "dcp/metadata.h"
#include "dcp/safetensors.h"
#include "dcp/staging_pool.h"
#include "dcp/xxhash64.h"
#include "hp/core/error.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dtensor/dtensor.h"

namespace hp::dcp {
namespace fs = std::filesystem;
namespace {

std::string rank_name(int rank, const char* suffix) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d%s", rank, suffix);
  return buf;
}

struct WriteItem {
  detail::SafetensorsEntry entry;  // name, dtype, local shape; begin/end once the header is laid out
  std::vector<int64_t> offsets;    // global offsets of the piece
  at::Tensor source;               // the piece to stage (this rank's local tensor, or a view of it)
  at::Tensor owner;                // the state dict's tensor (a DTensor's version counts its in-place ops)
  int64_t versions = 0;            // of source and owner when the save began (background staging)
  at::Tensor staged;               // contiguous CPU copy, set by the staging thread
  bool ready = false;
};

int64_t versions_of(const WriteItem& item) {
  return static_cast<int64_t>(item.source._version()) + static_cast<int64_t>(item.owner._version());
}

// The piece of `t` this rank writes and its global offsets, or nullopt when another rank writes it
// (replicas are written by coordinate 0 of every non-shard mesh dim; a plain tensor by the rank
// plain_tensors_to_write picks). Partial DTensors are reduced first (a collective over their mesh).
std::optional<std::pair<at::Tensor, std::vector<int64_t>>> piece_to_write(const at::Tensor& t, bool writes_plain) {
  if (!is_dtensor(t)) {
    if (!writes_plain) return std::nullopt;
    return std::make_pair(t, std::vector<int64_t>(t.dim(), 0));
  }
  DTensor d(t);
  bool partial = false;
  for (const auto& p : d.placements()) partial |= p.is_partial();
  if (partial) d = d.redistribute(d.device_mesh(), partial_as_replicate(d.placements()));
  const auto coordinate = d.device_mesh().get_coordinate();
  if (!coordinate) return std::nullopt;
  for (size_t i = 0; i < coordinate->size(); ++i)
    if (!d.placements()[i].is_shard() && (*coordinate)[i] != 0) return std::nullopt;
  return std::make_pair(d.to_local(), d.spec().local_shape_and_offset(*coordinate).second);
}

// The plain tensors of `state` this rank writes: each is written by the lowest rank that has it.
// Plain tensors are the same on every rank that has them, but not every rank has each (a pipeline
// stage's buffers live on its ranks only), so the ranks agree through the group's store: each posts
// its names, rank 0 picks the writers, each reads the picks.
std::set<std::string> plain_tensors_to_write(const StateDict& state, const comm::ProcessGroup& group,
                                             const std::string& key_prefix) {
  std::vector<std::string> names;
  for (const auto& [name, t] : state.tensors)
    if (!is_dtensor(t)) names.push_back(name);
  if (group.size() == 1) return {names.begin(), names.end()};
  const comm::GroupStore store = group.store();
  comm::StorePollOptions poll;
  poll.period = std::chrono::milliseconds(1);
  const auto read = [&](const std::string& key, const std::string& who) {
    HP_CHECK(store.wait_for({key}, poll).empty(), "dcp.save: ", who,
             " did not reach the save within the group timeout (a save is collective over the group)");
    return nlohmann::json::parse(store.get(key));
  };
  store.set(key_prefix + "plain/" + std::to_string(group.rank()), nlohmann::json(names).dump());
  if (group.rank() == 0) {
    nlohmann::json writers = nlohmann::json::object();
    for (int r = group.size() - 1; r >= 0; --r)  // downwards, so the lowest rank's claim stays
      for (const auto& name : read(key_prefix + "plain/" + std::to_string(r), "rank " + std::to_string(r)))
        writers[name.get<std::string>()] = r;
    store.set(key_prefix + "plain_writers", writers.dump());
  }
  const nlohmann::json writers = read(key_prefix + "plain_writers", "rank 0");
  std::set<std::string> mine;
  for (const std::string& name : names)
    if (writers.at(name).get<int>() == group.rank()) mine.insert(name);
  return mine;
}

// Adds to `into` what `from` has and `into` lacks, recursively through objects: values are saved
// from every rank, rank 0's winning where they disagree (ranks of different pipeline stages
// contribute their own parameters' entries).
void add_missing(nlohmann::json& into, const nlohmann::json& from) {
  if (!into.is_object() || !from.is_object()) return;
  for (const auto& [key, value] : from.items()) {
    if (!into.contains(key))
      into[key] = value;
    else
      add_missing(into[key], value);
  }
}

// Saves are collective, so every rank of a group numbers them alike; the number keeps each save's
// keys in the group's store apart. The count lives in the store (one counter per rank), so it
// starts afresh with every group and never depends on this process's history.
int64_t next_save_number(const comm::ProcessGroup& group) {
  return group.store().add("hp_dcp/saves/" + std::to_string(group.rank()), 1);
}

}  // namespace

struct AsyncSave::State {
  std::string dir, tmp;
  comm::ProcessGroup group;
  SaveOptions options;
  nlohmann::json tensors = nlohmann::json::object();  // name -> {dtype, shape} of every tensor this rank has
  nlohmann::json values;
  std::vector<WriteItem> items;

  std::mutex mu;
  std::condition_variable cv;
  size_t staged_bytes = 0;
  bool stop = false;            // the writer failed or the save was abandoned
  bool commit_allowed = false;  // by wait() (on rank 0: the commit waits for it)
  std::exception_ptr error;
  std::thread writer;
  std::thread stager;  // background staging only
  // Set once no tensor can have changed under the staging: at once when staging finishes before
  // save_async returns, else by finish_staging(). The writer reports success only after it.
  bool verified = false;
  // The save's keys in the group's store (see report_and_commit).
  std::string key_prefix;

  ~State() {  // staging buffers of an abandoned or failed save go back to the pool too
    if (options.stage_copies)
      for (auto& item : items) detail::release_staging(std::move(item.staged));
  }

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::move(e);
    }
    halt();
  }

  // Copies every item (or, without stage_copies, takes it as it is) within the staging budget.
  void stage_all() {
    at::NoGradGuard no_grad;
    for (auto& item : items) {
      const size_t bytes = static_cast<size_t>(item.source.numel()) * item.source.element_size();
      if (!reserve(bytes)) return;
      at::Tensor staged;
      if (options.stage_copies) {
        staged = detail::acquire_staging(item.source);
        staged.copy_(item.source.detach());
      } else {
        staged = item.source.detach().to(at::kCPU).contiguous();
      }
      std::lock_guard<std::mutex> lock(mu);
      item.staged = std::move(staged);
      item.ready = true;
      cv.notify_all();
    }
  }

  // Background staging: waits for the copies, then checks that no tensor changed since the save
  // began (an in-place op bumps its tensor's version after writing, so a change during a copy is
  // seen here at the latest). A change fails the save rather than committing torn data.
  void finish_staging() {
    if (stager.joinable()) {
      stager.join();
      for (const auto& item : items) {
        const int64_t now = versions_of(item);
        if (now == item.versions) continue;
        fail(std::make_exception_ptr(
            hp::Error("tensor '" + item.entry.name +
                      "' changed while the save was staging it in the background (its version "
                      "went from " +
                      std::to_string(item.versions) + " to " + std::to_string(now) +
                      "); call AsyncSave::wait_staged() before changing the tensors of a save")));
        break;
      }
    }
    mark_verified();
  }
  void mark_verified() {
    std::lock_guard<std::mutex> lock(mu);
    verified = true;
    cv.notify_all();
  }

  // This rank's error so far, "" when none.
  std::string error_text() {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) return stop ? "the save was abandoned on rank " + std::to_string(group.rank()) : "";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    }
  }

  // The writer thread: writes this rank's file, then agrees on the outcome through the group's
  // store, so that no collective is needed and the commit runs in the background. Each rank
  // reports "done/<rank>" (empty, or its error) once its file is written and its staging verified;
  // rank 0 then waits for every report and commits, or not, and reports "outcome", which wait()
  // reads on every rank.
  void run_writer() {
    try {
      write_files();
    } catch (...) {
      fail(std::current_exception());
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return verified || stop; });
    }
    const comm::GroupStore store = group.store();
    try {
      store.set(key_prefix + "done/" + std::to_string(group.rank()), error_text());
      if (group.rank() != 0) return;
      store.set(key_prefix + "outcome", decide(store));
    } catch (...) {
      fail(std::current_exception());  // the store itself failed; wait() reports it
    }
  }

  // Rank 0: "ok" after committing, or why nothing was committed.
  std::string decide(const comm::GroupStore& store) {
    comm::StorePollOptions poll;
    poll.period = std::chrono::milliseconds(2);
    poll.deadline = std::chrono::steady_clock::now() + group.options().timeout;
    poll.pause = [&](std::chrono::milliseconds period) {
      std::this_thread::sleep_for(period);
      return stopped();
    };
    std::string failures;
    for (int r = 0; r < group.size(); ++r) {
      const std::string key = key_prefix + "done/" + std::to_string(r);
      if (!store.wait_for({key}, poll).empty()) {
        failures += "; rank " + std::to_string(r) +
                    (stopped() ? " had not finished writing when rank 0 gave up"
                               : " did not finish writing within the group timeout");
        continue;
      }
      const std::string report = store.get(key);
      if (!report.empty()) failures += "; rank " + std::to_string(r) + ": " + report;
    }
    if (!failures.empty()) return failures.substr(2);
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return commit_allowed || stop; });
      if (!commit_allowed) return "abandoned before its commit";
    }
    try {
      commit();
    } catch (const std::exception& e) {
      return std::string("rank 0, committing: ") + e.what();
    }
    return "ok";
  }
  bool stopped() {
    std::lock_guard<std::mutex> lock(mu);
    return stop;
  }

  // Waits for items[i] to be staged; false when the save stops instead.
  bool wait_ready(size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return items[i].ready || stop; });
    return items[i].ready;
  }
  void release(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    staged_bytes -= items[i].entry.end - items[i].entry.begin;
    if (options.stage_copies) detail::release_staging(std::move(items[i].staged));
    items[i].staged = at::Tensor();
    cv.notify_all();
  }
  // Waits for room for `bytes` in the staging budget; false when the save stops instead.
  bool reserve(size_t bytes) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return stop || staged_bytes == 0 || staged_bytes + bytes <= options.max_staging_bytes; });
    if (stop) return false;
    staged_bytes += bytes;
    return true;
  }
  void halt() {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    cv.notify_all();
  }

  void write_files() {
    const int rank = group.rank();
    nlohmann::json chunks = nlohmann::json::array();
    if (!items.empty()) {
      std::vector<detail::SafetensorsEntry> entries;
      for (const auto& item : items) entries.push_back(item.entry);
      const std::string header = detail::safetensors_header(entries, {{"format", detail::kFormat}});
      for (size_t i = 0; i < items.size(); ++i) items[i].entry = entries[i];
      const std::string file = rank_name(rank, ".safetensors");
      detail::FileWriter out((fs::path(tmp) / file).string());
      out.write(header.data(), header.size());
      for (size_t i = 0; i < items.size(); ++i) {
        if (!wait_ready(i)) return;
        detail::ChunkRecord chunk;
        chunk.offsets = items[i].offsets;
        chunk.sizes = items[i].entry.shape;
        chunk.file = file;
        chunk.byte_offset = out.position();
        chunk.nbytes = items[i].entry.end - items[i].entry.begin;
        const auto* bytes = static_cast<const char*>(items[i].staged.data_ptr());
        for (uint64_t at = 0; at < chunk.nbytes; at += options.checksum_block_bytes)
          chunk.checksums.push_back(
              detail::xxhash64(bytes + at, std::min<uint64_t>(options.checksum_block_bytes, chunk.nbytes - at)));
        out.write(bytes, chunk.nbytes);
        release(i);
        nlohmann::json record = detail::chunk_to_json(chunk);
        record["name"] = items[i].entry.name;
        chunks.push_back(std::move(record));
      }
      out.sync_and_close();
    }
    nlohmann::json index = {{"tensors", tensors}, {"chunks", chunks}, {"values", values}};
    detail::write_file_atomically((fs::path(tmp) / rank_name(rank, ".json")).string(), index.dump());
  }

  // Rank 0, after every rank wrote: metadata.json from the per-rank indexes, then the renames.
  void commit() {
    detail::Metadata m;
    m.world_size = group.size();
    m.checksum_block_bytes = options.checksum_block_bytes;
    for (int r = 0; r < group.size(); ++r) {
      const std::string path = (fs::path(tmp) / rank_name(r, ".json")).string();
      const nlohmann::json index = nlohmann::json::parse(detail::read_file(path));
      for (const auto& [name, info] : index.at("tensors").items()) {
        auto [it, fresh] = m.tensors.try_emplace(name);
        if (fresh) {
          it->second.dtype = info.at("dtype").get<std::string>();
          it->second.shape = info.at("shape").get<std::vector<int64_t>>();
        }
        HP_CHECK(it->second.dtype == info.at("dtype").get<std::string>() &&
                     it->second.shape == info.at("shape").get<std::vector<int64_t>>(),
                 "dcp.save: ranks disagree on the dtype or shape of '", name, "'");
      }
      for (const auto& chunk : index.at("chunks"))
        m.tensors.at(chunk.at("name").get<std::string>()).chunks.push_back(detail::chunk_from_json(chunk));
      add_missing(m.values, index.at("values"));
      fs::remove(path);
    }
    // Leftovers of an interrupted save into the same directory (files of ranks this save lacks).
    std::set<std::string> ours;
    for (const auto& [name, tensor] : m.tensors)
      for (const auto& chunk : tensor.chunks) ours.insert(chunk.file);
    for (const auto& entry : fs::directory_iterator(tmp))
      if (!ours.count(entry.path().filename().string())) fs::remove_all(entry.path());
    // Parsing what we are about to commit checks it exactly as a load will (coverage, no overlaps).
    const nlohmann::json metadata = detail::to_json(m);
    detail::metadata_from_json(metadata, "the metadata being saved for " + dir);
    detail::write_file_atomically((fs::path(tmp) / detail::kMetadataFile).string(), metadata.dump(1));
    detail::fsync_directory(tmp);

    const fs::path final_dir(dir), old_dir(dir + ".old");
    if (fs::exists(final_dir)) {
      fs::remove_all(old_dir);
      fs::rename(final_dir, old_dir);
    }
    fs::rename(tmp, final_dir);
    const std::string parent = fs::absolute(final_dir).parent_path().string();
    detail::fsync_directory(parent);
    fs::remove_all(old_dir);
    if (options.update_latest) {
      detail::write_file_atomically((fs::path(parent) / "latest").string(),
                                    fs::absolute(final_dir).filename().string() + "\n");
      detail::fsync_directory(parent);
    }
  }
};

AsyncSave save_async(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group,
                     SaveOptions options) {
  HP_CHECK(!dir.empty(), "dcp.save: empty directory name");
  HP_CHECK(options.checksum_block_bytes >= 8 && options.checksum_block_bytes % 8 == 0,
           "dcp.save: checksum_block_bytes must be a positive multiple of 8, got ", options.checksum_block_bytes);
  auto s = std::make_shared<AsyncSave::State>();
  s->dir = fs::path(dir).lexically_normal().string();
  if (s->dir.size() > 1 && s->dir.back() == '/') s->dir.pop_back();
  s->tmp = s->dir + ".tmp";
  s->group = group;
  s->options = options;
  s->values = state.values;
  // No barrier: every rank creates the directory (idempotent), and leftovers of an interrupted save
  // that this one does not overwrite are removed at the commit.
  fs::create_directories(s->tmp);

  for (const auto& [name, t] : state.tensors) HP_CHECK(t.defined(), "dcp.save: tensor '", name, "' is undefined");
  s->key_prefix = "hp_dcp/" + std::to_string(next_save_number(group)) + "/";
  const std::set<std::string> plain = plain_tensors_to_write(state, group, s->key_prefix);
  for (const auto& [name, t] : state.tensors) {
    s->tensors[name] = {{"dtype", detail::safetensors_dtype(t.scalar_type())}, {"shape", t.sizes().vec()}};
    auto piece = piece_to_write(t, plain.count(name) > 0);
    if (!piece || piece->first.numel() == 0) continue;
    WriteItem item;
    item.entry.name = name;
    item.entry.dtype = detail::safetensors_dtype(t.scalar_type());
    item.entry.shape = piece->first.sizes().vec();
    item.offsets = std::move(piece->second);
    item.source = piece->first;
    item.owner = t;
    item.versions = versions_of(item);
    s->items.push_back(std::move(item));
  }

  s->writer = std::thread([s] { s->run_writer(); });
  if (options.stage_copies && options.stage_in_background) {
    s->stager = std::thread([s] {
      try {
        s->stage_all();
      } catch (...) {
        s->fail(std::current_exception());
      }
    });
    return AsyncSave(std::move(s));
  }
  try {
    s->stage_all();
  } catch (...) {  // e.g. out of memory while copying: stop the writer before giving up
    s->halt();
    s->writer.join();
    throw;
  }
  s->mark_verified();  // copied before returning (or, for save(), the caller waits)
  return AsyncSave(std::move(s));
}

void AsyncSave::wait() {
  if (!state_) return;
  const std::shared_ptr<State> s = std::move(state_);
  s->finish_staging();
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->commit_allowed = true;
    s->cv.notify_all();
  }
  s->writer.join();  // on rank 0, also the commit
  const std::string own = s->error_text();
  std::string outcome;
  try {
    outcome = s->group.store().get(s->key_prefix + "outcome");
  } catch (const std::exception& e) {
    outcome = std::string("rank 0 never reported the outcome (") + e.what() + ")";
  }
  if (outcome == "ok") return;
  if (!own.empty()) HP_FAIL("dcp.save to ", s->dir, " failed: ", own, "; nothing was committed");
  HP_FAIL("dcp.save to ", s->dir, " failed: ", outcome, "; nothing was committed");
}

AsyncSave& AsyncSave::operator=(AsyncSave&& other) noexcept {
  if (this != &other) {
    abandon();
    state_ = std::move(other.state_);
  }
  return *this;
}

AsyncSave::~AsyncSave() { abandon(); }

void AsyncSave::wait_staged() {
  if (state_) state_->finish_staging();
}

void AsyncSave::abandon() noexcept {
  if (!state_) return;
  state_->halt();
  if (state_->stager.joinable()) state_->stager.join();
  if (state_->writer.joinable()) state_->writer.join();
  state_.reset();
}

void save(const StateDict& state, const std::string& dir, const comm::ProcessGroup& group, SaveOptions options) {
  options.stage_copies = false;  // the caller waits, so the tensors cannot change under the writer
  save_async(state, dir, group, options).wait();
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const fs::path pointer = fs::path(root) / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = detail::read_file(pointer.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  HP_CHECK(!name.empty() && name.find('/') == std::string::npos, "dcp: ", pointer.string(), " names '", name,
           "', not a checkpoint directory");
  const fs::path dir = fs::path(root) / name;
  if (fs::exists(dir / detail::kMetadataFile)) return dir.string();
  // Interrupted while replacing that checkpoint (after moving it aside, before the new one took its
  // place): the previous version is complete.
  const fs::path aside = dir.string() + ".old";
  if (fs::exists(aside / detail::kMetadataFile)) return aside.string();
  HP_FAIL("dcp: ", pointer.string(), " names ", name, ", but ", dir.string(),
          " holds no committed checkpoint (deleted, or damaged by a crash)");
}

}  // namespace hp::dcp
