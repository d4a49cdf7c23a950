// Reprise suffix index: a depth-capped, path-compressed suffix trie over int32 token sequences with
// occurrence counts per node (SuffixDecoding, arXiv 2411.04975), plus an exact-key index that maps the
// k tokens ending anywhere in the index to their locus in the trie (O(1) lookup).
//
// Strings. Every indexed position p of a sequence starts one "suffix": the tokens
// seq[p, min(p + max_depth, len(seq))). The trie holds every such suffix; the string of a node is the
// path of tokens from the root. count(node) = number of indexed positions whose suffix has the node's
// string as a prefix = occurrences of that string (strings of length <= max_depth).
//
// Canonical form (check_integrity() verifies it). A non-root node exists iff its string is the end of
// some suffix ("terminal": the suffix is exactly that long) or it has >= 2 children. So a node with
// exactly one child always has a terminal position, and counts are constant along an edge. The shape is
// a function of the multiset of indexed sequences: remove() leaves the trie exactly as if the sequence
// had never been added (node ids differ, nothing observable does).
//
// Token store ("arena"). All sequences live in one int32 array; a sequence occupies
// [base, base + cap), its tokens are arena[base, base + len) and arena[base + len] is kSentinel. Nodes
// reference their edge labels by arena position, so positions are 31-bit. Arena order is write order:
// add() appends at the end, and a sequence that outgrows its reserved capacity moves to the end.
// "Newest" below means "highest arena position". Holes left by removed sequences are compacted away
// once they outweigh live tokens.
//
// Leaves reached by a single position (count 1, most of the trie) are not nodes: the parent's child
// entry holds kLeafTag | position ("inline leaf"). Such a leaf's string is the position's whole suffix,
// arena[pos, pos + min(max_depth, distance to the sentinel)), so it grows by itself when its sequence
// is extended. Every other node is a Node.
//
// Threading. SuffixTree itself is not synchronised; SuffixIndex (index.h) wraps it with a
// reader-writer lock. All const methods are safe to call concurrently with each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "pod_buffer.h"

namespace reprise {

using Tok = int32_t;
constexpr uint32_t kNil = 0xFFFFFFFFu;
constexpr uint32_t kRoot = 0;
constexpr uint32_t kMaxDepthLimit = 4096;
constexpr Tok kSentinel = -1;             // follows every sequence in the arena; never a token id
constexpr uint32_t kLeafTag = 0x80000000u;  // child reference to an inline leaf: kLeafTag | position
constexpr uint32_t kMaxArena = 0x7FFFFFF0u; // arena positions stay below this (31 bits, kNil unused)

// A child reference: a Node id (< kLeafTag) or kLeafTag | position for an inline leaf.
using ChildRef = uint32_t;
inline bool is_inline_leaf(ChildRef c) { return c >= kLeafTag && c != kNil; }
constexpr size_t kMaxKeyLengths = 8;

struct Node {
  // Occurrences of string(node) among indexed positions (>= 2 for every live non-root node: count-1
  // leaves are inline). Root: the number of indexed positions. Free nodes: count 0, depth kFreeDepth.
  uint32_t count;
  // Arena position where the newest occurrence of string(node) starts. The edge label from the parent
  // is arena[ref + depth(parent), ref + depth). Root: unused.
  uint32_t ref;
  // Parent node id; kNil for the root and for free nodes (then it links the free list).
  uint32_t parent;
  // First slot of the child block in the slot pool, kNil when the node has no children. The block
  // holds block_capacity(num_children) entries {first token, ChildRef}: up to kSmallBlock children
  // sorted by token, beyond that an open-addressing table keyed by token (empty: ChildRef kNil).
  uint32_t block;
  // Head of the list of arena positions whose suffix ends exactly at this node, chained through
  // SuffixTree::term_next_ (kNil ends it). kNil when none (then the node has >= 2 children or is the
  // root). Unordered.
  uint32_t term;
  // Length of string(node): depth(parent) < depth <= max_depth. Root: 0.
  uint32_t depth;
  // Children in the block (Nodes and inline leaves), one per distinct next token.
  uint32_t num_children;
  // First token of the child with the highest count (ties: the smaller token); kNil when the node has
  // no children, and always for the root, which never drafts.
  uint32_t best;
};
static_assert(sizeof(Node) == 32, "Node must stay 32 bytes (two per cache line)");
constexpr uint32_t kFreeDepth = 0xFFFFFFFFu;

// Child blocks come in size classes of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... entries (about x1.5 each);
// blocks of more than kSmallBlock children are hash tables sized to a power of two at load <= 3/4.
constexpr uint32_t kSmallBlock = 8;
inline uint32_t block_class(uint32_t n) {
  if (n <= 4) return n == 0 ? 0 : n - 1;
  uint32_t h = 31 - __builtin_clz(n - 1);  // floor(log2(n - 1)) >= 2
  return (n <= (3u << (h - 1))) ? 2 * h : 2 * h + 1;
}
inline uint32_t capacity_of_class(uint32_t cls) {
  if (cls < 4) return cls + 1;
  if (cls % 2 == 0) return 3u << (cls / 2 - 1);
  return 1u << ((cls + 1) / 2);
}
inline uint32_t block_capacity(uint32_t n) {
  if (n <= kSmallBlock) return capacity_of_class(block_class(n));
  uint32_t want = n + n / 3 + 1, cap = 16;
  while (cap < want) cap <<= 1;
  return cap;
}

// One 8-byte entry of a child block: a = first token of the child's edge label, b = ChildRef (kNil:
// an empty hash entry; free blocks chain through b).
struct Slot {
  uint32_t a;
  uint32_t b;
};

// A position in the trie: `depth` tokens down from the root, inside the edge that ends at `node` (a
// ChildRef): depth(parent) < depth <= depth(node). The string at a locus has count(node) occurrences.
struct Locus {
  ChildRef node = kNil;
  uint32_t depth = 0;
};

// Draft tree in the DraftTree contract: parents[i] is -1 (child of the context's last token) or < i.
struct DraftOut {
  std::vector<Tok> token_ids;
  std::vector<int32_t> parents;
  std::vector<float> probs;
  double score = 0.0;     // sum of probs = expected number of accepted tokens
  uint32_t match_len = 0; // context tokens matched
  int32_t lead_kind = -1; // multi-source drafting: source kind of the first (most likely) node, -1 if none

