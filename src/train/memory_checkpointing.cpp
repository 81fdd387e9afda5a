#include "train/memory_checkpointing.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/dtensor/local.h"
#include "train/replica_check.h"

namespace hp::train {

MemoryCheckpoints::MemoryCheckpoints() : contents_(std::make_unique<Contents>()) {}
MemoryCheckpoints::~MemoryCheckpoints() = default;

namespace detail {
namespace {

constexpr int64_t kAlign = 64;  // each tensor's bytes start aligned, so a typed view of them is too
constexpr int kTries = 3;       // sends of a copy that arrives damaged before the recovery fails
constexpr int kCopyTag = 1;     // in the ring: the sizes travel under tag 0, the copies under this

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

const char* bytes_of(const at::Tensor& packed) { return static_cast<const char*>(packed.data_ptr()); }

std::string megabytes(const at::Tensor& packed) {
  return hp::detail::str_cat(static_cast<double>(packed.numel()) / 1e6, " MB");
}

// A packed state's header, and where its tensors' bytes begin.
struct Layout {
  nlohmann::json header;
  int64_t data_start = 0;
};

Layout layout_of(const at::Tensor& packed) {
  const char* in = bytes_of(packed);
  int64_t length = 0;
  std::memcpy(&length, in, 8);
  HP_CHECK(length > 0 && 8 + length <= packed.numel(), "unpack_state: a packed state's header is damaged");
  return {nlohmann::json::parse(in + 8, in + 8 + length), aligned(8 + length)};
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// A copy of `packed` damaged where it must show: the sign and exponent byte of the middle element
// of each tensor (one of a rank's shards may hold only elements that its data never uses).
at::Tensor damaged(const at::Tensor& packed) {
  at::Tensor copy = packed.clone();
  const Layout layout = layout_of(packed);
  for (const auto& record : layout.header.at("tensors")) {
    const int64_t numel = numel_of(record.at("shape").get<std::vector<int64_t>>());
    if (numel == 0) continue;
    const int64_t element = c10::elementSize(static_cast<at::ScalarType>(record.at("dtype").get<int>()));
    const int64_t at = layout.data_start + record.at("offset").get<int64_t>() + numel / 2 * element;
    static_cast<uint8_t*>(copy.data_ptr())[at + element - 1] ^= 0x40;
  }
  return copy;
}

}  // namespace

at::Tensor pack_state(const dcp::StateDict& state) {
  nlohmann::json header{{"values", state.values}, {"tensors", nlohmann::json::array()}};
  std::vector<at::Tensor> pieces;
  int64_t offset = 0;
  for (const auto& [name, tensor] : state.tensors) {
    at::Tensor piece = hp::local_tensor(tensor).detach().to(at::kCPU).contiguous();
    header["tensors"].push_back({{"name", name},
                                 {"dtype", static_cast<int>(piece.scalar_type())},
                                 {"shape", piece.sizes().vec()},
                                 {"offset", offset}});
    offset = aligned(offset + static_cast<int64_t>(piece.nbytes()));
    pieces.push_back(std::move(piece));
  }
  const std::string text = header.dump();
  const int64_t data_start = aligned(8 + static_cast<int64_t>(text.size()));
  at::Tensor packed = at::zeros({data_start + offset}, at::kByte);
  char* out = static_cast<char*>(packed.data_ptr());
  const int64_t length = static_cast<int64_t>(text.size());
  std::memcpy(out, &length, 8);
  std::memcpy(out + 8, text.data(), text.size());
  for (size_t i = 0; i < pieces.size(); ++i)
    std::memcpy(out + data_start + header["tensors"][i]["offset"].get<int64_t>(), pieces[i].data_ptr(),
                pieces[i].nbytes());
  return packed;
}

void unpack_state(const at::Tensor& packed, dcp::StateDict& state) {
  HP_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() >= 8,
           "unpack_state: not a packed state");
  const char* in = bytes_of(packed);
  const Layout layout = layout_of(packed);
  const auto& records = layout.header.at("tensors");
  HP_CHECK(records.size() == state.tensors.size(), "unpack_state: the packed state has ", records.size(),
           " tensors, this rank's state ", state.tensors.size(), " (another layout or config)");
  at::NoGradGuard no_grad;
  for (const auto& record : records) {
    const std::string name = record.at("name").get<std::string>();
    const auto live = state.tensors.find(name);
    HP_CHECK(live != state.tensors.end(), "unpack_state: this rank's state has no tensor ", name);
    const at::Tensor& local = hp::local_tensor(live->second);
    const auto dtype = static_cast<at::ScalarType>(record.at("dtype").get<int>());
    const std::vector<int64_t> shape = record.at("shape").get<std::vector<int64_t>>();
    HP_CHECK(local.scalar_type() == dtype && local.sizes().vec() == shape, "unpack_state: ", name, " is packed as ",
             c10::toString(dtype), " ", c10::IntArrayRef(shape), " but this rank holds ", local.scalar_type(), " ",
             local.sizes());
    const int64_t offset = layout.data_start + record.at("offset").get<int64_t>();
    const int64_t bytes = numel_of(shape) * static_cast<int64_t>(c10::elementSize(dtype));
    HP_CHECK(offset + bytes <= packed.numel(), "unpack_state: ", name, " lies beyond the packed state's end");
    local.detach().copy_(at::from_blob(const_cast<char*>(in) + offset, shape, at::TensorOptions().dtype(dtype)));
  }
  state.values = layout.header.at("values");
}

uint64_t packed_checksum(const at::Tensor& packed) { return hash_bytes(packed.data_ptr(), packed.nbytes()); }

MemoryCheckpointing::MemoryCheckpointing(MemoryCheckpoints& memory, const comm::ProcessGroup& world)
    : memory_(memory.contents()), world_(world) {
  const int size = world.size(), rank = world.rank();
  HP_CHECK(size >= 2, "in-memory checkpoints need at least 2 ranks (each rank's copy is kept by another)");
  std::vector<int> ring(size);
  for (int i = 0; i < size; ++i) ring[i] = (i + 1) % size;
  ring_ = world.new_group(ring, "in-memory checkpoints");
  // World rank w is ring rank (w - 1) mod size.
  next_ = rank, previous_ = (rank - 2 + 2 * size) % size;
}

void MemoryCheckpointing::keep(int64_t step, at::Tensor packed) {
  finish_exchange();
  memory_.own[step] = packed;
  while (memory_.own.size() > 2) memory_.own.erase(memory_.own.begin());
  const at::Tensor sizes_out =
      at::tensor({step, packed.numel(), static_cast<int64_t>(packed_checksum(packed))}, at::kLong);
  const at::Tensor sizes_in = at::empty({3}, at::kLong);
  for (comm::Work& w :
       ring_.batch_isend_irecv({comm::P2POp::send(sizes_out, next_), comm::P2POp::recv(sizes_in, previous_)}))
    w.wait();
  MemoryCheckpoints::Contents::Exchange exchange;
  exchange.step = sizes_in[0].item<int64_t>();
  exchange.checksum = static_cast<uint64_t>(sizes_in[2].item<int64_t>());
  exchange.incoming = at::empty({sizes_in[1].item<int64_t>()}, at::kByte);
  exchange.works = ring_.batch_isend_irecv(
      {comm::P2POp::send(packed, next_, kCopyTag), comm::P2POp::recv(exchange.incoming, previous_, kCopyTag)});
  memory_.exchange = std::move(exchange);
}

void MemoryCheckpointing::start_over() {
  if (memory_.exchange)
    for (comm::Work& w : memory_.exchange->works) w.abort();  // its buffers stay with its group
  memory_.exchange.reset();
  memory_.own.clear();
  memory_.buddy.reset();
}

void MemoryCheckpointing::finish_exchange() {
  if (!memory_.exchange) return;
  MemoryCheckpoints::Contents::Exchange exchange = std::move(*memory_.exchange);
  memory_.exchange.reset();
  for (comm::Work& w : exchange.works) w.wait();
  if (packed_checksum(exchange.incoming) != exchange.checksum) {
    log::warn("the in-memory checkpoint of step ", exchange.step, " that world rank ", ring_.ranks()[previous_],
              " sent arrived damaged (its checksum differs); keeping its copy of step ",
              memory_.buddy ? std::to_string(memory_.buddy->step) : std::string("none"));
    return;
  }
  memory_.buddy = MemoryCheckpoints::Contents::Copy{exchange.step, std::move(exchange.incoming)};
}

MemoryCheckpointing::Recovered MemoryCheckpointing::recover(const std::function<bool(int64_t)>& damages_copy) {
  // An exchange in flight in the world that is gone: its copy counts when it arrives whole (its
  // sender posted it right after the sizes, so it comes, or the receive fails when the sender's
  // process is gone). The send, to a rank that may be dead, is given up (its buffer stays with its
  // group).
  if (memory_.exchange) {
    std::vector<comm::Work>& works = memory_.exchange->works;
    for (size_t i = 0; i + 1 < works.size(); ++i) works[i].abort();
    works.erase(works.begin(), works.end() - 1);
    try {
      finish_exchange();
    } catch (const std::exception&) {  // the sender died: its previous copy stays
      memory_.exchange.reset();
    }
  }
  const int size = world_.size(), rank = world_.rank();
  // What each rank holds: its own steps (newest first, -1 for none) and its buddy's copy's step.
  const auto& own = memory_.own;
  const int64_t mine[3] = {own.empty() ? -1 : own.rbegin()->first, own.size() < 2 ? -1 : own.begin()->first,
                           memory_.buddy ? memory_.buddy->step : -1};
  const at::Tensor all = world_.all_gather(at::tensor({mine[0], mine[1], mine[2]}, at::kLong)).reshape({size, 3});
  const auto held = [&](int r, int column) { return all[r][column].item<int64_t>(); };
  const auto restarted = [&](int r) { return held(r, 0) < 0; };
  const auto buddy_of = [&](int r) { return (r + 1) % size; };
  const auto can_have = [&](int r, int64_t step) {
    if (!restarted(r)) return held(r, 0) == step || held(r, 1) == step;
    return !restarted(buddy_of(r)) && held(buddy_of(r), 2) == step;
  };
  std::optional<int64_t> step;
  for (int r = 0; r < size; ++r)
    for (int column = 0; column < 3; ++column) {
      const int64_t s = held(r, column);
      if (s < 0 || (step && s <= *step)) continue;
      bool everyone = true;
      for (int q = 0; q < size && everyone; ++q) everyone = can_have(q, s);
      if (everyone) step = s;
    }
  if (!step) {
    std::string what;
    for (int r = 0; r < size; ++r)
      what += hp::detail::str_cat(
          r ? "; " : "", "world rank ", r,
          restarted(r) ? std::string(" nothing (started again)")
                       : hp::detail::str_cat(" steps ", held(r, 0),
                                             held(r, 1) >= 0 ? ", " + std::to_string(held(r, 1)) : std::string()),
          held(r, 2) >= 0 ? ", a copy of world rank " + std::to_string((r - 1 + size) % size) + "'s step " +
                                std::to_string(held(r, 2))
                          : std::string());
    HP_FAIL(
        "process-level recovery: no step can be had back by every rank (a rank started again needs the next "
        "world rank, its buddy, alive with a copy of a step every other rank holds): ",
        what, ". Restart the job from its last checkpoint on disk");
  }
  Recovered recovered{*step, at::Tensor()};
  if (!restarted(rank)) recovered.packed = own.at(*step);
  // Each restarted rank takes its copy from its buddy; a rank is in at most one such pair.
  for (int r = 0; r < size; ++r) {
    if (!restarted(r) || (rank != r && rank != buddy_of(r))) continue;
    const int buddy = buddy_of(r);
    const bool damage_first_copy = rank == buddy && damages_copy && damages_copy(*step);
    for (int attempt = 1;; ++attempt) {
      at::Tensor ok = at::zeros({1}, at::kLong);
      if (rank == buddy) {
        const at::Tensor& copy = memory_.buddy->packed;
        world_.send(at::tensor({copy.numel(), static_cast<int64_t>(packed_checksum(copy))}, at::kLong), r);
        at::Tensor sent = copy;
        if (damage_first_copy && attempt == 1) {
          sent = damaged(copy);
          log::warn("injected fault: damaging the copy of world rank ", r, "'s step ", *step, " sent to it");
        }
        world_.send(sent, r);
        world_.recv(ok, r);
      } else {
        const at::Tensor sizes = world_.recv(at::empty({2}, at::kLong), buddy);
        at::Tensor copy = at::empty({sizes[0].item<int64_t>()}, at::kByte);
        world_.recv(copy, buddy);
        const bool whole = packed_checksum(copy) == static_cast<uint64_t>(sizes[1].item<int64_t>());
        ok.fill_(whole ? 1 : 0);
        world_.send(ok, buddy);
        if (whole) {
          recovered.packed = copy;
          log::info("took back step ", *step, " from the copy that world rank ", buddy, ", its buddy, kept (",
                    megabytes(copy), attempt > 1 ? hp::detail::str_cat(", send ", attempt) : std::string(), ")");
        } else {
          log::warn("the copy of step ", *step, " from world rank ", buddy, " arrived damaged (its checksum differs)",
                    attempt < kTries ? "; asking for it again" : "");
        }
      }
      if (ok.item<int64_t>() == 1) break;
      HP_CHECK(attempt < kTries, "process-level recovery: the copy of world rank ", r, "'s step ", *step,
               " arrived damaged ", kTries, " times from world rank ", buddy);
    }
  }
  // Nothing newer than the step goes on: the run continues from it.
  memory_.own.clear();
  if (memory_.buddy && memory_.buddy->step > *step) memory_.buddy.reset();
  return recovered;
}

}  // namespace detail
}  // namespace hp::train
