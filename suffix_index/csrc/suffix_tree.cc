// Suffix trie maintenance: insertion (whole suffixes, or growing the short suffixes at a sequence's
// end), removal, child blocks, arena management. See suffix_tree.h for the invariants.
#include "suffix_tree.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace reprise {
namespace {

constexpr uint32_t kNumClasses = 62;
constexpr uint32_t kMinExtendCapacity = 64;
constexpr uint64_t kCompactMinHole = 1u << 16;
// memory_bytes() accounting of one sequence record and its map entries.
constexpr uint64_t kSequenceOverhead = sizeof(Sequence) + 96;

inline ChildRef leaf_of(uint32_t pos) { return kLeafTag | pos; }
inline uint32_t pos_of(ChildRef leaf) { return leaf & ~kLeafTag; }

// Home slot of a token in a hashed child block of `cap` (a power of two >= 16) entries.
inline uint32_t home_of(Tok t, uint32_t cap) {
  return ((uint32_t)t * 0x9E3779B1u) >> (32 - __builtin_ctz(cap));
}

}  // namespace

SuffixTree::SuffixTree(uint32_t max_depth, const std::vector<uint32_t>& key_lengths) : max_depth_(max_depth) {
  if (max_depth < 1 || max_depth > kMaxDepthLimit)
    throw std::invalid_argument("max_depth must be in [1, " + std::to_string(kMaxDepthLimit) + "], got " +
                                std::to_string(max_depth));
  std::vector<uint32_t> keys = key_lengths;
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  if (keys.size() > kMaxKeyLengths)
    throw std::invalid_argument("at most " + std::to_string(kMaxKeyLengths) + " key lengths, got " +
                                std::to_string(keys.size()));
  for (uint32_t k : keys) {
    if (k < 1 || k >= max_depth)
      throw std::invalid_argument("key length " + std::to_string(k) + " must be in [1, max_depth - 1 = " +
                                  std::to_string(max_depth - 1) + "]");
  }
  key_lengths_ = keys;
  for (uint32_t k : keys) {
    KeyTable t;
    t.k = k;
    t.slots.resize(16, (uint64_t)kNil);
    keys_.push_back(std::move(t));
  }
  free_blocks_.assign(kNumClasses, kNil);
  nodes_.push_back(Node{0, 0, kNil, kNil, kNil, 0, 0, kNil});
  live_nodes_ = 1;
}

// ---------------------------------------------------------------- nodes

uint32_t SuffixTree::new_node(uint32_t count, uint32_t ref, uint32_t parent, uint32_t depth) {
  uint32_t id;
  if (free_nodes_ != kNil) {
    id = free_nodes_;
    free_nodes_ = nodes_[id].parent;
  } else {
    if (nodes_.size() >= kLeafTag) throw std::length_error("suffix index: too many nodes");
    id = (uint32_t)nodes_.size();
    nodes_.push_back(Node{});
  }
  nodes_[id] = Node{count, ref, parent, kNil, kNil, depth, 0, kNil};
  ++live_nodes_;
  return id;
}

void SuffixTree::free_node(uint32_t id) {
  Node& n = nodes_[id];
  if (n.block != kNil) free_block(n.block, block_capacity(n.num_children));
  n = Node{0, 0, free_nodes_, kNil, kNil, kFreeDepth, 0, kNil};
  free_nodes_ = id;
  --live_nodes_;
}

uint32_t SuffixTree::leaf_depth(uint32_t pos) const {
  const Tok* a = tok_.data() + pos;
  uint32_t d = 0;
  while (d < max_depth_ && a[d] != kSentinel) ++d;
  return d;
}

// ---------------------------------------------------------------- child blocks

uint32_t SuffixTree::alloc_block(uint32_t capacity) {
  const uint32_t cls = block_class(capacity), size = capacity;
  uint32_t b = free_blocks_[cls];
  if (b != kNil) {
    free_blocks_[cls] = pool_[b].b;
  } else {
    if (pool_.size() + size >= kNil) throw std::length_error("suffix index: child pool exhausted");
    b = (uint32_t)pool_.size();
    pool_.resize(pool_.size() + size);
  }
  live_slots_ += size;
  return b;
}

void SuffixTree::free_block(uint32_t block, uint32_t capacity) {
  live_slots_ -= capacity;
  const uint32_t cls = block_class(capacity);
  pool_[block] = Slot{0, free_blocks_[cls]};
  free_blocks_[cls] = block;
}

uint32_t SuffixTree::num_children(ChildRef c) const { return is_inline_leaf(c) ? 0 : nodes_[c].num_children; }

