// DeviceMesh: rank bookkeeping (coordinates, slicing, flattening) and per-dim group creation.
#include "hp/mesh/device_mesh.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>

#include "hp/comm/init.h"
#include "hp/core/error.h"
#include "hp/core/recompute.h"

namespace hp {
namespace detail {

// What every mesh sliced or flattened from one init_device_mesh call shares.
struct MeshRoot {
  comm::ProcessGroup world;
  std::string device_type;
  c10::Device device{c10::kCPU};
  std::vector<std::string> dim_names;  // of the mesh everything was sliced from
  std::mutex mu;
  std::map<std::string, std::vector<std::string>> flattened;  // name -> the dims it merges
  // Distributed RNG (see hp/dtensor/random.h): every random op on a DTensor of this mesh takes
  // the next stream; all ranks run the same ops, so their streams agree.
  uint64_t rng_seed = 0;
  uint64_t rng_next_stream = 0;
};

}  // namespace detail

namespace {

c10::Device rank_device(const std::string& device_type) {
  HP_CHECK(device_type == "cpu" || device_type == "cuda", "DeviceMesh: device type '", device_type,
           "' is not supported; use \"cpu\" or \"cuda\"");
  if (device_type == "cpu") return c10::kCPU;
  const int gpus = static_cast<int>(torch::cuda::device_count());
  HP_CHECK(gpus > 0, "DeviceMesh: device type \"cuda\", but this process sees no CUDA device (LibTorch ",
           torch::cuda::is_available() ? "with" : "without",
           " CUDA support; check CUDA_VISIBLE_DEVICES and the build)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(comm::read_launch_env().local_rank % gpus));
}

template <typename T>
std::string join(const std::vector<T>& items, const char* sep = ", ") {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? sep : "") << items[i];
  return out.str();
}

int64_t product(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

// World ranks of the sub-grid over `dims` through `coordinate` (row-major over `dims`).
std::vector<int> slice_ranks(const std::vector<int>& ranks, const std::vector<int64_t>& shape,
                             const std::vector<int64_t>& coordinate, const std::vector<int64_t>& dims) {
  const std::vector<int64_t> strides = strides_of(shape);
  int64_t base = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    if (std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) == dims.end()) base += coordinate[d] * strides[d];
  int64_t count = 1;
  for (int64_t d : dims) count *= shape[d];
  std::vector<int> out;
  std::vector<int64_t> index(dims.size(), 0);
  for (int64_t n = 0; n < count; ++n) {
    int64_t offset = base;
    for (size_t k = 0; k < dims.size(); ++k) offset += index[k] * strides[dims[k]];
    out.push_back(ranks[offset]);
    for (int64_t k = static_cast<int64_t>(dims.size()) - 1; k >= 0; --k) {  // odometer increment
      if (++index[k] < shape[dims[k]]) break;
      index[k] = 0;
    }
  }
  return out;
}

// Row-major coordinate of world rank `me` in the grid, or nullopt when it is not a member.
std::optional<std::vector<int64_t>> coordinate_of(const std::vector<int>& ranks, const std::vector<int64_t>& shape,
                                                  int me) {
  auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) return std::nullopt;
  const std::vector<int64_t> strides = strides_of(shape);
  int64_t offset = it - ranks.begin();
  std::vector<int64_t> coordinate(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    coordinate[d] = offset / strides[d];
    offset %= strides[d];
  }
  return coordinate;
}

}  // namespace

