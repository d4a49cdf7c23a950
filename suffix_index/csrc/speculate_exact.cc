// Drafting from the exact-key index: a copy of what followed the newest occurrence of the context's
// longest indexed key, past the trie's depth.
#include <algorithm>
#include <cmath>
#include <iterator>

#include "suffix_tree.h"

namespace reprise {

bool SuffixTree::newest_continuation(const Locus& l, uint32_t* pos, uint32_t* end) const {
  uint32_t start;
  if (next_in_edge(l) != kSentinel) {
    start = ref_of(l.node);  // every occurrence continues along the edge; ref is the newest
  } else {
    if (num_children(l.node) == 0) return false;
    start = 0;
    for_each_child(l.node, [&](Tok, ChildRef c) { start = std::max(start, ref_of(c)); });
  }
  *pos = start + l.depth;
  auto it = by_base_.upper_bound(*pos);
  const Sequence& s = seqs_[std::prev(it)->second];
  *end = s.base + s.len;
  return *pos < *end;
}

// Longest key first. The draft copies the continuation of the key's newest occurrence that has one.
// Probabilities: token i's is count(key t1..ti) / (occurrences of key followed by a token), exact while
// k + i <= max_depth; beyond the trie's depth the last exact value decays geometrically at the mean
// per-token rate observed over the exact part (no decay if the exact part never dropped).
DraftOut SuffixTree::speculate_exact(const Tok* ctx, size_t n, uint32_t max_tokens, uint32_t min_key_len) const {
  DraftOut out;
  for (size_t ti = keys_.size(); ti-- > 0;) {
    const uint32_t k = keys_[ti].k;
    if (k > n || k < min_key_len) continue;
    Locus l;
    if (!key_lookup(ti, ctx + n - k, &l)) continue;
    uint32_t pos, end;
    if (!newest_continuation(l, &pos, &end)) continue;
    double c_cont = 0;  // occurrences of the key followed by a token
    if (next_in_edge(l) != kSentinel)
      c_cont = count_of(l.node);
    else
      for_each_child(l.node, [&](Tok, ChildRef c) { c_cont += count_of(c); });
    const uint32_t len = std::min<uint32_t>(max_tokens, end - pos);
    Locus cur = l;
    double first = 0, last = 0, rate = 1.0;
    uint32_t exact = 0;
    for (uint32_t i = 0; i < len; ++i) {
      const Tok t = tok_[pos + i];
      double p;
      if (exact == i && cur.depth < max_depth_) {  // still inside the trie: exact count
        const Tok e = next_in_edge(cur);
        const ChildRef c = e == kSentinel ? find_child(cur.node, t) : (e == t ? cur.node : kNil);
        if (c != kNil) {
          cur = Locus{c, cur.depth + 1};
          p = count_of(c) / c_cont;
          if (exact == 0) first = p;
          last = p;
          ++exact;
          out.push(t, (int32_t)i - 1, p);
          out.score += p;
          continue;
        }
      }
      if (exact == i && exact >= 2 && first > 0) rate = std::pow(last / first, 1.0 / (exact - 1));
      p = last * std::pow(rate, (double)(i + 1 - exact));
      out.push(t, (int32_t)i - 1, p);
      out.score += p;
    }
    out.match_len = k;
    return out;
  }
  return out;
}

}  // namespace reprise