uint32_t SuffixTree::find_entry(uint32_t id, Tok t) const {
  const uint32_t b = nodes_[id].block, n = nodes_[id].num_children;
  if (b == kNil) return kNil;
  const Slot* e = pool_.data() + b;
  const uint32_t key = (uint32_t)t;
  if (n <= kSmallBlock) {
    for (uint32_t i = 0; i < n; ++i)
      if (e[i].a == key) return i;
    return kNil;
  }
  const uint32_t cap = block_capacity(n), mask = cap - 1;
  for (uint32_t i = home_of(t, cap);; i = (i + 1) & mask) {
    if (e[i].b == kNil) return kNil;
    if (e[i].a == key) return i;
  }
}

ChildRef SuffixTree::find_child(ChildRef c, Tok t) const {
  if (is_inline_leaf(c)) return kNil;
  uint32_t i = find_entry(c, t);
  return i == kNil ? kNil : pool_[nodes_[c].block + i].b;
}

ChildRef SuffixTree::best_child(ChildRef c) const {
  if (is_inline_leaf(c) || nodes_[c].best == kNil) return kNil;
  return find_child(c, (Tok)nodes_[c].best);
}

// Lays out `entries` (the node's complete child list) in a fresh block of the right capacity: sorted
// for small blocks, hashed beyond kSmallBlock. Keeps the best-child header.
void SuffixTree::build_block(uint32_t parent, const std::vector<Slot>& entries) {
  Node& node = nodes_[parent];
  if (node.block != kNil) free_block(node.block, block_capacity(node.num_children));
  const uint32_t n = (uint32_t)entries.size();
  node.num_children = n;
  node.block = kNil;
  if (n == 0) return;
  const uint32_t cap = block_capacity(n);
  const uint32_t b = alloc_block(cap);
  nodes_[parent].block = b;
  Slot* e = pool_.data() + b;
  if (n <= kSmallBlock) {
    std::copy(entries.begin(), entries.end(), e);
    std::sort(e, e + n, [](const Slot& x, const Slot& y) { return x.a < y.a; });
    for (uint32_t i = n; i < cap; ++i) e[i] = Slot{0, kNil};
  } else {
    for (uint32_t i = 0; i < cap; ++i) e[i] = Slot{0, kNil};
    const uint32_t mask = cap - 1;
    for (const Slot& s : entries) {
      uint32_t i = home_of((Tok)s.a, cap);
      while (e[i].b != kNil) i = (i + 1) & mask;
      e[i] = s;
    }
  }
}

void SuffixTree::add_child(uint32_t parent, Tok t, ChildRef child) {
  const uint32_t b = nodes_[parent].block, n = nodes_[parent].num_children;
  if (b != kNil && block_capacity(n + 1) == block_capacity(n)) {  // room in place
    Slot* e = pool_.data() + b;
    if (n + 1 <= kSmallBlock) {
      uint32_t i = n;
      while (i > 0 && (Tok)e[i - 1].a > t) {
        e[i] = e[i - 1];
        --i;
      }
      e[i] = Slot{(uint32_t)t, child};
    } else {
      const uint32_t cap = block_capacity(n), mask = cap - 1;
      uint32_t i = home_of(t, cap);
      while (e[i].b != kNil) i = (i + 1) & mask;
      e[i] = Slot{(uint32_t)t, child};
    }
    nodes_[parent].num_children = n + 1;
    return;
  }
  if (n + 1 <= kSmallBlock) {  // a bigger small block: copy with the new entry in its sorted place
    const uint32_t cap = block_capacity(n + 1);
    const uint32_t nb = alloc_block(cap);  // may move pool_: index only
    Slot* e = pool_.data() + nb;
    uint32_t j = 0;
    bool placed = false;
    for (uint32_t i = 0; i < n; ++i) {
      const Slot s = pool_[b + i];
      if (!placed && (Tok)s.a > t) {
        e[j++] = Slot{(uint32_t)t, child};
        placed = true;
      }
      e[j++] = s;
    }
    if (!placed) e[j++] = Slot{(uint32_t)t, child};
    for (; j < cap; ++j) e[j] = Slot{0, kNil};
    if (b != kNil) free_block(b, block_capacity(n));
    nodes_[parent].block = nb;
    nodes_[parent].num_children = n + 1;
    return;
  }
  std::vector<Slot> all;
  all.reserve(n + 1);
  for_each_child(parent, [&](Tok tt, ChildRef c) { all.push_back(Slot{(uint32_t)tt, c}); });
  all.push_back(Slot{(uint32_t)t, child});
  build_block(parent, all);
}

