#include "hp/dtensor/spec.h"

#include <sstream>

#include "hp/core/chunking.h"
#include "hp/core/error.h"

namespace hp {

DTensorSpec::DTensorSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> shape)
    : mesh_(std::move(mesh)), placements_(std::move(placements)), shape_(std::move(shape)) {
  HP_CHECK(static_cast<int64_t>(placements_.size()) == mesh_.ndim(), "DTensorSpec: ", placements_.size(),
           " placements ", to_string(placements_), " for a ", mesh_.ndim(), "-D mesh ", mesh_.str(),
           "; give one per mesh dim");
  for (Placement& p : placements_) {
    if (!p.is_shard()) continue;
    const int64_t d = p.dim();
    HP_CHECK(d >= -ndim() && d < ndim(), "DTensorSpec: ", p.str(), " is out of range for a tensor with ", ndim(),
             " dims");
    if (d < 0) p = Shard(d + ndim());
  }
  for (int64_t s : shape_) HP_CHECK(s >= 0, "DTensorSpec: negative size in shape");
}

int64_t length_at_mesh_dim(const std::vector<int64_t>& shape, const Placements& placements, const DeviceMesh& mesh,
                           const std::vector<int64_t>& coordinate, int64_t dim, int64_t mesh_dim) {
  int64_t length = shape[dim];
  for (int64_t i = 0; i < mesh_dim; ++i)
    if (placements[i].is_shard(dim)) length = chunk_sizes(length, mesh.size(i))[coordinate[i]];
  return length;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> DTensorSpec::local_shape_and_offset(
    const std::vector<int64_t>& coordinate) const {
  std::vector<int64_t> local = shape_, offset(shape_.size(), 0);
  for (int64_t i = 0; i < mesh_.ndim(); ++i) {
    if (!placements_[i].is_shard()) continue;
    const int64_t d = placements_[i].dim();
    offset[d] += chunk_offset(local[d], mesh_.size(i), coordinate[i]);
    local[d] = chunk_sizes(local[d], mesh_.size(i))[coordinate[i]];
  }
  return {local, offset};
}

std::vector<int64_t> DTensorSpec::local_shape() const {
  auto coordinate = mesh_.get_coordinate();
  HP_CHECK(coordinate, "DTensorSpec::local_shape: world rank ", mesh_.get_rank(), " is not in ", mesh_.str());
  return local_shape_and_offset(*coordinate).first;
}

std::string DTensorSpec::str() const {
  std::ostringstream out;
  out << "DTensorSpec(shape=[";
  for (size_t i = 0; i < shape_.size(); ++i) out << (i ? ", " : "") << shape_[i];
  out << "], " << to_string(placements_) << ", " << mesh_.str() << ")";
  return out.str();
}

size_t DTensorSpec::hash() const {
  size_t h = mesh_.hash();
  auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  for (const Placement& p : placements_) mix(p.hash());
  for (int64_t s : shape_) mix(std::hash<int64_t>()(s));
  return h;
}

}  // namespace hp
