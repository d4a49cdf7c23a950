// Multi-source calibrated drafting (see drafter.h for the design and its measurements).
#include "drafter.h"

#include <algorithm>
#include <queue>

namespace reprise {

// ---- calibration ----

namespace {
// Prior hit rate of a candidate by match-length bucket, and factors for its count share and for
// continuing the newest occurrence. Generic shapes (rising with the match); the per-tenant table
// learns the actual rates within a few hundred steps.
constexpr double kPriorMatch[Calibration::kMatch] = {0.3, 0.45, 0.6, 0.7, 0.82, 0.9, 0.96, 0.98};
constexpr double kPriorShare[Calibration::kShare] = {1.0, 0.85, 0.65, 0.45, 0.25};
constexpr double kPriorNewest[Calibration::kNewest] = {0.9, 1.1};
}  // namespace

Calibration::Calibration(double prior_strength) : prior_strength_(prior_strength) {
  if (!(prior_strength > 0)) throw std::invalid_argument("calibration prior strength must be > 0");
  hits_.assign(kCells, 0.f);
  trials_.assign(kCells, 0.f);
  for (int k = 0; k < kMaxSourceKinds; ++k)
    for (int m = 0; m < kMatch; ++m)
      for (int s = 0; s < kShare; ++s)
        for (int w = 0; w < kNewest; ++w)
          for (int c = 0; c < kCount; ++c) {
            DraftFeature f{(uint8_t)k, (uint8_t)m, (uint8_t)s, (uint8_t)w, (uint8_t)c};
            double p = std::min(0.99, kPriorMatch[m] * kPriorShare[s] * kPriorNewest[w]);
            trials_[cell(f)] = (float)prior_strength;
            hits_[cell(f)] = (float)(prior_strength * p);
          }
}

void Calibration::observe(const DraftFeature& f, bool hit) {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t i = cell(f);
  trials_[i] += 1.f;
  hits_[i] += hit ? 1.f : 0.f;
  observations_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<float> Calibration::table() const {
  std::vector<float> t(hits_);
  t.insert(t.end(), trials_.begin(), trials_.end());
  return t;
}

void Calibration::set_table(const std::vector<float>& t) {
  if (t.size() != 2 * (size_t)kCells) throw std::invalid_argument("calibration table has the wrong size");
  for (size_t i = 0; i < (size_t)kCells; ++i)
    if (!(t[kCells + i] > 0) || !(t[i] >= 0) || t[i] > t[kCells + i])
      throw std::invalid_argument("calibration table cell " + std::to_string(i) + " is not a hit rate");
  std::lock_guard<std::mutex> lock(mutex_);
  std::copy(t.begin(), t.begin() + kCells, hits_.begin());
  std::copy(t.begin() + kCells, t.end(), trials_.begin());
}

uint8_t Calibration::match_bucket(uint32_t m) {
  if (m <= 2) return m == 0 ? 0 : (uint8_t)(m - 1);
  uint8_t b = 2;
  for (uint32_t hi = 4; m > hi && b < kMatch - 1; hi *= 2) ++b;
  return b;
}
uint8_t Calibration::share_bucket(double s) { return s >= 0.999 ? 0 : s >= 0.75 ? 1 : s >= 0.5 ? 2 : s >= 0.25 ? 3 : 4; }
uint8_t Calibration::count_bucket(double c) { return c <= 1 ? 0 : c <= 3 ? 1 : c <= 10 ? 2 : 3; }

// ---- drafting ----

namespace {

// A position in one source: a trie locus (node != kNil), or a copy position in its arena (node == kNil)
// once the trie's depth is used up. `match` = context tokens matched so far, draft tokens included.
struct Cursor {
  uint32_t source;
  ChildRef node;
  uint32_t depth;   // locus depth (trie cursor)
  uint32_t pos;     // arena position of the next token (copy cursor)
  uint32_t copied;  // tokens copied past the trie's depth
  uint32_t match;
};

struct Candidate {
  Tok token;
  double estimate;
  Cursor next;
  DraftFeature feature;
};

// Occurrences of the locus string followed by a token (terminal occurrences, such as the context's own
// position in a request's index, do not count).
double continuing(const SuffixTree& t, const Locus& l) {
  if (t.next_in_edge(l) != kSentinel) return (double)t.count_of(l.node);
  double total = 0;
  t.for_each_child(l.node, [&](Tok, ChildRef c) { total += t.count_of(c); });
  return total;
}

// The largest m in [1, hi] whose locus has more than `floor` continuing occurrences (0 if none). The
// continuing count never grows with m (a longer string's occurrences end where its suffix's do).
uint32_t longest_with_more(const SuffixTree& t, const Tok* ctx, size_t n, uint32_t hi, double floor, Locus* out,
                           double* cont) {
  uint32_t lo = 0;
  Locus l;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (t.locate(ctx + n - mid, mid, &l) && continuing(t, l) > floor)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo == 0) return 0;
  t.locate(ctx + n - lo, lo, out);
  *cont = continuing(t, *out);
  return lo;
}

class Builder {
 public:
  Builder(const std::vector<DraftSource>& sources, const DrafterParams& p, const Calibration& cal)
      : sources_(sources), params_(p), cal_(cal) {}

  DraftOut run(const Tok* ctx, const Tok* ctx_canon, size_t n, std::vector<RootObservation>* obs) {
    DraftOut out;
    for (uint32_t s = 0; s < sources_.size(); ++s) seed(s, sources_[s].canonical ? ctx_canon : ctx, n, &out);
    if (pool_.empty()) return out;
    expand(0, (uint32_t)pool_.size(), -1, 1.0, obs);
    while (!heap_.empty() && out.token_ids.size() < params_.budget) {
      const Item it = heap_.top();
      heap_.pop();
      const int32_t index = (int32_t)out.token_ids.size();
      out.token_ids.push_back(it.token);
      out.parents.push_back(it.parent);
      out.probs.push_back((float)it.prob);
      out.score += it.prob;
      expand(it.begin, it.end, index, it.prob, nullptr);
    }
    return out;
  }

 private:
  struct Item {
    double prob;
    uint32_t order;  // push order breaks ties: earlier first
    int32_t parent;
    Tok token;
    uint32_t begin, end;  // the node's cursors in pool_
  };
  struct Worse {
    bool operator()(const Item& a, const Item& b) const { return a.prob != b.prob ? a.prob < b.prob : a.order > b.order; }
  };

  // Root cursors of one source: its longest match with a continuation, then shorter matches (at most
  // half as long each time) that have more continuing occurrences.
  void seed(uint32_t s, const Tok* ctx, size_t n, DraftOut* out) {
    const SuffixTree& t = *sources_[s].tree;
    if (n == 0 || t.num_tokens() == 0) return;
    uint32_t hi = std::min<uint32_t>((uint32_t)std::min<size_t>(n, t.max_depth()), t.longest_match(ctx, n));
    double floor = 0;
    for (uint32_t level = 0; level < params_.levels && hi > 0; ++level) {
      Locus l;
      double cont = 0;
      const uint32_t m = longest_with_more(t, ctx, n, hi, floor, &l, &cont);
      if (m == 0) break;
      pool_.push_back(Cursor{s, l.node, l.depth, 0, 0, m});
      if (level == 0) out->match_len = std::max(out->match_len, m);
      floor = cont;
      hi = m / 2;
    }
  }

  void candidates(const Cursor& c) {
    const DraftSource& src = sources_[c.source];
    const SuffixTree& t = *src.tree;
    const uint8_t mb = Calibration::match_bucket(c.match);
    if (c.node == kNil || c.depth >= t.max_depth()) {  // copy the newest occurrence past the trie's depth
      const uint32_t pos = c.node == kNil ? c.pos : t.ref_of(c.node) + c.depth;
      const Tok tok = t.arena()[pos];
      if (tok == kSentinel || c.copied >= params_.max_copy) return;
      DraftFeature f{src.kind, mb, 0, 1, 0};
      kids_.push_back(Candidate{tok, cal_.estimate(f), Cursor{c.source, kNil, 0, pos + 1, c.copied + 1, c.match + 1}, f});
      return;
    }
    const Locus l{c.node, c.depth};
    const Tok inside = t.next_in_edge(l);
    if (inside != kSentinel) {  // every occurrence continues along the edge
      DraftFeature f{src.kind, mb, 0, 1, Calibration::count_bucket(t.count_of(c.node))};
      kids_.push_back(Candidate{inside, cal_.estimate(f), Cursor{c.source, c.node, c.depth + 1, 0, 0, c.match + 1}, f});
      return;
    }
    double total = 0;
    uint32_t newest = 0;
    t.for_each_child(c.node, [&](Tok, ChildRef ch) {
      total += t.count_of(ch);
      newest = std::max(newest, t.ref_of(ch));
    });
    if (total <= 0) return;
    const uint8_t cb = Calibration::count_bucket(total);
    t.for_each_child(c.node, [&](Tok tok, ChildRef ch) {
      const double share = t.count_of(ch) / total;
      DraftFeature f{src.kind, mb, Calibration::share_bucket(share), (uint8_t)(t.ref_of(ch) == newest), cb};
      kids_.push_back(Candidate{tok, cal_.estimate(f), Cursor{c.source, ch, c.depth + 1, 0, 0, c.match + 1}, f});
    });
  }

  // Children of the draft node whose cursors are pool_[begin, end): one per distinct token, its
  // estimate the best of the cursors predicting it.
  void expand(uint32_t begin, uint32_t end, int32_t parent, double prob, std::vector<RootObservation>* obs) {
    kids_.clear();
    for (uint32_t i = begin; i < end; ++i) candidates(pool_[i]);
    if (obs)
      for (const Candidate& k : kids_) obs->push_back(RootObservation{k.feature, k.token, sources_[k.next.source].canonical});
    kids_.erase(std::remove_if(kids_.begin(), kids_.end(), [](const Candidate& k) { return k.token >= kClassBase; }),
                kids_.end());
    std::sort(kids_.begin(), kids_.end(), [](const Candidate& a, const Candidate& b) { return a.token < b.token; });
    for (size_t i = 0; i < kids_.size();) {
      const uint32_t first = (uint32_t)pool_.size();
      double best = 0;
      size_t j = i;
      for (; j < kids_.size() && kids_[j].token == kids_[i].token; ++j) {
        best = std::max(best, kids_[j].estimate);
        pool_.push_back(kids_[j].next);
      }
      const double p = prob * best;
      if (p >= params_.min_prob) heap_.push(Item{p, order_++, parent, kids_[i].token, first, (uint32_t)pool_.size()});
      i = j;
    }
  }

  const std::vector<DraftSource>& sources_;
  const DrafterParams& params_;
  const Calibration& cal_;
  std::vector<Cursor> pool_;
  std::vector<Candidate> kids_;
  std::priority_queue<Item, std::vector<Item>, Worse> heap_;
  uint32_t order_ = 0;
};

}  // namespace

DraftOut draft_multi(const std::vector<DraftSource>& sources, const Tok* ctx, const Tok* ctx_canon, size_t n,
                     const DrafterParams& params, const Calibration& calibration,
                     std::vector<RootObservation>* observations) {
  if (observations) observations->clear();
  if (params.budget == 0) return DraftOut{};
  Builder b(sources, params, calibration);
  return b.run(ctx, ctx_canon, n, observations);
}

void learn(Calibration* calibration, const std::vector<RootObservation>& observations, Tok actual, Tok actual_canon) {
  for (const RootObservation& o : observations)
    calibration->observe(o.feature, o.token == (o.canonical ? actual_canon : actual));
}

}  // namespace reprise