void SuffixTree::remove_child(uint32_t parent, Tok t) {
  const uint32_t i = find_entry(parent, t);
  if (i == kNil) throw std::logic_error("suffix index: removing a missing child");
  const uint32_t b = nodes_[parent].block, n = nodes_[parent].num_children;
  if (block_capacity(n - 1) != block_capacity(n) || n == 1) {
    std::vector<Slot> rest;
    rest.reserve(n);
    for_each_child(parent, [&](Tok tt, ChildRef c) {
      if (tt != t) rest.push_back(Slot{(uint32_t)tt, c});
    });
    build_block(parent, rest);
    return;
  }
  Slot* e = pool_.data() + b;
  if (n <= kSmallBlock) {
    std::memmove(e + i, e + i + 1, (n - 1 - i) * sizeof(Slot));
    e[n - 1] = Slot{0, kNil};
  } else {  // backward-shift deletion keeps every probe run unbroken
    const uint32_t cap = block_capacity(n), mask = cap - 1;
    uint32_t hole = i;
    for (uint32_t j = (hole + 1) & mask; e[j].b != kNil; j = (j + 1) & mask) {
      uint32_t home = home_of((Tok)e[j].a, cap);
      bool stays = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        e[hole] = e[j];
        hole = j;
      }
    }
    e[hole] = Slot{0, kNil};
  }
  nodes_[parent].num_children = n - 1;
}

void SuffixTree::replace_child(uint32_t parent, Tok t, ChildRef child) {
  uint32_t i = find_entry(parent, t);
  if (i == kNil) throw std::logic_error("suffix index: replacing a missing child");
  pool_[nodes_[parent].block + i].b = child;
}

void SuffixTree::bump_best(uint32_t parent, Tok t, uint32_t count) {
  if (parent == kRoot) return;  // the root never drafts
  Node& n = nodes_[parent];
  if (n.best == kNil) {
    n.best = (uint32_t)t;
    return;
  }
  const Tok bt = (Tok)n.best;
  if (bt == t) return;
  const uint32_t bc = count_of(find_child(parent, bt));
  if (count > bc || (count == bc && t < bt)) nodes_[parent].best = (uint32_t)t;
}

void SuffixTree::recompute_best(uint32_t id) {
  if (id == kRoot) return;
  Tok best = -1;
  uint32_t best_count = 0;
  for_each_child(id, [&](Tok t, ChildRef c) {
    uint32_t cc = count_of(c);
    if (best < 0 || cc > best_count || (cc == best_count && t < best)) {
      best = t;
      best_count = cc;
    }
  });
  nodes_[id].best = best < 0 ? kNil : (uint32_t)best;
}

// ---------------------------------------------------------------- terminal lists and tails

void SuffixTree::term_add(uint32_t id, uint32_t pos) {
  term_next_[pos] = nodes_[id].term;
  nodes_[id].term = pos;
}

void SuffixTree::term_remove(uint32_t id, uint32_t pos) {
  uint32_t* link = &nodes_[id].term;
  while (*link != kNil) {
    if (*link == pos) {
      *link = term_next_[pos];
      term_next_[pos] = kNil;
      return;
    }
    link = &term_next_[*link];
  }
  throw std::logic_error("suffix index: position missing from its terminal list");
}

void SuffixTree::set_tail(uint32_t pos, ChildRef c) {
  auto it = by_base_.upper_bound(pos);
  if (it == by_base_.begin()) return;
  Sequence& s = seqs_[std::prev(it)->second];
  if (!s.tails_valid || pos < s.base) return;
  uint32_t off = pos - s.base;
  if (off >= s.tails_first && off - s.tails_first < s.tails.size()) s.tails[off - s.tails_first] = c;
}

// ---------------------------------------------------------------- insertion

// Inserting a suffix is a chain of dependent cache misses (child block, child node, edge label, exact
// key slot). Consecutive suffixes take unrelated paths, so the first levels of suffix p + 12, 6 and 3
// are touched ahead: each stage reads only lines the previous stage prefetched.
void SuffixTree::prefetch_far(uint32_t p, uint32_t end) {
  if (p >= end) return;
  const Tok* tok = tok_.data();
  const Node& root = nodes_[kRoot];
  if (root.num_children > kSmallBlock)
    __builtin_prefetch(&pool_[root.block + home_of(tok[p], block_capacity(root.num_children))]);
  if (keys_.empty()) return;
  const uint32_t max_k = std::min(end - p, max_depth_);
  const uint64_t* hashes = key_hashes_at(p, max_k);
  for (size_t ki = 0; ki < keys_.size() && keys_[ki].k <= max_k; ++ki)
    __builtin_prefetch(&keys_[ki].slots[keys_[ki].home(hashes[ki])]);
}

void SuffixTree::prefetch_mid(uint32_t p, uint32_t end) const {
  if (p >= end) return;
  const ChildRef c = find_child(kRoot, tok_[p]);
  if (c == kNil) return;
  if (is_inline_leaf(c))
    __builtin_prefetch(&tok_[(c & ~kLeafTag) + 1]);
  else
    __builtin_prefetch(&nodes_[c]);
}

void SuffixTree::prefetch_near(uint32_t p, uint32_t end) const {
  if (p >= end) return;
  const ChildRef c = find_child(kRoot, tok_[p]);
  if (c == kNil || is_inline_leaf(c)) return;
  const Node& n = nodes_[c];
  __builtin_prefetch(&tok_[n.ref + 1]);
  if (n.block == kNil || p + n.depth >= end) return;
  const Tok t = tok_[p + n.depth];
  __builtin_prefetch(&pool_[n.num_children > kSmallBlock ? n.block + home_of(t, block_capacity(n.num_children)) : n.block]);
}

