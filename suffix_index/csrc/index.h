// SuffixIndex: a SuffixTree behind a reader-writer lock, with the byte budget and serialization.
//
// Threading contract: any number of threads may call the const operations (speculate,
// speculate_exact, reads, serialize) at once under the shared lock; add/extend/remove (and the eviction
// they trigger) take the lock exclusively. Native drafters in other files that read `tree` directly
// must hold `mutex` shared for the whole read.
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "suffix_tree.h"

namespace reprise {

class SuffixIndex {
 public:
  SuffixIndex(uint32_t max_depth, uint64_t max_bytes, const std::vector<uint32_t>& key_lengths)
      : tree(max_depth, key_lengths), max_bytes(max_bytes) {}

  // New sequence, then eviction of the oldest others while over budget. Returns sequences evicted.
  size_t add(int64_t id, const Tok* tokens, size_t n) {
    std::unique_lock<std::shared_mutex> lock(mutex);
    tree.add(id, tokens, n);
    return max_bytes ? tree.evict_to(max_bytes, id) : 0;
  }
  size_t extend(int64_t id, const Tok* tokens, size_t n) {
    std::unique_lock<std::shared_mutex> lock(mutex);
    tree.extend(id, tokens, n);
    return max_bytes ? tree.evict_to(max_bytes, id) : 0;
  }
  void remove(int64_t id) {
    std::unique_lock<std::shared_mutex> lock(mutex);
    tree.remove(id);
  }

  // Versioned, checksummed bytes holding the sequences; deserialize() rebuilds the same index.
  std::string serialize() const;
  // std::invalid_argument for anything but bytes produced by serialize() (any version mismatch,
  // truncation, corruption or inconsistency).
  static std::unique_ptr<SuffixIndex> deserialize(const char* data, size_t size);

  mutable std::shared_mutex mutex;
  SuffixTree tree;
  uint64_t max_bytes;  // 0: no budget
};

}  // namespace reprise
