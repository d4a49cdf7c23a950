// check_integrity(): recomputes every invariant of suffix_tree.h from scratch. O(nodes + tokens * depth).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "suffix_tree.h"

namespace reprise {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::logic_error("suffix index integrity: " + what); }

}  // namespace

void SuffixTree::check_integrity() const {
  const Tok* tok = tok_.data();
  // Sequences: maps agree, arena ranges are disjoint, tokens valid, sentinel in place.
  if (by_created_.size() != by_id_.size() || by_base_.size() != by_id_.size()) fail("sequence maps disagree in size");
  uint64_t live_tokens = 0, tails = 0, reserved = 0;
  uint64_t prev_end = 0;
  for (auto& [base, slot] : by_base_) {
    const Sequence& s = seqs_[slot];
    const std::string name = "sequence " + std::to_string(s.id);
    if (s.base != base || s.len >= s.cap || base < prev_end || (uint64_t)base + s.cap > tok_.size())
      fail(name + " has a bad arena range");
    if (by_id_.count(s.id) == 0 || by_id_.at(s.id) != slot) fail("sequence id map is stale");
    if (by_created_.count(s.created) == 0 || by_created_.at(s.created) != slot) fail("creation map is stale");
    if (s.created >= next_created_) fail("creation ordinal from the future");
    if (tok[s.base + s.len] != kSentinel) fail(name + " lacks its sentinel");
    for (uint32_t i = 0; i < s.len; ++i)
      if (tok[s.base + i] < 0) fail(name + " holds a negative token");
    prev_end = (uint64_t)base + s.cap;
    live_tokens += s.len;
    reserved += s.cap;
    tails += s.tails.size();
  }
  if (reserved + hole_tokens_ != tok_.size()) fail("arena holes miscounted");
  if (tails != tails_slots_) fail("tail count mismatch");
  if (nodes_[kRoot].count != live_tokens) fail("root count != indexed tokens");
  if (nodes_[kRoot].depth != 0 || nodes_[kRoot].parent != kNil || nodes_[kRoot].term != kNil) fail("bad root");
  auto seq_end = [&](uint32_t pos) -> uint64_t {
    auto it = by_base_.upper_bound(pos);
    if (it == by_base_.begin()) fail("position " + std::to_string(pos) + " outside every sequence");
    const Sequence& s = seqs_[std::prev(it)->second];
    if (pos >= s.base + s.len) fail("position " + std::to_string(pos) + " past its sequence");
    return (uint64_t)s.base + s.len;
  };

  std::vector<uint8_t> seen(nodes_.size(), 0);
  std::vector<uint8_t> term_seen(tok_.size(), 0);
  std::vector<uint32_t> stack{kRoot};
  uint64_t reachable = 0, slots = 0, term_total = 0;
  uint64_t keys_expected[kMaxKeyLengths] = {0};
  auto check_keys = [&](ChildRef c, uint32_t lo, uint32_t hi, const std::string& name) {
    for (size_t i = 0; i < keys_.size(); ++i) {
      const uint32_t k = keys_[i].k;
      if (k <= lo || k > hi) continue;
      ++keys_expected[i];
      Locus l;
      if (!key_lookup(i, tok + ref_of(c), &l) || l.node != c) fail(name + ": exact key k=" + std::to_string(k) + " missing");
    }
  };
  while (!stack.empty()) {
    const uint32_t v = stack.back();
    stack.pop_back();
    if (v >= nodes_.size() || seen[v]) fail("node " + std::to_string(v) + " reached twice or out of range");
    seen[v] = 1;
    ++reachable;
    const Node& n = nodes_[v];
    const std::string name = "node " + std::to_string(v);
    if (n.depth == kFreeDepth) fail(name + " is free but linked");
    uint64_t sum = 0;
    uint32_t newest = 0;
    bool any = false;
    for (uint32_t q = n.term; q != kNil; q = term_next_[q]) {
      if (q >= tok_.size() || term_seen[q]) fail(name + ": terminal position repeated or out of range");
      term_seen[q] = 1;
      ++sum;
      ++term_total;
      if (std::min<uint64_t>(max_depth_, seq_end(q) - q) != n.depth) fail(name + ": terminal position of wrong length");
      if (std::memcmp(tok + q, tok + n.ref, n.depth * sizeof(Tok)) != 0) fail(name + ": terminal string differs");
      newest = any ? std::max(newest, q) : q;
      any = true;
    }
    const uint32_t nc = num_children(v);
    Tok want_best = -1;
    uint32_t want_best_count = 0;
    if ((n.block == kNil) != (nc == 0)) fail(name + ": child block and child count disagree");
    if (n.block != kNil) {
      if ((uint64_t)n.block + block_capacity(nc) > pool_.size()) fail(name + ": child block out of range");
      slots += block_capacity(nc);
      uint32_t filled = 0;
      const uint32_t cap = block_capacity(nc);
      for (uint32_t i = 0; i < cap; ++i) {
        const Slot& e = pool_[n.block + i];
        if (e.b == kNil) {
          if (nc <= kSmallBlock && i < nc) fail(name + ": hole in a small child block");
          continue;
        }
        ++filled;
        if (nc <= kSmallBlock && i > 0 && (Tok)pool_[n.block + i - 1].a >= (Tok)e.a) fail(name + ": children not sorted");
        if (find_entry(v, (Tok)e.a) != i) fail(name + ": child not found by its token");
      }
      if (filled != nc) fail(name + ": child count " + std::to_string(nc) + " != entries " + std::to_string(filled));
    }
    for_each_child(v, [&](Tok t, ChildRef c) {
      const std::string cname = "child " + std::to_string(t) + " of " + name;
      const uint32_t r = ref_of(c);
      if (r >= tok_.size()) fail(cname + ": ref out of range");
      if (tok[r + n.depth] != t) fail(cname + ": entry token differs from the edge label");
      if (v != kRoot && std::memcmp(tok + r, tok + n.ref, n.depth * sizeof(Tok)) != 0)
        fail(cname + ": string does not extend its parent's");
      const uint32_t cc = count_of(c);
      if (want_best < 0 || cc > want_best_count || (cc == want_best_count && t < want_best)) {
        want_best = t;
        want_best_count = cc;
      }
      sum += cc;
      newest = any ? std::max(newest, r) : r;
      any = true;
      if (is_inline_leaf(c)) {
        if (term_seen[r]) fail(cname + ": inline leaf position also ends elsewhere");
        term_seen[r] = 1;
        ++term_total;
        const uint32_t d = leaf_depth(r);
        if (d <= n.depth || d != std::min<uint64_t>(max_depth_, seq_end(r) - r)) fail(cname + ": inline leaf of bad depth");
        check_keys(c, n.depth, d, cname);
      } else {
        if (c >= nodes_.size()) fail(cname + ": node out of range");
        const Node& cn = nodes_[c];
        if (cn.parent != v) fail(cname + " has the wrong parent");
        if (cn.depth == kFreeDepth || cn.depth <= n.depth || cn.depth > max_depth_) fail(cname + " has a bad depth");
        if (cn.count < 2) fail(cname + ": a Node reached by fewer than 2 positions");
        stack.push_back(c);
      }
    });
    if (v == kRoot) {
      if (n.best != kNil) fail("root has a best child");
      if (sum != n.count) fail("root count != number of suffixes");
      continue;
    }
    if (sum != n.count) fail(name + ": count " + std::to_string(n.count) + " != terminals + children " + std::to_string(sum));
    if (nc == 1 && n.term == kNil) fail(name + ": one child and no terminal position (not canonical)");
    if (nc == 0 && n.term == kNil) fail(name + ": leaf without terminal position");
    if (nc > 0 ? (Tok)n.best != want_best : n.best != kNil) fail(name + ": best child is stale");
    if (!any || newest != n.ref) fail(name + ": ref is not the newest occurrence");
    if ((uint64_t)n.ref + n.depth > seq_end(n.ref)) fail(name + ": label runs past its sequence");
    check_keys(v, nodes_[n.parent].depth, n.depth, name);
  }
  if (reachable != live_nodes_) fail("live node count " + std::to_string(live_nodes_) + " != reachable " + std::to_string(reachable));
  if (slots != live_slots_) fail("child slot count mismatch");
  if (term_total != live_tokens) fail("ending positions != indexed tokens");
  for (size_t i = 0; i < keys_.size(); ++i) {
    const KeyTable& t = keys_[i];
    uint64_t filled = 0;
    for (uint64_t slot : t.slots) {
      if ((uint32_t)slot == kNil) continue;
      ++filled;
      const ChildRef c = (ChildRef)slot;
      if (!is_inline_leaf(c) && (c >= nodes_.size() || !seen[c])) fail("exact key points to a dead node");
      if ((uint32_t)(hash_tokens(tok + ref_of(c), t.k) >> 32) != (uint32_t)(slot >> 32)) fail("exact key hash stale");
    }
    if (filled != t.size || t.size != keys_expected[i]) fail("exact key count mismatch for k=" + std::to_string(t.k));
  }
  // Tails: each is where its position's suffix ends.
  for (auto& [base, slot] : by_base_) {
    const Sequence& s = seqs_[slot];
    if (!s.tails_valid) {
      if (!s.tails.empty()) fail("invalid tails kept");
      continue;
    }
    const uint32_t want_first = s.len + 1 > max_depth_ ? s.len + 1 - max_depth_ : 0;
    if (s.tails_first != want_first || s.tails.size() != s.len - want_first)
      fail("sequence " + std::to_string(s.id) + " keeps the wrong tails");
    for (size_t i = 0; i < s.tails.size(); ++i) {
      const uint32_t pos = s.base + s.tails_first + (uint32_t)i;
      const ChildRef c = s.tails[i];
      bool found;
      if (is_inline_leaf(c)) {
        found = ref_of(c) == pos;
      } else {
        if (c >= nodes_.size() || !seen[c]) fail("tail points to a dead node");
        found = false;
        for (uint32_t q = nodes_[c].term; q != kNil && !found; q = term_next_[q]) found = q == pos;
      }
      if (!found) fail("sequence " + std::to_string(s.id) + ": tail does not end its position's suffix");
    }
  }
}

}  // namespace reprise
