// Drafting from the trie: SuffixDecoding's speculation (arXiv 2411.04975 sec. 3).
//
// For a match of the context's last m tokens (string s0, count c0), the probability of a draft node
// whose string is s0 + t1..ti is count(s0 t1..ti) / c0: the fraction of s0's occurrences that continue
// that way (the product of count(child) / count(parent) along the path telescopes to it).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <queue>

#include "bisect.h"
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

// The m in [lo, hi] (1 <= lo <= hi) with the highest f(m), the longest among ties.
template <typename F>
uint32_t longest_argmax(uint32_t lo, uint32_t hi, F&& f) {
  uint32_t best = hi;
  auto value = f(hi);
  for (uint32_t m = hi - 1; m >= lo; --m) {
    const auto v = f(m);
    if (v > value) {
      best = m;
      value = v;
    }
  }
  return best;
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
    out->push(t, (int32_t)out->token_ids.size() - 1, p);
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
    out->push(c.token, c.parent, c.prob);
    score += c.prob;
    expand(c.node, c.depth, idx);
  }
  return score;
}

// The speculation of one context: its suffixes' loci, found lazily by match length (each costs a walk
// from the root, so none is walked twice and most are never walked), the node budget of each length,
// and the phases speculate() runs. The winner is the highest (score, match length) over every length
// in [1, longest].
class SuffixTree::Speculation {
 public:
  Speculation(const SuffixTree& t, const Tok* ctx, size_t n, const SpecParams& params)
      : t_(t),
        ctx_(ctx),
        n_(n),
        params_(params),
        max_depth_(t.max_depth_),
        top_((uint32_t)std::min<size_t>(n, max_depth_)) {
    std::memset(state_, kUnlocated, top_ + 1);
  }

  // Longest indexed suffix of the context, at most max_depth tokens (0: none).
  uint32_t longest_match() {
    return longest_holding(top_, [&](uint32_t m) { return indexed(m); });
  }

  // budgets_[m] for m in [1, longest]: min(max_tokens, floor(m * factor + offset)), 0 when that is not
  // positive.
  void set_budgets(uint32_t longest) {
    for (uint32_t m = 1; m <= longest; ++m) {
      const double raw = std::floor(m * params_.max_spec_factor + params_.max_spec_offset);
      budgets_[m] = !(raw > 0) ? 0 : raw >= params_.max_tokens ? params_.max_tokens : (uint32_t)raw;
    }
  }

  // Lengths whose suffix occurs once draft the same continuation, the tokens after that occurrence,
  // each with probability 1: a chain whose score is arithmetic, min(budget, depth room, tokens left).
  // Occurring once is monotone in m, so those lengths are a range ending at `longest`. Drafts the best
  // chain of the range [from, longest] into the empty *best and returns from (longest + 1 when the
  // longest match occurs more than once). Lengths below from, unique or not, are left to
  // draft_by_bound.
  uint32_t draft_unique(uint32_t longest, DraftOut* best) {
    const ChildRef node = locus(longest).node;
    if (t_.count_of(node) != 1) return longest + 1;
    const uint32_t end = t_.ref_of(node) + longest;  // where the single occurrence ends
    uint32_t left = 0;                               // tokens after it, up to the depth cap
    while (left < max_depth_ && t_.tok_[end + left] != kSentinel) ++left;
    const auto chain_length = [this, left](uint32_t m) {
      return std::min(std::min(budgets_[m], max_depth_ - m), left);
    };
    const uint32_t from = unique_from(longest, chain_length);
    const uint32_t m_best = longest_argmax(from, longest, chain_length);
    const uint32_t length = chain_length(m_best);
    if (length > 0) {
      for (uint32_t i = 0; i < length; ++i) best->push(t_.tok_[end + i], (int32_t)i - 1, 1.0);
      best->score = length;
      best->match_len = m_best;
    }
    return from;
  }

  // Lengths [1, last], each drafted exactly unless an upper bound on its score (node count, times the
  // first token's probability once located) shows it cannot beat *best. They are tried in decreasing
  // order of that bound, so a strong draft found early lets the rest be skipped without a walk.
  void draft_by_bound(uint32_t last, DraftOut* best) {
    if (last == 0) return;
    ByBound order(*this, last);
    DraftOut cand;
    for (uint32_t m; order.next(&m);) {
      const uint32_t nodes = bound(m);
      if (nodes * kBoundSlack < best->score) break;  // bounds only decrease from here
      if (nodes == 0 || !could_beat(nodes, m, *best)) continue;
      if (!indexed(m)) continue;  // cannot happen: shorter suffixes of a match occur
      const double p1 = first_token_bound(locus(m));
      if (p1 < params_.min_token_prob || !could_beat(p1 * nodes, m, *best)) continue;
      const double score = draft(m, &cand);
      if (beats(score, m, *best)) {
        std::swap(*best, cand);
        best->score = score;
        best->match_len = m;
      }
    }
  }

 private:
  static constexpr uint8_t kUnlocated = 0, kIndexed = 1, kAbsent = 2;

  // Whether the context's last m tokens are indexed; their locus is then locus(m).
  bool indexed(uint32_t m) {
    if (state_[m] == kUnlocated) {
      new (&loci_[m]) Locus();
      state_[m] = t_.locate(ctx_ + n_ - m, m, &loci_[m]) ? kIndexed : kAbsent;
    }
    return state_[m] == kIndexed;
  }
  const Locus& locus(uint32_t m) const { return loci_[m]; }
  bool occurs_once(uint32_t m) { return indexed(m) && t_.count_of(loci_[m].node) == 1; }