  // Appends a node: parent is -1 or an earlier node's index.
  void push(Tok token, int32_t parent, double prob) {
    token_ids.push_back(token);
    parents.push_back(parent);
    probs.push_back((float)prob);
  }
};

struct SpecParams {
  uint32_t max_tokens = 16;
  double max_spec_factor = 1.0;
  double max_spec_offset = 0.0;
  double min_token_prob = 0.1;
  bool use_tree = false;
};

struct Sequence {
  int64_t id = -1;
  uint64_t created = 0;  // creation ordinal: eviction order
  uint32_t base = 0;     // arena position of token 0
  uint32_t len = 0;
  uint32_t cap = 0;      // reserved arena tokens; len < cap (arena[base + len] is kSentinel)
  // When tails_valid: tails[i] is where the suffix at position tails_first + i ends (a
  // ChildRef), for exactly the positions whose suffix is shorter than max_depth (the ones that grow
  // when the sequence is extended).
  bool tails_valid = false;
  uint32_t tails_first = 0;  // offset of the position tails[0] belongs to
  std::vector<ChildRef> tails;
};

// Exact-key table for one key length k: open addressing, linear probing, 8-byte slots holding the
// locus of a k-gram (the ChildRef of the shallowest node with depth >= k on its path) and the k-gram's
// 32-bit hash, whose home slot is hash32 * capacity >> 32. A hit is always verified against the arena,
// so collisions never give false matches.
struct KeyTable {
  uint32_t k = 0;
  uint64_t size = 0;
  PodBuffer<uint64_t> slots;  // (hash32 << 32) | node, node == kNil means empty
  size_t home(uint64_t h) const { return (size_t)(((h >> 32) * (uint64_t)slots.size()) >> 32); }
  size_t next(size_t i) const { return i + 1 == slots.size() ? 0 : i + 1; }
};

class SuffixTree {
 public:
  SuffixTree(uint32_t max_depth, const std::vector<uint32_t>& key_lengths);

  // ---- mutations (callers serialise them) ----
  // New sequence; std::invalid_argument if the id exists.
  void add(int64_t id, const Tok* tokens, size_t n);
  // Appends to a sequence, creating it when new.
  void extend(int64_t id, const Tok* tokens, size_t n);
  // std::invalid_argument naming the id when unknown.
  void remove(int64_t id);
  // Removes oldest-created sequences (never `keep_id`) while memory_bytes() > max_bytes.
  // Returns the number evicted.
  size_t evict_to(uint64_t max_bytes, int64_t keep_id);

  // ---- reads ----
  DraftOut speculate(const Tok* ctx, size_t n, const SpecParams& params) const;
  DraftOut speculate_exact(const Tok* ctx, size_t n, uint32_t max_tokens, uint32_t min_key_len) const;

