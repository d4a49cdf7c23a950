// Drafting from the trie (SuffixDecoding's speculation, arXiv 2411.04975 sec. 3) and from the
// exact-key index.
//
// For a match of the context's last m tokens (string s0, count c0), the probability of a draft node
// whose string is s0 + t1..ti is count(s0 t1..ti) / c0: the fraction of s0's occurrences that continue
// that way (the product of count(child) / count(parent) along the path telescopes to it).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <queue>

#include "suffix_tree.h"

namespace reprise {
namespace {

// A relative slack so a bound computed as a product never prunes a sum that rounds above it.
constexpr double kBoundSlack = 1.0 + 1e-9;

struct Candidate {
  double prob;
  uint32_t seq;     // push order: ties in prob go to the earlier push
  uint32_t node;    // the token lies on the edge ending at node ...
  uint32_t depth;   // ... at string length depth (the token is the depth-th character)
  int32_t parent;   // draft index of the parent, -1 for the context's last token
  Tok token;
};

struct WorseCandidate {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.prob != b.prob ? a.prob < b.prob : a.seq > b.seq;
  }
};

inline void push_token(DraftOut* out, Tok t, int32_t parent, double p) {
  out->token_ids.push_back(t);
  out->parents.push_back(parent);
  out->probs.push_back((float)p);
}

}  // namespace

bool SuffixTree::locate(const Tok* s, size_t m, Locus* out) const {
  if (m > max_depth_) return false;
  if (m == 0) {
    *out = Locus{kRoot, 0};
    return true;
  }
  const Tok* tok = tok_.data();
  // Start below the trie's wide top levels when an exact-key table covers a prefix of s: the table
  // holds every indexed k-gram, so a miss there also proves s is not indexed.
  uint32_t node = kRoot, d = 0;
  for (size_t ki = keys_.size(); ki-- > 0;) {
    const uint32_t k = keys_[ki].k;
    if (k > m) continue;
    Locus l;
    if (!key_lookup(ki, s, &l)) return false;
    if (is_inline_leaf(l.node) || nodes_[l.node].depth >= m) {  // s ends on this edge
      const Tok* a = tok + ref_of(l.node);
      for (uint32_t j = k; j < m; ++j)
        if (a[j] != s[j]) return false;
      *out = Locus{l.node, (uint32_t)m};
      return true;
    }
    const Tok* a = tok + nodes_[l.node].ref;
    for (uint32_t j = k; j < nodes_[l.node].depth; ++j)
      if (a[j] != s[j]) return false;
    node = l.node;
    d = nodes_[l.node].depth;
    break;
  }
  for (;;) {
    const ChildRef c = find_child(node, s[d]);
    if (c == kNil) return false;
    const Tok* a = tok + ref_of(c);
    if (is_inline_leaf(c)) {  // the leaf's string ends at its sequence's sentinel, which never matches
      for (uint32_t j = d + 1; j < m; ++j)
        if (a[j] != s[j]) return false;
      *out = Locus{c, (uint32_t)m};
      return true;
    }
    const uint32_t depth = nodes_[c].depth;
    const uint32_t lim = std::min<uint32_t>(depth, (uint32_t)m);
    for (uint32_t j = d + 1; j < lim; ++j)
      if (a[j] != s[j]) return false;
    if (depth >= m) {
      *out = Locus{c, (uint32_t)m};
      return true;
    }
    node = c;
    d = depth;
  }
}

Tok SuffixTree::next_in_edge(const Locus& l) const {
  if (l.depth >= max_depth_) return kSentinel;
  if (is_inline_leaf(l.node)) return tok_[(l.node & ~kLeafTag) + l.depth];
  const Node& n = nodes_[l.node];
  return l.depth < n.depth ? tok_[n.ref + l.depth] : kSentinel;
}