// The suffix starting at arena position p, to end at depth d_to, has reached node `at` at depth
// j <= d_to: it ends there (j == d_to) or goes on below it as a new inline leaf. Returns where it ends.
inline ChildRef SuffixTree::end_suffix(uint32_t at, uint32_t p, uint32_t j, uint32_t d_to) {
  if (j >= d_to) {
    term_add(at, p);
    return at;
  }
  const Tok t = tok_[p + j];
  term_next_[p] = kNil;
  add_child(at, t, leaf_of(p));
  bump_best(at, t, 1);
  keys_insert_range(leaf_of(p), j, d_to);
  return leaf_of(p);
}

// The suffix starting at arena position p currently ends at x, at depth d_from (x is the root and
// d_from 0 for a suffix not yet indexed). Extends it to end at depth d_to; returns where it now ends.
// Keeps the trie canonical. An inline leaf x is p's own and has already grown with its sequence.
ChildRef SuffixTree::advance(uint32_t p, ChildRef x, uint32_t d_from, uint32_t d_to) {
  if (d_to <= d_from || is_inline_leaf(x)) return x;
  const Tok* tok = tok_.data();
  if (x != kRoot)
    term_remove(x, p);
  else
    ++nodes_[kRoot].count;
  uint32_t cur = x, d = d_from;
  ChildRef end = kNil;
  while (end == kNil) {
    const Tok t = tok[p + d];
    const uint32_t ei = find_entry(cur, t);
    if (ei == kNil) {  // new branch: an inline leaf
      end = end_suffix(cur, p, d, d_to);
      break;
    }
    const ChildRef y = pool_[nodes_[cur].block + ei].b;
    const uint32_t yref = ref_of(y);
    const Tok* a = tok + yref;
    const Tok* b = tok + p;
    uint32_t j = d + 1;
    if (is_inline_leaf(y)) {  // y's string: a[0, min(max_depth, sentinel)); its only occurrence is yref
      while (j < d_to && a[j] == b[j]) ++j;
      const bool y_ends = j == max_depth_ || a[j] == kSentinel;
      uint32_t v = new_node(2, std::max(yref, p), cur, j);
      replace_child(cur, t, v);
      bump_best(cur, t, 2);
      keys_move_range(y, v, d, j);
      if (y_ends) {  // y's position ends at v now; so does p's, or p goes on below v
        term_add(v, yref);
        set_tail(yref, v);
      } else {
        add_child(v, a[j], y);
        bump_best(v, a[j], 1);
      }
      end = end_suffix(v, p, j, d_to);
      break;
    }
    const uint32_t e = nodes_[y].depth, lim = std::min(e, d_to);
    while (j < lim && a[j] == b[j]) ++j;
    if (j < e) {  // p leaves (or ends inside) y's edge at depth j: split y there
      const uint32_t ycount = nodes_[y].count;
      uint32_t up = new_node(ycount + 1, std::max(yref, p), cur, j);
      add_child(up, a[j], y);
      nodes_[y].parent = up;
      replace_child(cur, t, up);
      bump_best(cur, t, ycount + 1);
      bump_best(up, a[j], ycount);
      keys_move_range(y, up, d, j);
      end = end_suffix(up, p, j, d_to);
      break;
    }
    // whole edge matched: one more occurrence of y's string
    Node& ny = nodes_[y];
    ++ny.count;
    if (p > ny.ref) ny.ref = p;
    bump_best(cur, t, ny.count);
    cur = y;
    d = e;
    if (d == d_to) {
      term_add(y, p);
      end = y;
    }
  }
  if (x != kRoot && nodes_[x].term == kNil && num_children(x) == 1) fuse_into_child(x);
  return end;
}

// x has one child and no terminal position: its edge merges into the child's.
void SuffixTree::fuse_into_child(uint32_t x) {
  const uint32_t parent = nodes_[x].parent;
  ChildRef child = kNil;
  for_each_child(x, [&](Tok, ChildRef c) { child = c; });
  const Tok t = first_token(x);
  const uint32_t lo = nodes_[parent].depth, hi = nodes_[x].depth;
  replace_child(parent, t, child);  // same first token: the parent's best is unchanged
  if (!is_inline_leaf(child)) nodes_[child].parent = parent;
  keys_move_range(x, child, lo, hi);
  free_node(x);
}

// x is a leaf reached by one position only: it becomes an inline leaf.
void SuffixTree::demote_to_leaf(uint32_t x) {
  const uint32_t parent = nodes_[x].parent, q = nodes_[x].term;
  const Tok t = first_token(x);
  const uint32_t lo = nodes_[parent].depth, hi = nodes_[x].depth;
  term_next_[q] = kNil;
  replace_child(parent, t, leaf_of(q));
  keys_move_range(x, leaf_of(q), lo, hi);
  set_tail(q, leaf_of(q));
  free_node(x);
}