  uint32_t max_depth() const { return max_depth_; }
  const std::vector<uint32_t>& key_lengths() const { return key_lengths_; }
  size_t num_sequences() const { return by_id_.size(); }
  uint64_t num_tokens() const { return nodes_[kRoot].count; }
  uint64_t memory_bytes() const;
  // Throws std::logic_error describing the first broken invariant.
  void check_integrity() const;
  std::vector<int64_t> sequence_ids() const;  // oldest (creation) first
  std::vector<Tok> get_sequence(int64_t id) const;
  bool contains(int64_t id) const { return by_id_.count(id) != 0; }
  // Sequences in arena (write) order, for serialization: rebuilding in this order reproduces the index.
  std::vector<const Sequence*> sequences_in_arena_order() const;
  const Tok* seq_tokens(const Sequence& s) const { return tok_.data() + s.base; }
  uint64_t next_created() const { return next_created_; }
  void set_next_created(uint64_t v) { next_created_ = v; }
  void set_created(int64_t id, uint64_t created);
  // Finds and keeps the ends of a sequence's short suffixes (what extend() keeps); for deserialize.
  void keep_tails(int64_t id) { materialize_tails(seqs_[by_id_.at(id)]); }
  bool has_tails(const Sequence& s) const { return s.tails_valid; }
  // Counters for tests and benchmarks.
  std::map<std::string, uint64_t> stats() const;

  // ---- trie access for native drafters in other files (read-only, under the index's shared lock) ----
  // Locus of the m tokens s[0, m), or false when that string is not indexed (or m > max_depth).
  bool locate(const Tok* s, size_t m, Locus* out) const;
  uint32_t count_of(ChildRef c) const { return is_inline_leaf(c) ? 1 : nodes_[c].count; }
  // Start of the newest occurrence of the string of c (its edge label is read from there).
  uint32_t ref_of(ChildRef c) const { return is_inline_leaf(c) ? c & ~kLeafTag : nodes_[c].ref; }
  // The token after the locus when the locus is inside its edge; kSentinel at a node boundary or at
  // the end of a leaf.
  Tok next_in_edge(const Locus& l) const;
  uint32_t num_children(ChildRef c) const;
  ChildRef find_child(ChildRef c, Tok t) const;
  // Most frequent child (ties: smaller token), kNil when none.
  ChildRef best_child(ChildRef c) const;
  template <typename F>  // f(Tok first_token, ChildRef child) for every child, in no particular order
  void for_each_child(ChildRef c, F&& f) const {
    if (is_inline_leaf(c) || nodes_[c].block == kNil) return;
    const uint32_t b = nodes_[c].block, cap = block_capacity(nodes_[c].num_children);
    for (uint32_t i = 0; i < cap; ++i) {
      const Slot& e = pool_[b + i];
      if (e.b != kNil) f((Tok)e.a, (ChildRef)e.b);
    }
  }
  // Exact-key lookup: the locus of key[0, k) through the table for key length k, verified.
  bool key_lookup(size_t key_slot, const Tok* key, Locus* out) const;
  // Continuation source for an exact key: arena position right after the newest occurrence of the
  // string at `l` that is followed by a token, and the end of that occurrence's sequence.
  bool newest_continuation(const Locus& l, uint32_t* pos, uint32_t* end) const;
  const Tok* arena() const { return tok_.data(); }