  // Most nodes a draft matching m tokens can have: its budget, and in path mode its depth room.
  uint32_t bound(uint32_t m) const {
    const uint32_t room = max_depth_ - m;
    return room == 0 ? 0 : params_.use_tree ? budgets_[m] : std::min(budgets_[m], room);
  }

  // Whether a draft matching m tokens with this score wins over best: a higher score, or an equal,
  // positive one from a longer match.
  static bool beats(double score, uint32_t m, const DraftOut& best) {
    return score > best.score || (score == best.score && score > 0 && m > best.match_len);
  }

  // Whether a draft matching m tokens whose score is at most `bound` could beat best.
  static bool could_beat(double bound, uint32_t m, const DraftOut& best) {
    const double b = bound * kBoundSlack;
    return b > best.score || (b >= best.score && m > best.match_len && best.score > 0);
  }

  // Every probability of a draft from l is at most its first token's: 1 inside an edge, else the
  // most frequent child's share.
  double first_token_bound(const Locus& l) const {
    if (t_.next_in_edge(l) != kSentinel) return 1.0;
    const ChildRef b = t_.best_child(l.node);
    return b == kNil ? 0.0 : t_.count_of(b) / (double)t_.count_of(l.node);
  }

  // The draft matching m tokens, into *out (cleared first); returns its score.
  double draft(uint32_t m, DraftOut* out) const {
    out->token_ids.clear();
    out->parents.clear();
    out->probs.clear();
    return params_.use_tree ? t_.draft_tree(loci_[m], budgets_[m], params_.min_token_prob, out)
                            : t_.draft_path(loci_[m], budgets_[m], params_.min_token_prob, out);
  }

  // Where draft_unique's range starts. A chain's length rises then falls with m (the budget grows, the
  // depth room shrinks), so the best unique length is the chain's peak if the peak occurs once, else
  // the shortest unique length (found by bisection). Lengths shorter than a unique peak are left to
  // draft_by_bound, unless many of them might still beat it: then uniqueness is bisected for (a few
  // walks) rather than each of them walked and drafted.
  template <typename ChainLength>
  uint32_t unique_from(uint32_t longest, ChainLength&& chain_length) {
    const auto once = [&](uint32_t m) { return occurs_once(m); };
    const uint32_t peak = longest_argmax(1, longest, chain_length);
    if (!once(peak)) return first_holding(peak + 1, longest, once);
    const uint32_t peak_length = chain_length(peak);
    uint32_t open = 0;
    for (uint32_t m = 1; m < peak; ++m) open += bound(m) > peak_length;
    return open > 4 ? first_holding(1, peak, once) : peak;
  }

  // Match lengths [1, last] in decreasing order of bound(m), lazily. The tree bound only grows with m,
  // so m descends; the path bound rises then falls (the budget grows, the depth room shrinks), so two
  // cursors walk away from its peak, the longer side first on ties.
  class ByBound {
   public:
    ByBound(const Speculation& s, uint32_t last) : s_(s), last_(last) {
      const uint32_t peak =
          s.params_.use_tree ? last : longest_argmax(1, last, [&](uint32_t m) { return s.bound(m); });
      down_ = peak;
      up_ = peak + 1;
    }
    bool next(uint32_t* m) {
      if (up_ <= last_ && (down_ == 0 || s_.bound(up_) >= s_.bound(down_)))
        *m = up_++;
      else if (down_ > 0)
        *m = down_--;
      else
        return false;
      return true;
    }

   private:
    const Speculation& s_;
    const uint32_t last_;
    uint32_t down_, up_;  // next lengths to offer: down_ (m <= the peak, 0: none left), up_ (m > it)
  };

  const SuffixTree& t_;
  const Tok* ctx_;
  const size_t n_;
  const SpecParams& params_;
  const uint32_t max_depth_;  // the tree's, by value: the phases' loops read it without going through t_
  const uint32_t top_;  // longest length worth locating: min(n, max_depth)
  // Per length in [0, top_]: kUnlocated, kIndexed or kAbsent. loci_[m] is read only once state_[m] is
  // kIndexed, so its storage is left uninitialised (a default-constructed array would cost a write per
  // length on every call).
  uint8_t state_[kMaxDepthLimit + 1];
  alignas(Locus) unsigned char loci_raw_[sizeof(Locus) * (kMaxDepthLimit + 1)];
  Locus* const loci_ = reinterpret_cast<Locus*>(loci_raw_);
  uint32_t budgets_[kMaxDepthLimit + 1];  // valid for [1, longest] after set_budgets
};

DraftOut SuffixTree::speculate(const Tok* ctx, size_t n, const SpecParams& params) const {
  DraftOut best;
  if (n == 0 || num_tokens() == 0) return best;
  Speculation s(*this, ctx, n, params);
  const uint32_t longest = s.longest_match();
  best.match_len = longest;  // an empty draft reports the longest match
  if (longest == 0) return best;
  s.set_budgets(longest);
  const uint32_t unique_from = s.draft_unique(longest, &best);  // lengths [unique_from, longest]
  s.draft_by_bound(unique_from - 1, &best);                     // lengths [1, unique_from)
  return best;
}

}  // namespace reprise