DeviceMesh::DeviceMesh(const comm::ProcessGroup& world, std::string device_type, std::vector<int64_t> shape,
                       std::vector<int> ranks, std::vector<std::string> dim_names)
    : root_(std::make_shared<detail::MeshRoot>()),
      shape_(std::move(shape)),
      ranks_(std::move(ranks)),
      names_(std::move(dim_names)) {
  root_->world = world;
  root_->device_type = std::move(device_type);
  root_->device = rank_device(root_->device_type);
  HP_CHECK(!shape_.empty(), "DeviceMesh: the mesh shape needs at least one dim");
  HP_CHECK(std::all_of(shape_.begin(), shape_.end(), [](int64_t s) { return s > 0; }),
           "DeviceMesh: every mesh dim needs a positive size, got shape (", join(shape_), ")");
  HP_CHECK(product(shape_) == static_cast<int64_t>(ranks_.size()), "DeviceMesh: shape (", join(shape_), ") holds ",
           product(shape_), " ranks but ", ranks_.size(), " ranks were given");
  const int world_size = world.size();
  std::set<int> seen;
  for (int r : ranks_) {
    HP_CHECK(r >= 0 && r < world_size, "DeviceMesh: rank ", r, " is not in the world (ranks 0..", world_size - 1, ")");
    HP_CHECK(seen.insert(r).second, "DeviceMesh: rank ", r, " appears twice in the mesh [", join(ranks_), "]");
  }
  if (names_.empty())
    for (size_t d = 0; d < shape_.size(); ++d) names_.push_back("dim" + std::to_string(d));
  HP_CHECK(names_.size() == shape_.size(), "DeviceMesh: ", names_.size(), " dim names (", join(names_), ") for a ",
           shape_.size(), "-D mesh");
  HP_CHECK(std::set<std::string>(names_.begin(), names_.end()).size() == names_.size(),
           "DeviceMesh: dim names must be unique, got (", join(names_), ")");
  root_->dim_names = names_;

  coordinate_ = coordinate_of(ranks_, shape_, get_rank());
  if (!coordinate_) return;  // not a member: no groups
  // In dim order on every member, so group creation cannot deadlock (see the header).
  for (int64_t d = 0; d < ndim(); ++d)
    groups_.push_back(world.new_group(slice_ranks(ranks_, shape_, *coordinate_, {d}), names_[d]));
}

DeviceMesh::DeviceMesh(const comm::ProcessGroup& world, std::string device_type, const at::Tensor& mesh,
                       std::vector<std::string> dim_names)
    : DeviceMesh(
          world, std::move(device_type), std::vector<int64_t>(mesh.sizes().begin(), mesh.sizes().end()),
          [&] {
            HP_CHECK(!mesh.is_floating_point() && !mesh.is_complex() && mesh.scalar_type() != at::kBool,
                     "DeviceMesh: the rank tensor must have an integer dtype, got ", mesh.scalar_type());
            at::Tensor flat = mesh.to(at::kLong).contiguous().reshape({-1});
            std::vector<int> ranks(flat.numel());
            for (int64_t i = 0; i < flat.numel(); ++i) ranks[i] = static_cast<int>(flat[i].item<int64_t>());
            return ranks;
          }(),
          std::move(dim_names)) {}

DeviceMesh::DeviceMesh(std::shared_ptr<detail::MeshRoot> root, std::vector<int64_t> shape, std::vector<int> ranks,
                       std::vector<std::string> names, std::vector<comm::ProcessGroup> groups)
    : root_(std::move(root)),
      shape_(std::move(shape)),
      ranks_(std::move(ranks)),
      names_(std::move(names)),
      groups_(std::move(groups)),
      coordinate_(coordinate_of(ranks_, shape_, get_rank())) {}

const std::string& DeviceMesh::device_type() const { return root_->device_type; }
c10::Device DeviceMesh::device() const { return root_->device; }

int DeviceMesh::get_rank() const { return root_->world.ranks()[root_->world.rank()]; }

const comm::ProcessGroup& DeviceMesh::world() const { return root_->world; }

int64_t DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  if (it != names_.end()) return it - names_.begin();
  std::vector<std::string> flattened;
  {
    std::lock_guard<std::mutex> lock(root_->mu);
    for (const auto& [flat, _] : root_->flattened) flattened.push_back(flat);
  }
  throw Error("DeviceMesh: no mesh dim named '" + name + "'; this mesh has (" + join(names_) + ")" +
              (flattened.empty() ? std::string() : "; flattened dims: (" + join(flattened) + ")"));
}

int64_t DeviceMesh::checked_dim(const char* what, int64_t dim) const {
  HP_CHECK(dim >= -ndim() && dim < ndim(), what, ": mesh dim ", dim, " is out of range for a ", ndim(), "-D mesh (",
           join(names_), ")");
  return dim < 0 ? dim + ndim() : dim;
}