 private:
  // nodes
  uint32_t new_node(uint32_t count, uint32_t ref, uint32_t parent, uint32_t depth);
  void free_node(uint32_t id);
  // child blocks
  uint32_t alloc_block(uint32_t capacity);
  void free_block(uint32_t block, uint32_t capacity);
  void build_block(uint32_t parent, const std::vector<Slot>& entries);  // (re)lays out all children
  void add_child(uint32_t parent, Tok t, ChildRef child);
  void remove_child(uint32_t parent, Tok t);
  void replace_child(uint32_t parent, Tok t, ChildRef child);
  uint32_t find_entry(uint32_t id, Tok t) const;  // slot index within the block's entries, or kNil
  void bump_best(uint32_t parent, Tok t, uint32_t count);  // child t's count grew to count (or is new)
  void recompute_best(uint32_t id);
  Tok first_token(uint32_t child) const { return tok_[nodes_[child].ref + nodes_[nodes_[child].parent].depth]; }
  uint32_t leaf_depth(uint32_t pos) const;  // depth of the inline leaf of position pos
  void set_tail(uint32_t pos, ChildRef c);  // the sequence holding pos: its tail entry for pos, if kept
  ChildRef to_node(ChildRef leaf, uint32_t parent, uint32_t depth);  // inline leaf -> Node
  // terminal lists
  void term_add(uint32_t id, uint32_t pos);
  void term_remove(uint32_t id, uint32_t pos);
  // insertion / removal
  ChildRef advance(uint32_t p, ChildRef x, uint32_t d_from, uint32_t d_to);
  ChildRef end_suffix(uint32_t at, uint32_t p, uint32_t j, uint32_t d_to);  // at `at` or a new leaf below it
  // Prefetch stages for the suffix at position p (of a sequence ending at `end`): the walk's first
  // levels and the exact-key slots of its k-grams, issued a few suffixes ahead of its insertion.
  void prefetch_far(uint32_t p, uint32_t end);
  void prefetch_mid(uint32_t p, uint32_t end) const;
  void prefetch_near(uint32_t p, uint32_t end) const;
  void fuse_into_child(uint32_t x);
  void demote_to_leaf(uint32_t x);
  void remove_suffix(uint32_t p, uint32_t len, const Sequence& s, std::vector<uint32_t>* touched,
                     std::vector<uint32_t>* dirty);
  void materialize_tails(Sequence& s);
  uint32_t create_sequence(int64_t id, uint32_t cap);
  void unindex(Sequence& s);
  void remove_slot(uint32_t slot);
  void append_tokens(Sequence& s, const Tok* tokens, size_t n, bool keep_tails);
  uint32_t reserve_arena(uint32_t n);
  void compact_arena();
  // exact-key index
  static uint64_t hash_tokens(const Tok* t, size_t k);
  // hash_tokens(t, k) for every key length k <= max_k, in one pass (the k-grams share their start).
  void hash_key_prefixes(const Tok* t, uint32_t max_k, uint64_t* out) const;
  // Hashes of the k-grams starting at `pos`, from the insertion ring when cached there.
  const uint64_t* key_hashes_at(uint32_t pos, uint32_t max_k);
  void forget_hashes();
  // The k-grams (k in (lo, hi]) of node's string: new ones, moved from locus `from` to `to`, gone.
  // Entries are matched by hash and stored locus, so maintenance never reads the arena twice.
  void keys_insert_range(ChildRef node, uint32_t lo, uint32_t hi);
  void keys_move_range(ChildRef from, ChildRef to, uint32_t lo, uint32_t hi);
  void keys_erase_range(ChildRef node, uint32_t lo, uint32_t hi);
  // f(table, hash) for every key length k in (lo, hi], with the hash of the k-gram at arena position pos.
  template <typename F>
  void for_keys_in(uint32_t pos, uint32_t lo, uint32_t hi, F&& f);
  uint32_t key_slot_of(const KeyTable& table, uint64_t h, ChildRef node) const;  // slot holding node
  void key_rehash(KeyTable& table, size_t capacity);
  uint32_t key_find(const KeyTable& table, const Tok* key, uint64_t h) const;  // slot index or kNil
  // drafting (speculate.cc)
  class Speculation;  // one speculate() call: the context's loci by match length and the phases
  double draft_path(const Locus& l, uint32_t budget, double min_prob, DraftOut* out) const;
  double draft_tree(const Locus& l, uint32_t budget, double min_prob, DraftOut* out) const;

  uint32_t max_depth_;
  std::vector<uint32_t> key_lengths_;  // ascending, each in [1, max_depth]
  std::vector<KeyTable> keys_;         // one table per key length, same order
  // Recently hashed positions (insertion computes them ahead, for prefetching): ring by position.
  struct HashedPos {
    uint32_t pos = kNil;
    uint32_t max_k = 0;
    uint64_t h[kMaxKeyLengths];
  };
  static constexpr uint32_t kHashRing = 32;
  HashedPos hash_ring_[kHashRing];

  PodBuffer<Node> nodes_;
  uint32_t free_nodes_ = kNil;
  uint64_t live_nodes_ = 0;

  PodBuffer<Slot> pool_;
  std::vector<uint32_t> free_blocks_;  // head block per size class (indexed by block_class(capacity))
  uint64_t live_slots_ = 0;            // entries in live blocks (their capacity)

  PodBuffer<Tok> tok_;              // the arena
  PodBuffer<uint32_t> term_next_;   // parallel to tok_: next position in the same terminal list (Nodes only)
  uint64_t hole_tokens_ = 0;        // reserved arena tokens not owned by a live sequence

  std::vector<Sequence> seqs_;  // by slot
  std::vector<uint32_t> free_seq_slots_;
  std::unordered_map<int64_t, uint32_t> by_id_;
  std::map<uint64_t, uint32_t> by_created_;  // creation ordinal -> slot
  std::map<uint32_t, uint32_t> by_base_;     // arena base -> slot
  uint64_t next_created_ = 0;
  uint64_t tails_slots_ = 0;  // total tails entries materialised (memory accounting)
};

}  // namespace reprise