// Positions about to hold new tokens (or to move) must not keep hashes of what they held before.
void SuffixTree::forget_hashes() {
  for (HashedPos& e : hash_ring_) e.pos = kNil;
}

uint32_t SuffixTree::reserve_arena(uint32_t n) {
  forget_hashes();
  if ((uint64_t)tok_.size() + n > kMaxArena) {
    compact_arena();
    if ((uint64_t)tok_.size() + n > kMaxArena) throw std::length_error("suffix index: token arena full");
  }
  uint32_t base = (uint32_t)tok_.size();
  tok_.resize(tok_.size() + n, kSentinel);
  term_next_.resize(tok_.size(), kNil);
  return base;
}

uint32_t SuffixTree::create_sequence(int64_t id, uint32_t cap) {
  if (id < 0) throw std::invalid_argument("sequence id must be >= 0, got " + std::to_string(id));
  if (by_id_.count(id)) throw std::invalid_argument("sequence id " + std::to_string(id) + " already exists");
  cap = std::max<uint32_t>(cap, 1);  // room for the sentinel
  const uint32_t base = reserve_arena(cap);
  uint32_t slot;
  if (!free_seq_slots_.empty()) {
    slot = free_seq_slots_.back();
    free_seq_slots_.pop_back();
  } else {
    slot = (uint32_t)seqs_.size();
    seqs_.emplace_back();
  }
  Sequence& s = seqs_[slot];
  s = Sequence{};
  s.id = id;
  s.created = next_created_++;
  s.base = base;
  s.cap = cap;
  tok_[base] = kSentinel;
  by_id_[id] = slot;
  by_created_[s.created] = slot;
  by_base_[base] = slot;
  return slot;
}

void SuffixTree::add(int64_t id, const Tok* tokens, size_t n) {
  if (n >= kMaxArena / 2) throw std::length_error("sequence too long: " + std::to_string(n) + " tokens");
  const uint32_t slot = create_sequence(id, (uint32_t)n + 1);
  append_tokens(seqs_[slot], tokens, n, /*keep_tails=*/false);
}

void SuffixTree::extend(int64_t id, const Tok* tokens, size_t n) {
  if (n >= kMaxArena / 2) throw std::length_error("sequence too long: " + std::to_string(n) + " tokens");
  auto it = by_id_.find(id);
  const uint32_t slot = it == by_id_.end() ? create_sequence(id, std::max<uint32_t>(kMinExtendCapacity, 2 * (uint32_t)n + 1))
                                           : it->second;
  if (n == 0) return;
  Sequence& s = seqs_[slot];
  if ((uint64_t)s.len + n >= kMaxArena / 2) throw std::length_error("sequence too long");
  if (s.len + n + 1 > s.cap) {
    const uint32_t want = std::max<uint32_t>(kMinExtendCapacity, 2 * (s.len + (uint32_t)n) + 1);
    if ((uint64_t)s.base + s.cap == tok_.size() && (uint64_t)s.base + want <= kMaxArena) {
      tok_.resize(s.base + want, kSentinel);  // last in the arena: grow in place
      term_next_.resize(tok_.size(), kNil);
      s.cap = want;
    } else {  // move to the end of the arena: unindex, copy, reindex
      std::vector<Tok> old(tok_.begin() + s.base, tok_.begin() + s.base + s.len);
      unindex(s);
      by_base_.erase(s.base);
      hole_tokens_ += s.cap;
      const uint32_t nb = reserve_arena(want);  // may compact the arena; seqs_ is not resized
      Sequence& s2 = seqs_[slot];
      s2.base = nb;
      s2.cap = want;
      s2.len = 0;
      tok_[nb] = kSentinel;
      by_base_[nb] = slot;
      append_tokens(s2, old.data(), old.size(), /*keep_tails=*/true);
    }
  }
  append_tokens(seqs_[slot], tokens, n, /*keep_tails=*/true);
}

// Finds where each short suffix at the end of `s` ends.
void SuffixTree::materialize_tails(Sequence& s) {
  const uint32_t first = s.len + 1 > max_depth_ ? s.len + 1 - max_depth_ : 0;
  tails_slots_ -= s.tails.size();
  s.tails.clear();
  for (uint32_t off = first; off < s.len; ++off) {
    Locus l;
    const uint32_t m = s.len - off;
    if (!locate(tok_.data() + s.base + off, m, &l) ||
        (is_inline_leaf(l.node) ? pos_of(l.node) != s.base + off : nodes_[l.node].depth != m))
      throw std::logic_error("suffix index: a sequence's suffix is not indexed");
    s.tails.push_back(l.node);
  }
  s.tails_first = first;
  tails_slots_ += s.tails.size();
  s.tails_valid = true;
}