const std::vector<int64_t>& DeviceMesh::coordinate_or_throw(const char* what) const {
  HP_CHECK(coordinate_, what, ": world rank ", get_rank(), " is not in ", str());
  return *coordinate_;
}

int64_t DeviceMesh::size(int64_t dim) const { return shape_[checked_dim("DeviceMesh::size", dim)]; }
int64_t DeviceMesh::size(const std::string& dim) const { return shape_[dim_index(dim)]; }

std::optional<std::vector<int64_t>> DeviceMesh::get_coordinate() const { return coordinate_; }

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  return coordinate_or_throw("DeviceMesh::get_local_rank")[checked_dim("DeviceMesh::get_local_rank", dim)];
}
int64_t DeviceMesh::get_local_rank(const std::string& dim) const { return get_local_rank(dim_index(dim)); }

const comm::ProcessGroup& DeviceMesh::get_group(int64_t dim) const {
  coordinate_or_throw("DeviceMesh::get_group");
  return groups_[checked_dim("DeviceMesh::get_group", dim)];
}
const comm::ProcessGroup& DeviceMesh::get_group(const std::string& dim) const { return get_group(dim_index(dim)); }

DeviceMesh DeviceMesh::operator[](const std::string& dim) const { return (*this)[std::vector<std::string>{dim}]; }

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& dims) const {
  HP_CHECK(!dims.empty(), "DeviceMesh::operator[]: name at least one mesh dim");
  const auto& coordinate = coordinate_or_throw("DeviceMesh::operator[]");

  // A flattened dim not of this mesh stands for the dims it merges (a flattening of flattenings
  // for theirs, down to this mesh's): the slice is taken over those (in mesh order, each once),
  // then each flattening's run of dims becomes one dim, row-major, whose group is the flattening's.
  // mesh[{"dp_replicate", "dp_shard_cp"}] is HSDP's 2-D mesh.
  std::map<std::string, std::vector<std::string>> flattenings;
  {
    std::lock_guard<std::mutex> lock(root_->mu);
    flattenings = root_->flattened;
  }
  const auto is_flattened = [&](const std::string& d) {
    return flattenings.count(d) && !std::count(names_.begin(), names_.end(), d);
  };
  const std::function<void(const std::string&, std::vector<std::string>&)> expand = [&](const std::string& d,
                                                                                        std::vector<std::string>& out) {
    if (!is_flattened(d)) return out.push_back(d);
    for (const std::string& part : flattenings.at(d)) expand(part, out);
  };
  if (dims.size() == 1 && is_flattened(dims[0])) return (*this)[flattenings.at(dims[0])].flatten(dims[0]);
  std::vector<std::string> expanded;
  std::vector<size_t> merged;  // how many of `expanded` each of `dims` stands for; 0: itself
  for (const std::string& d : dims) {
    const size_t before = expanded.size();
    expand(d, expanded);
    merged.push_back(is_flattened(d) ? expanded.size() - before : 0);
  }
  const bool any_flattened = std::any_of(merged.begin(), merged.end(), [](size_t n) { return n > 0; });
  const std::string standing_for = any_flattened ? " (standing for (" + join(expanded) + "))" : "";
  std::vector<int64_t> indices;
  for (const std::string& d : expanded) indices.push_back(dim_index(d));
  HP_CHECK(std::set<int64_t>(indices.begin(), indices.end()).size() == indices.size(),
           "DeviceMesh::operator[]: mesh dim named twice in [", join(dims), "]", standing_for);
  HP_CHECK(std::is_sorted(indices.begin(), indices.end()), "DeviceMesh::operator[]: name mesh dims in mesh order (",
           join(names_), "), got [", join(dims), "]", standing_for);
  std::vector<int64_t> shape;
  std::vector<comm::ProcessGroup> groups;
  size_t next = 0;  // into indices
  for (size_t i = 0; i < dims.size(); ++i) {
    if (merged[i] == 0) {
      shape.push_back(shape_[indices[next]]);
      groups.push_back(groups_[indices[next]]);
      ++next;
      continue;
    }
    const DeviceMesh flat = (*this)[std::vector<std::string>{dims[i]}];  // the flattening itself
    shape.push_back(flat.size());
    groups.push_back(flat.get_group(0));
    next += merged[i];
  }
  return DeviceMesh(root_, std::move(shape), slice_ranks(ranks_, shape_, coordinate, indices), dims, std::move(groups));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  coordinate_or_throw("DeviceMesh::flatten");
  const std::string flat_name = name.empty() ? join(names_, "_") : name;
  if (ndim() == 1 && names_[0] == flat_name) return *this;
  const auto& root_names = root_->dim_names;
  HP_CHECK(std::find(root_names.begin(), root_names.end(), flat_name) == root_names.end(),
           "DeviceMesh::flatten: the name '", flat_name, "' is already a mesh dim of (", join(root_names), ")");
  {
    std::lock_guard<std::mutex> lock(root_->mu);
    auto it = root_->flattened.find(flat_name);
    HP_CHECK(it == root_->flattened.end() || it->second == names_, "DeviceMesh::flatten: the name '", flat_name,
             "' already names a flattening of (", it == root_->flattened.end() ? "" : join(it->second), ")");
    root_->flattened[flat_name] = names_;
  }
  comm::ProcessGroup group = root_->world.new_group(ranks_, flat_name);
  return DeviceMesh(root_, {size()}, ranks_, {flat_name}, {group});
}

