#include "hp/data/text_data.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "hp/core/error.h"

namespace hp::data {
namespace fs = std::filesystem;
namespace {

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  HP_CHECK(in, "data: cannot read ", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_all(const fs::path& path, const char* data, size_t bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    HP_CHECK(out, "data: cannot write ", tmp.string());
    out.write(data, static_cast<std::streamsize>(bytes));
    HP_CHECK(out.good(), "data: writing ", tmp.string(), " failed");
  }
  fs::rename(tmp, path);  // a reader never sees half a file
}

bool looks_binary(const std::string& text) { return text.substr(0, 4096).find('\0') != std::string::npos; }

// Every regular file under the sources, in a fixed order (sources as given, directories sorted).
std::vector<fs::path> source_files(const std::vector<std::string>& sources) {
  std::vector<fs::path> files;
  for (const auto& source : sources) {
    HP_CHECK(fs::exists(source), "data: source '", source, "' does not exist");
    if (fs::is_regular_file(source)) {
      files.emplace_back(source);
      continue;
    }
    std::vector<fs::path> found;
    for (const auto& entry : fs::recursive_directory_iterator(source, fs::directory_options::follow_directory_symlink))
      if (entry.is_regular_file() && !entry.is_symlink()) found.push_back(entry.path());
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

double unigram_entropy(const std::string& text) {
  std::array<int64_t, 256> counts{};
  for (unsigned char c : text) ++counts[c];
  double h = 0.0;
  for (int64_t n : counts)
    if (n > 0) {
      const double p = static_cast<double>(n) / static_cast<double>(text.size());
      h -= p * std::log(p);
    }
  return h;
}

// SplitMix64: a seeded, counter-based mix, so window starts need no generator state.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

at::Tensor ByteTokenizer::encode(const std::string& text) const {
  at::Tensor out = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string ByteTokenizer::decode(const at::Tensor& tokens) const {
  const at::Tensor t = tokens.to(at::kLong).contiguous();
  std::string text(static_cast<size_t>(t.numel()), '\0');
  for (int64_t i = 0; i < t.numel(); ++i) text[i] = static_cast<char>(t.data_ptr<int64_t>()[i] & 0xff);
  return text;
}

namespace {

nlohmann::json corpus_key(const std::vector<std::string>& sources, double eval_fraction) {
  return {{"sources", sources}, {"eval_fraction", eval_fraction}, {"version", 1}};
}

}  // namespace

std::optional<CorpusInfo> prepared_corpus(const std::vector<std::string>& sources, const std::string& out_dir,
                                          double eval_fraction) {
  const fs::path dir(out_dir), info_path = dir / "corpus.json";
  CorpusInfo info;
  info.train_path = (dir / "train.bin").string();
  info.eval_path = (dir / "eval.bin").string();
  if (!fs::exists(info_path)) return std::nullopt;
  const auto saved = nlohmann::json::parse(read_all(info_path), nullptr, /*allow_exceptions=*/false);
  if (saved.is_discarded() || saved.value("key", nlohmann::json()) != corpus_key(sources, eval_fraction) ||
      !fs::exists(info.train_path) || !fs::exists(info.eval_path))
    return std::nullopt;
  info.files = saved.at("files").get<int64_t>();
  info.train_tokens = saved.at("train_tokens").get<int64_t>();
  info.eval_tokens = saved.at("eval_tokens").get<int64_t>();
  info.unigram_entropy_nats = saved.at("unigram_entropy_nats").get<double>();
  return info;
}

CorpusInfo prepare_corpus(const std::vector<std::string>& sources, const std::string& out_dir, double eval_fraction) {
  HP_CHECK(!sources.empty(), "data: no sources given");
  HP_CHECK(eval_fraction > 0.0 && eval_fraction < 0.5, "data.eval_fraction must be in (0, 0.5), got ", eval_fraction);
  if (std::optional<CorpusInfo> prepared = prepared_corpus(sources, out_dir, eval_fraction)) return *prepared;
  const fs::path dir(out_dir), info_path = dir / "corpus.json";
  const nlohmann::json key = corpus_key(sources, eval_fraction);
  CorpusInfo info;
  info.train_path = (dir / "train.bin").string();
  info.eval_path = (dir / "eval.bin").string();
  std::string text;
  for (const auto& file : source_files(sources)) {
    std::string content = read_all(file);
    if (content.empty() || looks_binary(content)) continue;
    text += content;
    ++info.files;
  }
  HP_CHECK(text.size() >= 4096, "data: the sources hold only ", text.size(), " bytes of text (", info.files,
           " files); need at least 4096");
  const size_t eval_bytes = static_cast<size_t>(static_cast<double>(text.size()) * eval_fraction);
  const size_t train_bytes = text.size() - eval_bytes;
  fs::create_directories(dir);
  write_all(info.train_path, text.data(), train_bytes);
  write_all(info.eval_path, text.data() + train_bytes, eval_bytes);
  info.train_tokens = static_cast<int64_t>(train_bytes);
  info.eval_tokens = static_cast<int64_t>(eval_bytes);
  info.unigram_entropy_nats = unigram_entropy(text.substr(0, train_bytes));
  const nlohmann::json saved = {{"key", key},
                                {"files", info.files},
                                {"train_tokens", info.train_tokens},
                                {"eval_tokens", info.eval_tokens},
                                {"unigram_entropy_nats", info.unigram_entropy_nats}};
  const std::string dumped = saved.dump(1);
  write_all(info_path, dumped.data(), dumped.size());
  return info;
}

at::Tensor load_tokens(const std::string& path) {
  const std::string bytes = read_all(path);
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<char*>(out.data_ptr<uint8_t>()));
  return out;
}

TokenSampler::TokenSampler(at::Tensor tokens, int64_t seq_len, uint64_t seed)
    : tokens_(std::move(tokens)), seq_len_(seq_len), seed_(seed) {
  HP_CHECK(seq_len_ > 0, "data: seq_len must be positive");
  HP_CHECK(tokens_.numel() > seq_len_ + 1, "data: ", tokens_.numel(), " tokens are too few for windows of ",
           seq_len_ + 1);
}

int64_t TokenSampler::windows() const { return tokens_.numel() - seq_len_; }

std::pair<at::Tensor, at::Tensor> TokenSampler::gather(const std::vector<int64_t>& starts) const {
  const int64_t n = static_cast<int64_t>(starts.size());
  at::Tensor windows = at::empty({n, seq_len_ + 1}, at::kLong);
  const uint8_t* src = tokens_.data_ptr<uint8_t>();
  int64_t* dst = windows.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i <= seq_len_; ++i) dst[r * (seq_len_ + 1) + i] = src[starts[r] + i];
  return {windows.narrow(1, 0, seq_len_).contiguous(), windows.narrow(1, 1, seq_len_).contiguous()};
}

std::pair<at::Tensor, at::Tensor> TokenSampler::train_batch(int64_t step, int64_t global_batch, int64_t first,
                                                            int64_t count) const {
  HP_CHECK(first >= 0 && count >= 0 && first + count <= global_batch, "data: rows [", first, ", ", first + count,
           ") outside a batch of ", global_batch);
  std::vector<int64_t> starts;
  for (int64_t r = first; r < first + count; ++r) {
    const uint64_t sample =
        static_cast<uint64_t>(step) * static_cast<uint64_t>(global_batch) + static_cast<uint64_t>(r);
    starts.push_back(static_cast<int64_t>(mix(mix(seed_) ^ sample) % static_cast<uint64_t>(windows())));
  }
  return gather(starts);
}

std::pair<at::Tensor, at::Tensor> TokenSampler::eval_batch(int64_t index, int64_t global_batch, int64_t first,
                                                           int64_t count) const {
  std::vector<int64_t> starts;
  const int64_t slots = std::max<int64_t>(1, windows() / seq_len_);
  for (int64_t r = first; r < first + count; ++r) starts.push_back(((index * global_batch + r) % slots) * seq_len_);
  return gather(starts);
}

}  // namespace hp::data
