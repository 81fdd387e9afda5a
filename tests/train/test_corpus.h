// A small deterministic corpus for training tests, written to disk so that no installed data is needed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace hp::train {

// A deterministic English-like corpus, so the test needs no installed data.
inline std::string write_corpus(const std::filesystem::path& dir) {
  const char* words[] = {"the", "cat", "sat",   "on",   "a",   "mat",   "and",   "dog",  "ran",   "to",
                         "big", "red", "house", "with", "one", "small", "green", "tree", "under", "sky"};
  std::string text;
  uint64_t x = 7;
  while (text.size() < 40000) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    text += words[(x >> 33) % 20];
    text += ((x >> 20) % 9 == 0) ? ".\n" : " ";
  }
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "corpus.txt") << text;
  return (dir / "corpus.txt").string();
}

}  // namespace hp::train