// Writes tokens after s's current end (capacity already reserved) and indexes them. With keep_tails
// (extend) the ends of the short suffixes at the sequence's end are kept for the next extend; add()
// does not keep them (history sequences rarely grow; they are found again if one does).
void SuffixTree::append_tokens(Sequence& s, const Tok* tokens, size_t n, bool keep_tails) {
  if (n == 0) return;
  const uint32_t old_len = s.len, new_len = s.len + (uint32_t)n;
  if (keep_tails && !s.tails_valid) materialize_tails(s);
  if (!keep_tails && old_len > 0) throw std::logic_error("suffix index: append without tails");
  std::memcpy(tok_.data() + s.base + old_len, tokens, n * sizeof(Tok));
  tok_[s.base + new_len] = kSentinel;
  std::fill(term_next_.begin() + s.base + old_len, term_next_.begin() + s.base + new_len, kNil);
  s.len = new_len;
  if (keep_tails) {
    // Inline leaves of this sequence grew with it: first index the keys they now reach, so that the
    // splits below find them; then move every other short suffix down.
    // (An inline tail promoted to a Node by a later step has still grown already: `grown` remembers.)
    std::vector<uint8_t> grown(s.tails.size());
    for (size_t i = 0; i < s.tails.size(); ++i) {
      const uint32_t off = s.tails_first + (uint32_t)i;
      grown[i] = is_inline_leaf(s.tails[i]);
      if (grown[i]) keys_insert_range(s.tails[i], old_len - off, std::min(max_depth_, new_len - off));
    }
    for (size_t i = 0; i < s.tails.size(); ++i) {
      const uint32_t off = s.tails_first + (uint32_t)i;
      if (!grown[i]) s.tails[i] = advance(s.base + off, s.tails[i], old_len - off, std::min(max_depth_, new_len - off));
    }
    tails_slots_ -= s.tails.size();
    s.tails.reserve(s.tails.size() + n);
  }
  const uint32_t end_pos = s.base + new_len;
  for (uint32_t off = old_len; off < new_len; ++off) {
    const uint32_t p = s.base + off;
    prefetch_far(p + 12, end_pos);
    prefetch_mid(p + 6, end_pos);
    prefetch_near(p + 3, end_pos);
    const ChildRef end = advance(p, kRoot, 0, std::min(max_depth_, new_len - off));
    if (keep_tails) s.tails.push_back(end);  // pushed at once: later splits may update it
  }
  if (keep_tails) {
    const uint32_t keep_from = new_len + 1 > max_depth_ ? new_len + 1 - max_depth_ : 0;
    if (keep_from > s.tails_first) {
      s.tails.erase(s.tails.begin(), s.tails.begin() + (keep_from - s.tails_first));
      s.tails_first = keep_from;
    }
    tails_slots_ += s.tails.size();
    s.tails_valid = true;
  }
}

// ---------------------------------------------------------------- removal

// Removes one occurrence: the suffix at arena position p of length len. Nodes whose ref points into
// `s` go to touched; nodes whose best child may have changed to dirty.
void SuffixTree::remove_suffix(uint32_t p, uint32_t len, const Sequence& s, std::vector<uint32_t>* touched,
                               std::vector<uint32_t>* dirty) {
  ChildRef path[kMaxDepthLimit + 1];
  uint32_t np = 0, d = 0;
  ChildRef node = kRoot;
  path[np++] = kRoot;
  const Tok* tok = tok_.data();
  while (d < len) {
    const ChildRef c = find_child(node, tok[p + d]);
    if (c == kNil || (!is_inline_leaf(c) && nodes_[c].depth > len))
      throw std::logic_error("suffix index: removing a missing suffix");
    path[np++] = c;
    if (is_inline_leaf(c)) break;
    node = c;
    d = nodes_[c].depth;
  }
  --nodes_[kRoot].count;
  const uint32_t lo = s.base, hi = s.base + s.len;
  uint32_t i = np - 1;
  if (is_inline_leaf(path[i])) {
    const uint32_t parent = path[i - 1];
    if (path[i] != leaf_of(p)) throw std::logic_error("suffix index: removing someone else's leaf");
    const Tok t = tok[p + nodes_[parent].depth];
    const bool was_best = parent != kRoot && nodes_[parent].best == (uint32_t)t;
    keys_erase_range(path[i], nodes_[parent].depth, len);
    remove_child(parent, t);
    if (was_best) {
      nodes_[parent].best = kNil;
      dirty->push_back(parent);
    }
    --i;
  } else {
    term_remove(path[i], p);
  }
  for (; i >= 1; --i) {
    const uint32_t v = path[i], parent = path[i - 1];
    const bool was_best = parent != kRoot && nodes_[parent].best == (uint32_t)first_token(v);
    Node& nv = nodes_[v];
    if (--nv.count == 1) {  // one position left: an inline leaf again
      if (num_children(v) == 0)
        demote_to_leaf(v);
      else
        fuse_into_child(v);
    } else {
      if (nv.ref >= lo && nv.ref < hi) touched->push_back(v);
      if (nv.term == kNil && num_children(v) == 1) fuse_into_child(v);
    }
    if (was_best) dirty->push_back(parent);
  }
}

