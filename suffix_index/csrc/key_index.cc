// Exact-key index: for each key length k, a hash table from every indexed k-gram to its locus (the
// shallowest trie node whose depth is >= k on the k-gram's path). The trie keeps the counts and the
// newest occurrence, so a lookup is one probe sequence plus one verification against the arena, and
// the entry stays right as the trie changes: every operation that moves a locus (new node, split,
// fuse, demotion, leaf growth, deletion) calls keys_insert/move/erase_range for the depths it affects.
// Tables grow by half past load 4/5 and shrink by a third below 1/5.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "suffix_tree.h"

namespace reprise {
namespace {

inline bool is_empty(uint64_t slot) { return (uint32_t)slot == kNil; }
inline uint32_t hash32(uint64_t slot) { return (uint32_t)(slot >> 32); }

}  // namespace

namespace {

inline uint64_t hash_step(uint64_t h, Tok t) { return (h ^ (uint32_t)t) * 0xff51afd7ed558ccdull + 0x9E3779B97F4A7C15ull; }

inline uint64_t hash_pair(uint64_t h, const Tok* t) {
  uint64_t w;
  std::memcpy(&w, t, 8);
  return (h ^ w) * 0xff51afd7ed558ccdull + 0x9E3779B97F4A7C15ull;
}

// Tokens [from, to) of t into h: pairs as one 64-bit word, an odd last token alone.
inline uint64_t hash_run(uint64_t h, const Tok* t, uint32_t from, uint32_t to) {
  for (; from + 2 <= to; from += 2) h = hash_pair(h, t + from);
  if (from < to) h = hash_step(h, t[from]);
  return h;
}

inline uint64_t hash_final(uint64_t h, size_t k) {
  h ^= (uint64_t)k * 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 29;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 32;
  return h;
}

}  // namespace

// A k-gram's hash is hash_run over aligned pairs from its start, so the key lengths' prefixes of one
// position are hashed in one pass as long as every key length but the last is even (an odd one ends
// the shared run with its single last token, so longer keys restart from there).
uint64_t SuffixTree::hash_tokens(const Tok* t, size_t k) { return hash_final(hash_run(0, t, 0, (uint32_t)k), k); }

void SuffixTree::hash_key_prefixes(const Tok* t, uint32_t max_k, uint64_t* out) const {
  uint64_t h = 0;
  uint32_t i = 0;
  for (size_t ki = 0; ki < keys_.size(); ++ki) {
    const uint32_t k = keys_[ki].k;
    if (k > max_k) break;
    if (i % 2) {  // the previous key was odd: rehash from the start so pairs stay aligned
      h = 0;
      i = 0;
    }
    h = hash_run(h, t, i, k);
    i = k;
    out[ki] = hash_final(h, k);
  }
}

const uint64_t* SuffixTree::key_hashes_at(uint32_t pos, uint32_t max_k) {
  HashedPos& e = hash_ring_[pos % kHashRing];
  if (e.pos != pos || e.max_k < max_k) {
    e.pos = pos;
    e.max_k = max_k;
    hash_key_prefixes(tok_.data() + pos, max_k, e.h);
  }
  return e.h;
}

uint32_t SuffixTree::key_find(const KeyTable& table, const Tok* key, uint64_t h) const {
  const uint32_t h32 = (uint32_t)(h >> 32);
  for (size_t i = table.home(h);; i = table.next(i)) {
    uint64_t slot = table.slots[i];
    if (is_empty(slot)) return kNil;
    if (hash32(slot) == h32) {
      // Verify the k-gram itself: a 32-bit hash match is not proof.
      const Tok* a = tok_.data() + ref_of((ChildRef)slot);
      if (std::memcmp(a, key, table.k * sizeof(Tok)) == 0) return (uint32_t)i;
    }
  }
}

void SuffixTree::key_rehash(KeyTable& table, size_t capacity) {
  KeyTable fresh;
  fresh.slots.resize(capacity, (uint64_t)kNil);
  for (uint64_t slot : table.slots) {
    if (is_empty(slot)) continue;
    size_t i = fresh.home(slot);
    while (!is_empty(fresh.slots[i])) i = fresh.next(i);
    fresh.slots[i] = slot;
  }
  table.slots.swap(fresh.slots);
}

uint32_t SuffixTree::key_slot_of(const KeyTable& table, uint64_t h, ChildRef node) const {
  const uint64_t want = ((h >> 32) << 32) | node;
  for (size_t i = table.home(h);; i = table.next(i)) {
    const uint64_t slot = table.slots[i];
    if (slot == want) return (uint32_t)i;
    if (is_empty(slot)) throw std::logic_error("suffix index: exact key missing from its table");
  }
}

template <typename F>
void SuffixTree::for_keys_in(uint32_t pos, uint32_t lo, uint32_t hi, F&& f) {
  if (keys_.empty() || keys_.back().k <= lo || keys_.front().k > hi) return;
  const uint64_t* hashes = key_hashes_at(pos, hi);
  for (size_t ki = 0; ki < keys_.size(); ++ki)
    if (keys_[ki].k > lo && keys_[ki].k <= hi) f(keys_[ki], hashes[ki]);
}

void SuffixTree::keys_insert_range(ChildRef node, uint32_t lo, uint32_t hi) {
  for_keys_in(ref_of(node), lo, hi, [&](KeyTable& table, uint64_t h) {
    if ((table.size + 1) * 5 > table.slots.size() * 4) key_rehash(table, table.slots.size() + table.slots.size() / 2);
    size_t j = table.home(h);
    while (!is_empty(table.slots[j])) j = table.next(j);
    table.slots[j] = ((h >> 32) << 32) | node;
    ++table.size;
  });
}

void SuffixTree::keys_move_range(ChildRef from, ChildRef to, uint32_t lo, uint32_t hi) {
  for_keys_in(ref_of(to), lo, hi, [&](KeyTable& table, uint64_t h) {
    const uint32_t i = key_slot_of(table, h, from);
    table.slots[i] = (table.slots[i] & 0xFFFFFFFF00000000ull) | to;
  });
}

void SuffixTree::keys_erase_range(ChildRef node, uint32_t lo, uint32_t hi) {
  for_keys_in(ref_of(node), lo, hi, [&](KeyTable& table, uint64_t h) {
    size_t i = key_slot_of(table, h, node);
    // Backward-shift deletion: pull later entries of the probe run into the hole when their home allows.
    for (size_t j = table.next(i);; j = table.next(j)) {
      const uint64_t slot = table.slots[j];
      if (is_empty(slot)) break;
      const size_t home = table.home(slot);
      const bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (!stays) {
        table.slots[i] = slot;
        i = j;
      }
    }
    table.slots[i] = (uint64_t)kNil;
    --table.size;
    if (table.slots.size() > 16 && table.size * 5 < table.slots.size())
      key_rehash(table, std::max<size_t>(16, table.slots.size() * 2 / 3));
  });
}

bool SuffixTree::key_lookup(size_t idx, const Tok* key, Locus* out) const {
  const KeyTable& table = keys_[idx];
  uint32_t i = key_find(table, key, hash_tokens(key, table.k));
  if (i == kNil) return false;
  *out = Locus{(ChildRef)table.slots[i], table.k};
  return true;
}

}  // namespace reprise