void DeviceMesh::manual_seed(uint64_t seed) const {
  std::lock_guard<std::mutex> lock(root_->mu);
  root_->rng_seed = seed;
  root_->rng_next_stream = 0;
}

std::pair<uint64_t, uint64_t> DeviceMesh::claim_random_stream() const {
  // A recomputation (activation checkpointing) gets the first pass's stream again.
  return replayed<std::pair<uint64_t, uint64_t>>([&] {
    std::lock_guard<std::mutex> lock(root_->mu);
    return std::pair<uint64_t, uint64_t>{root_->rng_seed, root_->rng_next_stream++};
  });
}

std::pair<uint64_t, uint64_t> DeviceMesh::random_state() const {
  std::lock_guard<std::mutex> lock(root_->mu);
  return {root_->rng_seed, root_->rng_next_stream};
}

void DeviceMesh::set_random_state(uint64_t seed, uint64_t next_stream) const {
  std::lock_guard<std::mutex> lock(root_->mu);
  root_->rng_seed = seed;
  root_->rng_next_stream = next_stream;
}

std::string DeviceMesh::str() const {
  std::ostringstream out;
  out << "DeviceMesh(" << root_->device_type << ", (";
  for (size_t d = 0; d < shape_.size(); ++d) out << (d ? ", " : "") << names_[d] << "=" << shape_[d];
  out << "), ranks=[" << join(ranks_) << "])";
  return out.str();
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  return root_->device_type == other.root_->device_type && shape_ == other.shape_ && ranks_ == other.ranks_ &&
         names_ == other.names_;
}

size_t DeviceMesh::hash() const {
  size_t h = std::hash<std::string>()(root_->device_type);
  auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  for (int64_t s : shape_) mix(std::hash<int64_t>()(s));
  for (int r : ranks_) mix(std::hash<int>()(r));
  for (const auto& n : names_) mix(std::hash<std::string>()(n));
  return h;
}

DeviceMesh init_device_mesh(const comm::ProcessGroup& world, const std::string& device_type, std::vector<int64_t> shape,
                            std::vector<std::string> dim_names) {
  HP_CHECK(!shape.empty(), "init_device_mesh: the mesh shape needs at least one dim");
  const int64_t count = product(shape);
  HP_CHECK(count == world.size(), "init_device_mesh: mesh shape (", join(shape), ") has ", count,
           " ranks but the world group has ", world.size());
  HP_CHECK(device_type == "cpu" || device_type == "cuda", "init_device_mesh: device type '", device_type,
           "' is not supported; use \"cpu\" or \"cuda\"");
  std::vector<int> ranks(count);
  std::iota(ranks.begin(), ranks.end(), 0);
  return DeviceMesh(world, device_type, std::move(shape), std::move(ranks), std::move(dim_names));
}

}  // namespace hp