uint32_t SuffixTree::longest_match(const Tok* ctx, size_t n) const {
  // Matching is monotone: if the last m tokens occur, so do the last m - 1.
  uint32_t lo = 0, hi = (uint32_t)std::min<size_t>(n, max_depth_);
  Locus l;
  if (hi > 0 && locate(ctx + n - hi, hi, &l)) return hi;
  if (hi > 0) --hi;
  while (lo < hi) {
    uint32_t mid = (lo + hi + 1) / 2;
    if (locate(ctx + n - mid, mid, &l))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

double SuffixTree::draft_path(const Locus& l, uint32_t budget, double min_prob, DraftOut* out) const {
  const double c0 = count_of(l.node);
  Locus cur = l;
  double score = 0.0;
  while (out->token_ids.size() < budget && cur.depth < max_depth_) {
    Tok t = next_in_edge(cur);
    if (t == kSentinel) {  // at a node: follow the most frequent child
      const ChildRef b = best_child(cur.node);
      if (b == kNil) break;
      cur.node = b;
      t = tok_[ref_of(b) + cur.depth];
    }
    const double p = count_of(cur.node) / c0;
    if (p < min_prob) break;
    push_token(out, t, (int32_t)out->token_ids.size() - 1, p);
    score += p;
    ++cur.depth;
  }
  return score;
}

double SuffixTree::draft_tree(const Locus& l, uint32_t budget, double min_prob, DraftOut* out) const {
  const double c0 = count_of(l.node);
  std::priority_queue<Candidate, std::vector<Candidate>, WorseCandidate> heap;
  std::vector<std::pair<uint32_t, Slot>> kids;  // (count, {token, child})
  uint32_t seq = 0;
  // Candidates for the token after the locus (node, d), children of draft node `parent`.
  auto expand = [&](ChildRef node, uint32_t d, int32_t parent) {
    if (d >= max_depth_) return;
    const Tok t = next_in_edge(Locus{node, d});
    if (t != kSentinel) {
      const double p = count_of(node) / c0;
      if (p >= min_prob) heap.push(Candidate{p, seq++, node, d + 1, parent, t});
      return;
    }
    const ChildRef b = best_child(node);
    if (b == kNil || count_of(b) / c0 < min_prob) return;
    kids.clear();
    for_each_child(node, [&](Tok ct, ChildRef c) {
      if (count_of(c) / c0 >= min_prob) kids.push_back({count_of(c), Slot{(uint32_t)ct, c}});
    });
    // count descending, then first token ascending
    std::sort(kids.begin(), kids.end(), [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first > y.first : x.second.a < y.second.a;
    });
    for (const auto& [count, e] : kids) heap.push(Candidate{count / c0, seq++, e.b, d + 1, parent, (Tok)e.a});
  };
  expand(l.node, l.depth, -1);
  double score = 0.0;
  while (!heap.empty() && out->token_ids.size() < budget) {
    const Candidate c = heap.top();
    heap.pop();
    const int32_t idx = (int32_t)out->token_ids.size();
    push_token(out, c.token, c.parent, c.prob);
    score += c.prob;
    expand(c.node, c.depth, idx);
  }
  return score;
}

DraftOut SuffixTree::speculate(const Tok* ctx, size_t n, const SpecParams& params) const {
  DraftOut best;
  if (n == 0 || nodes_[kRoot].count == 0) return best;
  const uint32_t top = (uint32_t)std::min<size_t>(n, max_depth_);
  // Loci found so far, by match length (each costs a walk from the root). Raw storage: only the
  // entries `have` marks are ever read, so nothing is initialised up front.
  alignas(Locus) unsigned char loci_raw[sizeof(Locus) * (kMaxDepthLimit + 1)];
  Locus* loci = reinterpret_cast<Locus*>(loci_raw);
  uint8_t have[kMaxDepthLimit + 1];
  std::memset(have, 0, top + 1);
  auto find = [&](uint32_t m) -> int {  // 1 found, 0 not indexed
    if (!have[m]) {
      new (&loci[m]) Locus();
      have[m] = locate(ctx + n - m, m, &loci[m]) ? 1 : 2;
    }
    return have[m] == 1;
  };
  // Longest indexed suffix of the context (matching is monotone in m).
  uint32_t longest = 0;
  if (find(top)) {
    longest = top;
  } else {
    uint32_t lo = 0, hi = top - 1;
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) / 2;
      if (find(mid))
        lo = mid;
      else
        hi = mid - 1;
    }
    longest = lo;
  }
  best.match_len = longest;  // an empty draft reports the longest match
  if (longest == 0) return best;
  uint32_t budgets[kMaxDepthLimit + 1];
  for (uint32_t m = 1; m <= longest; ++m) {
    const double raw = std::floor(m * params.max_spec_factor + params.max_spec_offset);
    budgets[m] = !(raw > 0) ? 0 : raw >= params.max_tokens ? params.max_tokens : (uint32_t)raw;
  }
  // Most nodes a draft for match length m can have: its budget, and in path mode its depth room.
  auto bound_of = [&](uint32_t m) -> uint32_t {
    const uint32_t room = max_depth_ - m;
    return room == 0 ? 0 : params.use_tree ? budgets[m] : std::min(budgets[m], room);
  };
  // The winner is the highest (score, match length). Lengths are tried in decreasing order of an
  // upper bound on their score (node count, times the first token's probability once located), so
  // a strong draft found early lets the rest be skipped without a walk; every length whose bound
  // could still win is evaluated exactly.
  auto can_win = [&](double bound, uint32_t m) {
    const double b = bound * kBoundSlack;
    return b > best.score || (b >= best.score && m > best.match_len && best.score > 0);
  };
  // Lengths whose suffix occurs once (all m in [unique_from, longest]: count is monotone) draft the
  // same continuation with probability 1, so their scores are min(budget, depth room, tokens left).
  uint32_t unique_from = longest + 1;
  if (count_of(loci[longest].node) == 1) {
    const uint32_t end = ref_of(loci[longest].node) + longest;  // where the single occurrence ends
    uint32_t left = 0;
    while (left < max_depth_ && tok_[end + left] != kSentinel) ++left;
    auto unique_score = [&](uint32_t m) -> uint32_t {  // one continuation: a chain
      return std::min(std::min(budgets[m], max_depth_ - m), left);
    };
    // Scores along m rise then fall; the best unique length is the peak if the peak is unique, else
    // the shortest unique length (found by bisection).
    uint32_t peak = longest, peak_score = unique_score(longest);
    for (uint32_t m = longest - 1; m >= 1; --m) {
      const uint32_t sc = unique_score(m);
      if (sc > peak_score) {
        peak = m;
        peak_score = sc;
      }
    }
    if (find(peak) && count_of(loci[peak].node) == 1) {
      unique_from = peak;
      // Shorter lengths that might still beat the peak: when many, bisect for where uniqueness ends
      // (a few walks) rather than walk and draft each of them.
      uint32_t open = 0;
      for (uint32_t m = 1; m < peak; ++m) open += bound_of(m) > peak_score;
      if (open > 4) {
        uint32_t lo = 1, hi = peak;
        while (lo < hi) {
          const uint32_t mid = (lo + hi) / 2;
          if (find(mid) && count_of(loci[mid].node) == 1)
            hi = mid;
          else
            lo = mid + 1;
        }
        unique_from = lo;
      }
    } else {
      uint32_t lo = peak + 1, hi = longest;  // smallest unique length in (peak, longest]
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (find(mid) && count_of(loci[mid].node) == 1)
          hi = mid;
        else
          lo = mid + 1;
      }
      unique_from = lo;
    }
    uint32_t m_best = longest, s_best = unique_score(longest);
    for (uint32_t m = longest; m > unique_from; --m) {
      if (unique_score(m - 1) > s_best) {
        s_best = unique_score(m - 1);
        m_best = m - 1;
      }
    }
    if (s_best > 0) {  // the path the single occurrence continues with
      for (uint32_t i = 0; i < s_best; ++i) push_token(&best, tok_[end + i], (int32_t)i - 1, 1.0);
      best.score = s_best;
      best.match_len = m_best;
    }
  }
  // Candidates m < unique_from in decreasing bound order, lazily: the path bound rises then falls in
  // m (budget grows, depth room shrinks), so two cursors walk away from its peak; the tree bound only
  // grows, so m descends.
  const uint32_t last = unique_from - 1;
  uint32_t peak = last;
  if (!params.use_tree)
    for (uint32_t m = last; m >= 1; --m)
      if (bound_of(m) > bound_of(peak)) peak = m;
  uint32_t down = peak, up = peak + 1;  // next candidates: down (m <= peak), up (m > peak)
  DraftOut cand;
  while (down >= 1 || up <= last) {
    uint32_t m;
    if (up <= last && (down < 1 || bound_of(up) >= bound_of(down)))
      m = up++;
    else
      m = down--;
    const uint32_t bound = bound_of(m);
    if (bound * kBoundSlack < best.score) break;  // bounds only decrease from here
    if (bound == 0 || !can_win(bound, m)) continue;
    if (!find(m)) continue;  // cannot happen: shorter suffixes of a match occur
    const Locus& l = loci[m];
    double p1 = 1.0;  // every draft probability is <= the first token's best
    if (next_in_edge(l) == kSentinel) {
      const ChildRef b = best_child(l.node);
      p1 = b == kNil ? 0.0 : count_of(b) / (double)count_of(l.node);
    }
    if (p1 < params.min_token_prob || !can_win(p1 * bound, m)) continue;
    cand.token_ids.clear();
    cand.parents.clear();
    cand.probs.clear();
    const double score = params.use_tree ? draft_tree(l, budgets[m], params.min_token_prob, &cand)
                                         : draft_path(l, budgets[m], params.min_token_prob, &cand);
    if (score > best.score || (score == best.score && score > 0 && m > best.match_len)) {
      std::swap(best, cand);
      best.score = score;
      best.match_len = m;
    }
  }
  return best;
}

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
          push_token(&out, t, (int32_t)i - 1, p);
          out.score += p;
          continue;
        }
      }
      if (exact == i && exact >= 2 && first > 0) rate = std::pow(last / first, 1.0 / (exact - 1));
      p = last * std::pow(rate, (double)(i + 1 - exact));
      push_token(&out, t, (int32_t)i - 1, p);
      out.score += p;
    }
    out.match_len = k;
    return out;
  }
  return out;
}

}  // namespace reprise