// Removes every suffix of s from the trie and re-points refs that pointed into it. The sequence's
// record and tokens stay (callers drop or reindex them).
void SuffixTree::unindex(Sequence& s) {
  std::vector<uint32_t> touched, dirty;
  for (uint32_t off = 0; off < s.len; ++off)
    remove_suffix(s.base + off, std::min(max_depth_, s.len - off), s, &touched, &dirty);
  std::sort(dirty.begin(), dirty.end());  // a wide node is rescanned once, however often it was hit
  dirty.erase(std::unique(dirty.begin(), dirty.end()), dirty.end());
  for (uint32_t v : dirty)
    if (nodes_[v].depth != kFreeDepth) recompute_best(v);
  // The newest remaining occurrence of a node's string is the newest of its children's refs and of
  // the positions ending at it. Deepest first, so children are already fixed.
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  std::sort(touched.begin(), touched.end(), [&](uint32_t a, uint32_t b) {
    const uint32_t da = nodes_[a].depth, db = nodes_[b].depth;
    return da != db ? da > db : a < b;
  });
  const uint32_t lo = s.base, hi = s.base + s.len;
  for (uint32_t v : touched) {
    Node& nv = nodes_[v];
    if (nv.depth == kFreeDepth || nv.ref < lo || nv.ref >= hi) continue;
    uint32_t r = 0;
    bool any = false;
    for (uint32_t q = nv.term; q != kNil; q = term_next_[q]) {
      r = any ? std::max(r, q) : q;
      any = true;
    }
    for_each_child(v, [&](Tok, ChildRef c) {
      r = any ? std::max(r, ref_of(c)) : ref_of(c);
      any = true;
    });
    if (!any || (r >= lo && r < hi)) throw std::logic_error("suffix index: no occurrence left to re-point to");
    nv.ref = r;
  }
  tails_slots_ -= s.tails.size();
  s.tails.clear();
  s.tails_valid = false;
}

void SuffixTree::remove_slot(uint32_t slot) {
  Sequence& s = seqs_[slot];
  unindex(s);
  by_id_.erase(s.id);
  by_created_.erase(s.created);
  by_base_.erase(s.base);
  hole_tokens_ += s.cap;
  s = Sequence{};
  free_seq_slots_.push_back(slot);
  // Holes at the arena's end are simply dropped; inner holes are compacted once they outweigh data.
  const uint64_t end = by_base_.empty() ? 0 : (uint64_t)std::prev(by_base_.end())->first + seqs_[std::prev(by_base_.end())->second].cap;
  forget_hashes();
  if (end < tok_.size()) {
    hole_tokens_ -= tok_.size() - end;
    tok_.shrink_to(end);
    term_next_.shrink_to(end);
  }
  if (hole_tokens_ > kCompactMinHole && hole_tokens_ > tok_.size() - hole_tokens_) compact_arena();
}

void SuffixTree::remove(int64_t id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(id) + " (never added, or removed)");
  remove_slot(it->second);
}

size_t SuffixTree::evict_to(uint64_t max_bytes, int64_t keep_id) {
  size_t evicted = 0;
  while (memory_bytes() > max_bytes) {
    auto it = by_created_.begin();
    if (it != by_created_.end() && seqs_[it->second].id == keep_id) ++it;
    if (it == by_created_.end()) break;
    remove_slot(it->second);
    ++evicted;
  }
  return evicted;
}

// Slides every sequence down over the holes, keeping arena order, and rewrites all positions: node
// refs and terminal lists, inline leaves in child blocks and exact-key tables, and tails.
void SuffixTree::compact_arena() {
  forget_hashes();
  std::vector<uint32_t> old_base, new_base;
  uint64_t total = 0;
  for (auto& kv : by_base_) total += seqs_[kv.second].cap;
  PodBuffer<Tok> ntok((size_t)total, kSentinel);
  uint64_t at = 0;
  for (auto& kv : by_base_) {
    const Sequence& s = seqs_[kv.second];
    old_base.push_back(s.base);
    new_base.push_back((uint32_t)at);
    std::memcpy(ntok.data() + at, tok_.data() + s.base, (size_t)s.cap * sizeof(Tok));
    at += s.cap;
  }
  auto map = [&](uint32_t pos) -> uint32_t {
    if (pos == kNil) return kNil;
    size_t i = std::upper_bound(old_base.begin(), old_base.end(), pos) - old_base.begin() - 1;
    return pos - old_base[i] + new_base[i];
  };
  auto map_ref = [&](ChildRef c) -> ChildRef { return is_inline_leaf(c) ? leaf_of(map(pos_of(c))) : c; };
  PodBuffer<uint32_t> nnext(ntok.size(), kNil);
  size_t si = 0;
  for (auto& kv : by_base_) {
    const Sequence& s = seqs_[kv.second];
    for (uint32_t off = 0; off < s.len; ++off) nnext[new_base[si] + off] = map(term_next_[s.base + off]);
    ++si;
  }
  for (size_t id = 0; id < nodes_.size(); ++id) {
    Node& n = nodes_[id];
    if (n.depth == kFreeDepth) continue;
    if (id != kRoot) n.ref = map(n.ref);
    n.term = map(n.term);
    if (n.block == kNil) continue;
    const uint32_t cap = block_capacity(n.num_children);
    for (uint32_t i = 0; i < cap; ++i) {
      Slot& e = pool_[n.block + i];
      if (e.b != kNil) e.b = map_ref(e.b);
    }
  }
  for (KeyTable& t : keys_)
    for (uint64_t& slot : t.slots)
      if ((uint32_t)slot != kNil) slot = (slot & 0xFFFFFFFF00000000ull) | map_ref((uint32_t)slot);
  std::map<uint32_t, uint32_t> nbb;
  si = 0;
  for (auto& kv : by_base_) {
    Sequence& s = seqs_[kv.second];
    for (ChildRef& c : s.tails) c = map_ref(c);
    s.base = new_base[si++];
    nbb[s.base] = kv.second;
  }
  by_base_.swap(nbb);
  tok_.swap(ntok);
  term_next_.swap(nnext);
  hole_tokens_ = 0;
}

// ---------------------------------------------------------------- queries on sequences

std::vector<int64_t> SuffixTree::sequence_ids() const {
  std::vector<int64_t> out;
  out.reserve(by_created_.size());
  for (auto& kv : by_created_) out.push_back(seqs_[kv.second].id);
  return out;
}

std::vector<Tok> SuffixTree::get_sequence(int64_t id) const {
  auto it = by_id_.find(id);
  if (it == by_id_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(id) + " (never added, or removed)");
  const Sequence& s = seqs_[it->second];
  return std::vector<Tok>(tok_.begin() + s.base, tok_.begin() + s.base + s.len);
}

std::vector<const Sequence*> SuffixTree::sequences_in_arena_order() const {
  std::vector<const Sequence*> out;
  for (auto& kv : by_base_) out.push_back(&seqs_[kv.second]);
  return out;
}

void SuffixTree::set_created(int64_t id, uint64_t created) {
  const uint32_t slot = by_id_.at(id);
  Sequence& s = seqs_[slot];
  auto it = by_created_.find(created);
  if (it != by_created_.end() && it->second != slot) throw std::invalid_argument("duplicate creation ordinal");
  by_created_.erase(s.created);
  s.created = created;
  by_created_[created] = slot;
}

// Live data: Nodes, child blocks at their capacity, live tokens with their terminal links, sequence
// records with kept tails, and exact-key slots at load 2/3 (a growing table stays between 8/15 and
// 4/5). Freed capacity that later inserts reuse and arena holes (compacted) are not counted.
uint64_t SuffixTree::memory_bytes() const {
  uint64_t keys = 0;
  for (const KeyTable& t : keys_) keys += t.size;
  const uint64_t live_tokens = nodes_[kRoot].count;
  return live_nodes_ * sizeof(Node) + live_slots_ * sizeof(Slot) + live_tokens * (sizeof(Tok) + sizeof(uint32_t)) +
         by_id_.size() * kSequenceOverhead + tails_slots_ * sizeof(ChildRef) + keys * 3 * sizeof(uint64_t) / 2;
}

std::map<std::string, uint64_t> SuffixTree::stats() const {
  std::map<std::string, uint64_t> m;
  m["nodes"] = live_nodes_;
  m["child_slots"] = live_slots_;
  m["tokens"] = nodes_[kRoot].count;
  m["sequences"] = by_id_.size();
  m["tail_slots"] = tails_slots_;
  m["arena_tokens"] = tok_.size();
  m["arena_holes"] = hole_tokens_;
  m["node_capacity"] = nodes_.size();
  m["pool_capacity"] = pool_.size();
  uint64_t keys = 0, key_capacity = 0;
  for (const KeyTable& t : keys_) {
    m["keys_k" + std::to_string(t.k)] = t.size;
    keys += t.size;
    key_capacity += t.slots.size();
  }
  m["keys"] = keys;
  m["key_capacity"] = key_capacity;
  // Bytes the containers hold, including growth slack (what the process actually pays for them).
  m["allocated_bytes"] = nodes_.capacity() * sizeof(Node) + pool_.capacity() * sizeof(Slot) +
                         tok_.capacity() * sizeof(Tok) + term_next_.capacity() * sizeof(uint32_t) +
                         key_capacity * sizeof(uint64_t) + tails_slots_ * sizeof(ChildRef) +
                         seqs_.capacity() * sizeof(Sequence) + by_id_.size() * 96;
  m["memory_bytes"] = memory_bytes();
  return m;
}

}  // namespace reprise
