// Multi-source calibrated drafting (see drafter.h for the design and its measurements).
#include "drafter.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "bisect.h"

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
            // Skip cursors guess past a token they did not see: start them at half the confidence.
            const double skip = (k == kKindLocalSkip || k == kKindSharedSkip) ? 0.5 : 1.0;
            double p = std::min(0.99, skip * kPriorMatch[m] * kPriorShare[s] * kPriorNewest[w]);
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
  // 0: m <= 1, 1: 2, 2: 3-4, 3: 5-8, 4: 9-16, 5: 17-32, 6: 33-64, 7: more
  if (m <= 2) return m == 0 ? 0 : (uint8_t)(m - 1);
  const uint32_t b = 32 - __builtin_clz(m - 1);  // bit length of m - 1
  return (uint8_t)std::min<uint32_t>(b, kMatch - 1);
}
uint8_t Calibration::share_bucket(double s) { return s >= 0.999 ? 0 : s >= 0.75 ? 1 : s >= 0.5 ? 2 : s >= 0.25 ? 3 : 4; }
uint8_t Calibration::count_bucket(double c) { return c <= 1 ? 0 : c <= 3 ? 1 : c <= 10 ? 2 : 3; }

// ---- fallback ----

void FallbackTable::observe(uint8_t category, Tok next, bool missed) {
  if (category >= kCategories) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Category& c = cats_[category];
  ++c.steps;
  if (!missed) return;
  ++c.misses;
  std::vector<Entry>& e = c.entries;
  size_t i = 0;
  while (i < e.size() && e[i].token != next) ++i;
  if (i < e.size()) {
    ++e[i].count;
  } else if (e.size() < kCapacity) {
    e.push_back(Entry{next, 1});
  } else {  // space-saving: the least counted token gives up its counter (and keeps its count)
    i = e.size() - 1;
    e[i].token = next;
    ++e[i].count;
  }
  for (; i > 0 && e[i - 1].count < e[i].count; --i) std::swap(e[i - 1], e[i]);
}

void FallbackTable::top(uint8_t category, uint32_t k, const Tok* skip, size_t num_skip, double floor,
                        std::vector<std::pair<Tok, double>>* out) const {
  if (category >= kCategories || k == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const Category& c = cats_[category];
  const double misses = (double)c.misses + kPriorSteps;
  for (const Entry& e : c.entries) {
    const double p = e.count / misses;
    if (p < floor) break;
    if (std::find(skip, skip + num_skip, e.token) != skip + num_skip) continue;
    out->emplace_back(e.token, p);
    if (--k == 0) break;
  }
}

uint64_t FallbackTable::num_observations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t n = 0;
  for (const Category& c : cats_) n += c.steps;
  return n;
}

std::vector<int64_t> FallbackTable::table() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> t;
  for (const Category& c : cats_) {
    t.push_back((int64_t)c.steps);
    t.push_back((int64_t)c.misses);
    t.push_back((int64_t)c.entries.size());
    for (const Entry& e : c.entries) {
      t.push_back(e.token);
      t.push_back(e.count);
    }
  }
  return t;
}

void FallbackTable::set_table(const std::vector<int64_t>& t) {
  std::vector<Category> cats(kCategories);
  size_t pos = 0;
  for (Category& c : cats) {
    if (pos + 3 > t.size()) throw std::invalid_argument("fallback table is truncated");
    const int64_t steps = t[pos], misses = t[pos + 1], n = t[pos + 2];
    pos += 3;
    if (misses < 0 || steps < misses || n < 0 || n > (int64_t)kCapacity)
      throw std::invalid_argument("fallback table is malformed");
    if (pos + 2 * (size_t)n > t.size()) throw std::invalid_argument("fallback table is truncated");
    c.steps = (uint64_t)steps;
    c.misses = (uint64_t)misses;
    for (int64_t i = 0; i < n; ++i, pos += 2) {
      const int64_t token = t[pos], count = t[pos + 1];
      if (token < 0 || token >= kClassBase || count < 1 || count > UINT32_MAX ||
          (!c.entries.empty() && count > c.entries.back().count))
        throw std::invalid_argument("fallback table entry " + std::to_string(i) + " is not a ranked count");
      c.entries.push_back(Entry{(Tok)token, (uint32_t)count});
    }
  }
  if (pos != t.size()) throw std::invalid_argument("fallback table has trailing values");
  std::lock_guard<std::mutex> lock(mutex_);
  cats_ = std::move(cats);
}

// ---- drafting ----

namespace {

using Cursor = DraftWorkspace::Cursor;
using Candidate = DraftWorkspace::Candidate;
using Item = DraftWorkspace::Item;
using Group = DraftWorkspace::Group;
using SortKey = DraftWorkspace::SortKey;

// Cursors a draft node keeps per source (the longest matches): a second one, from a shorter match with
// more occurrences, carries on where the longest match's occurrences end (measured: +1% tau).
constexpr uint32_t kCursorsPerSource = 2;
// Marks a skip cursor's source index (drafted from that source, calibrated in its skip row).
constexpr uint32_t kSkipFlag = 0x80000000u;

using Rank = DraftWorkspace::Rank;

// A queued node's rank: more probable first, then queued earlier. The bits of a non-negative double
// order as the double does, so one unsigned comparison decides: the queue picks a child without a
// data-dependent branch (mispredicted comparisons would cost most of the queue's time).
inline Rank rank_of(double prob, uint32_t order, uint32_t index) {
  uint64_t bits;
  std::memcpy(&bits, &prob, sizeof bits);
  return (Rank)bits << 64 | (uint64_t)~((uint64_t)order << 32 | index);
}
inline double prob_of(Rank r) {
  const uint64_t bits = (uint64_t)(r >> 64);
  double prob;
  std::memcpy(&prob, &bits, sizeof prob);
  return prob;
}
inline uint32_t index_of(Rank r) { return (uint32_t)~(uint64_t)r; }

// Whether some occurrence of the locus string is followed by a token (terminal occurrences, such as
// the context's own position in a request's index, are not).
bool continues(const SuffixTree& t, const Locus& l) {
  return t.next_in_edge(l) != kSentinel || t.num_children(l.node) > 0;
}

// The largest m in [1, hi] whose locus continues (0 if none), hi tried first; *out is its locus.
// Continuation is monotone: a longer string's occurrences end where its suffix's do.
uint32_t longest_continuing(const SuffixTree& t, const Tok* ctx, size_t n, uint32_t hi, Locus* out) {
  Locus l;
  return longest_holding(hi, [&](uint32_t m) {
    if (!t.locate(ctx + n - m, m, &l) || !continues(t, l)) return false;
    *out = l;  // the last m that holds is the one returned
    return true;
  });
}

// The largest m in [1, hi] whose string occurs more than `floor` times and continues (0 if none);
// *out is its locus.
uint32_t longest_more_frequent(const SuffixTree& t, const Tok* ctx, size_t n, uint32_t hi, double floor, Locus* out) {
  Locus l;
  const uint32_t found = last_holding(0, hi, [&](uint32_t m) {
    if (!t.locate(ctx + n - m, m, &l) || !(t.count_of(l.node) > floor)) return false;
    *out = l;  // the last m that holds is the one returned
    return true;
  });
  return found > 0 && continues(t, *out) ? found : 0;
}

class Builder {
 public:
  Builder(const std::vector<DraftSource>& sources, const DrafterParams& p, const Calibration& cal, DraftWorkspace* ws)
      : sources_(sources), params_(p), cal_(cal), pool_(ws->pool), kids_(ws->kids), sorted_(ws->sorted),
        keys_(ws->keys), items_(ws->items), queue_(ws->queue),
        first_(ws->first_match), groups_(ws->groups), path_(ws->path) {
    pool_.clear();
    path_.clear();
    kids_.clear();
    items_.clear();
    queue_.clear();
    groups_.clear();
    first_.assign(sources.size(), 0);
  }

  DraftOut run(const Tok* ctx, const Tok* ctx_canon, size_t n, std::vector<RootObservation>* obs,
               std::vector<MatchHint>* hints) {
    DraftOut out;
    for (uint32_t s = 0; s < sources_.size(); ++s) {
      const DraftSource& src = sources_[s];
      if (src.twin >= 0 && (first_[src.twin] >= params_.canonical_below || !number_within(ctx_canon, n, first_[src.twin] + 1)))
        continue;  // the real match suffices, or the canonical one is the same strings
      MatchHint* hint = hints ? &(*hints)[s] : nullptr;
      seed(s, src.canonical ? ctx_canon : ctx, n, hint, &out);
    }
    if (pool_.empty()) return out;
    out.token_ids.reserve(params_.budget);
    out.parents.reserve(params_.budget);
    out.probs.reserve(params_.budget);
    expand(0, (uint32_t)pool_.size(), -1, 1.0, obs);
    while (!queue_.empty() && emitted_ < params_.budget) {
      Item it = items_[index_of(queue_[0])];
      pop_queued();
      // Emit it; while its expansion leaves one child that beats everything queued (a copy running on),
      // emit that child at once instead of queueing it.
      for (;;) {
        const int32_t index = (int32_t)out.token_ids.size();
        if (index == 0 && it.begin < it.end)  // the source of its longest-matching cursor
          out.lead_kind = sources_[pool_[it.begin].source & ~kSkipFlag].kind;
        // DraftTree contract: probability given the parent was accepted; score sums path probabilities.
        const double parent_prob = it.parent < 0 ? 1.0 : path_[it.parent];
        out.push(it.token, it.parent, std::min(1.0, it.prob / parent_prob));
        path_.push_back(it.prob);
        out.score += it.prob;
        ++emitted_;
        if (emitted_ >= params_.budget) break;
        if (!expand(it.begin, it.end, index, it.prob, nullptr, &it)) break;
      }
    }
    return out;
  }

 private:
  // Whether a class id is among the last m tokens of the canonical context. When none is, a canonical
  // source matches no further than its real twin (which missed at m tokens): its strings are the real
  // ones, with the same occurrences.
  static bool number_within(const Tok* ctx_canon, size_t n, size_t m) {
    for (size_t i = n - std::min(n, m); i < n; ++i)
      if (ctx_canon[i] >= kClassBase) return true;
    return false;
  }

  // Root cursors of one source: its longest match with a continuation, then shorter matches (at most
  // half as long each time) with more occurrences.
  void seed(uint32_t s, const Tok* ctx, size_t n, MatchHint* hint, DraftOut* out) {
    const SuffixTree& t = *sources_[s].tree;
    if (n == 0 || t.num_tokens() == 0) return;
    uint32_t hi = (uint32_t)std::min<size_t>(n, t.max_depth());
    if (hint && hint->context_length > 0 && hint->context_length <= n)
      hi = (uint32_t)std::min<size_t>(hi, hint->match + (n - hint->context_length));
    Locus l;
    const uint32_t m = longest_continuing(t, ctx, n, hi, &l);
    if (hint) *hint = MatchHint{m, n};
    if (m < params_.skip_below && sources_[s].skip_kind != DraftSource::kNoSkip) seed_skip(s, ctx, n);
    if (m == 0) return;
    first_[s] = m;
    out->match_len = std::max(out->match_len, m);
    pool_.push_back(Cursor{s, l.node, l.depth, 0, 0, m});
    double floor = t.count_of(l.node);
    uint32_t half = m / 2;
    for (uint32_t level = 1; level < params_.levels && half > 0; ++level) {
      const uint32_t m2 = longest_more_frequent(t, ctx, n, half, floor, &l);
      if (m2 == 0) break;
      pool_.push_back(Cursor{s, l.node, l.depth, 0, 0, m2});
      floor = t.count_of(l.node);
      half = m2 / 2;
    }
  }

  // Skip cursors: the longest match of ctx[0, n-1) (the context without its last token), stepped over
  // the most frequent token that followed it there (a stand-in for our new last token).
  void seed_skip(uint32_t s, const Tok* ctx, size_t n) {
    const SuffixTree& t = *sources_[s].tree;
    if (n < params_.skip_min + 1) return;
    Locus l;
    const uint32_t hi = (uint32_t)std::min<size_t>(n - 1, t.max_depth() - 1);
    const uint32_t m = longest_continuing(t, ctx, n - 1, hi, &l);
    if (m < params_.skip_min) return;
    Cursor over{s, l.node, l.depth, 0, 0, m};  // then one step, over the stand-in token
    const Tok inside = t.next_in_edge(l);
    if (inside != kSentinel) {
      if (inside == ctx[n - 1]) return;  // not a stand-in: the exact match covers it
      over.depth += 1;
    } else {
      const ChildRef best = t.best_child(l.node);
      if (best == kNil || t.arena()[t.ref_of(best) + l.depth] == ctx[n - 1]) return;
      over.node = best;
      over.depth += 1;
    }
    over.match = m;
    over.source = s | kSkipFlag;
    pool_.push_back(over);
  }

  // Appends a candidate field by field: built as a temporary and copied in, it is read back as whole
  // 16-byte words right after its narrower fields were stored, which stalls store forwarding on every
  // candidate (perf put a tenth of a draft's time there).
  void add_kid(Tok token, const DraftFeature& f, uint32_t source, ChildRef node, uint32_t depth, uint32_t pos,
               uint32_t copied, uint32_t match) {
    Candidate& k = kids_.emplace_back();
    k.token = token;
    k.estimate = cal_.estimate(f);
    k.feature = f;
    k.next.source = source;
    k.next.node = node;
    k.next.depth = depth;
    k.next.pos = pos;
    k.next.copied = copied;
    k.next.match = match;
  }

  // How a cursor continues. Inside a trie edge (every occurrence continues along it) or past the trie's
  // depth (copying the newest occurrence) by exactly one token: in_line hands it to emit(token, feature,
  // node, depth, pos, copied), the last four being the cursor one token on, and returns kOne. kNone once
  // the copy or the leaf ended; kBranch at a node boundary, where the node's children continue it.
  enum class Line { kOne, kNone, kBranch };
  template <typename Emit>
  Line in_line(const Cursor& c, Emit&& emit) const {
    const DraftSource& src = sources_[c.source & ~kSkipFlag];
    const SuffixTree& t = *src.tree;
    const uint8_t kind = (c.source & kSkipFlag) ? src.skip_kind : src.kind;
    const uint8_t mb = Calibration::match_bucket(c.match);
    if (c.node == kNil || c.depth >= t.max_depth()) {
      const uint32_t pos = c.node == kNil ? c.pos : t.ref_of(c.node) + c.depth;
      const Tok tok = t.arena()[pos];
      if (tok == kSentinel || c.copied >= params_.max_copy) return Line::kNone;
      emit(tok, DraftFeature{kind, mb, 0, 1, 0}, kNil, 0u, pos + 1, c.copied + 1);
      return Line::kOne;
    }
    const Tok inside = t.next_in_edge(Locus{c.node, c.depth});
    if (inside == kSentinel) return Line::kBranch;
    emit(inside, DraftFeature{kind, mb, 0, 1, Calibration::count_bucket(t.count_of(c.node))}, c.node, c.depth + 1,
         0u, 0u);
    return Line::kOne;
  }

  void candidates(const Cursor& c) {
    const auto add = [&](Tok tok, const DraftFeature& f, ChildRef node, uint32_t depth, uint32_t pos,
                         uint32_t copied) { add_kid(tok, f, c.source, node, depth, pos, copied, c.match + 1); };
    if (in_line(c, add) != Line::kBranch) return;
    const DraftSource& src = sources_[c.source & ~kSkipFlag];
    const SuffixTree& t = *src.tree;
    const uint8_t kind = (c.source & kSkipFlag) ? src.skip_kind : src.kind;
    const uint8_t mb = Calibration::match_bucket(c.match);
    const uint32_t num = t.num_children(c.node);
    if (num == 0) return;
    if (num > params_.wide) {  // a wide node: only its most frequent child, against all occurrences
      const ChildRef best = t.best_child(c.node);
      if (best == kNil) return;
      const double total = t.count_of(c.node);
      const DraftFeature f{kind, mb, Calibration::share_bucket(t.count_of(best) / total), 0,
                           Calibration::count_bucket(total)};
      const Tok tok = t.arena()[t.ref_of(best) + c.depth];
      add_kid(tok, f, c.source, best, c.depth + 1, 0, 0, c.match + 1);
      return;
    }
    double total = 0;
    uint32_t newest = 0;
    t.for_each_child(c.node, [&](Tok, ChildRef ch) {
      total += t.count_of(ch);
      newest = std::max(newest, t.ref_of(ch));
    });
    const uint8_t cb = Calibration::count_bucket(total);
    t.for_each_child(c.node, [&](Tok tok, ChildRef ch) {
      const double share = t.count_of(ch) / total;
      const DraftFeature f{kind, mb, Calibration::share_bucket(share), (uint8_t)(t.ref_of(ch) == newest), cb};
      add_kid(tok, f, c.source, ch, c.depth + 1, 0, 0, c.match + 1);
    });
  }

  // Children of the draft node whose cursors are pool_[begin, end): one per distinct token, its
  // estimate the best of the cursors predicting it. A child keeps one cursor per source (the longest
  // match: it subsumes shorter ones), and no canonical cursor whose real twin matches as far; only the
  // `remaining` best children can still be drafted, so no others are queued.
  // With `next`: when the node has one child and it beats everything queued (a copy running on), that
  // child is returned in *next (true) instead of being queued, as popping it at once would.
  bool expand(uint32_t begin, uint32_t end, int32_t parent, double prob, std::vector<RootObservation>* obs,
              Item* next = nullptr) {
    if (!obs) {
      bool at_once = false;
      if (expand_run(begin, end, parent, prob, next, &at_once)) return at_once;
    }
    kids_.clear();
    for (uint32_t i = begin; i < end; ++i) candidates(pool_[i]);
    if (obs) {
      for (const Candidate& k : kids_) {
        RootObservation& o = obs->emplace_back();  // in place (see add_kid)
        o.feature = k.feature;
        o.token = k.token;
        o.canonical = sources_[k.next.source & ~kSkipFlag].canonical;
      }
    }
    kids_.erase(std::remove_if(kids_.begin(), kids_.end(), [](const Candidate& k) { return k.token >= kClassBase; }),
                kids_.end());
    if (kids_.empty()) return false;
    const auto by_token = [](const Candidate& a, const Candidate& b) {
      return a.token != b.token ? a.token < b.token : a.next.match > b.next.match;
    };
    // Often already in order (one token from cursors taken longest match first): then the sort, which
    // promises no order among equal candidates anyway, is skipped. Otherwise 16-byte sort keys are
    // sorted (moving 48-byte candidates cost a tenth of a draft) and the candidates gathered in order.
    if (kids_.size() > 1 && !std::is_sorted(kids_.begin(), kids_.end(), by_token)) sort_kids();
    groups_.clear();
    for (size_t i = 0; i < kids_.size();) {
      size_t j = i;
      double best = 0;
      while (j < kids_.size() && kids_[j].token == kids_[i].token) best = std::max(best, kids_[j++].estimate);
      Group& g = groups_.emplace_back();  // in place (see add_kid)
      g.prob = prob * best;
      g.begin = (uint32_t)i;
      g.end = (uint32_t)j;
      i = j;
    }
    const size_t remaining = params_.budget - emitted_;
    if (groups_.size() > remaining) {
      std::nth_element(groups_.begin(), groups_.begin() + remaining, groups_.end(),
                       [](const Group& a, const Group& b) { return a.prob > b.prob; });
      groups_.resize(remaining);
    }
    for (const Group& g : groups_) {
      if (g.prob < params_.min_prob) continue;
      const uint32_t first = (uint32_t)pool_.size();
      for (uint32_t k = g.begin; k < g.end; ++k) {
        const Cursor& c = kids_[k].next;
        if (!redundant(c, first, (uint32_t)pool_.size())) pool_.push_back(c);
      }
      // Pushed last, it would be popped first only if it beats the top outright (ties go to older items).
      const bool at_once = next && groups_.size() == 1 && (queue_.empty() || g.prob > prob_of(queue_[0]));
      Item& item = at_once ? *next : items_.emplace_back();  // filled in place (see add_kid)
      item.prob = g.prob;
      item.order = order_++;
      item.parent = parent;
      item.token = kids_[g.begin].token;
      item.begin = first;
      item.end = (uint32_t)pool_.size();
      if (at_once) return true;
      push_queued(item.prob, item.order);
    }
    return false;
  }

  // Queues the node just appended to items_.
  void push_queued(double prob, uint32_t order) {
    const Rank r = rank_of(prob, order, (uint32_t)(items_.size() - 1));
    const size_t hole = queue_.size();
    queue_.emplace_back();
    sift_up(hole, r);
  }

  // Removes the queue's first node: the hole it leaves goes down to a leaf by the better child (chosen
  // without a branch), and the last rank comes up into it from there.
  void pop_queued() {
    const Rank last = queue_.back();
    queue_.pop_back();
    const size_t n = queue_.size();
    if (n == 0) return;
    size_t hole = 0, c = 1;
    for (; c + 1 < n; c = 2 * hole + 1) {
      c += queue_[c + 1] > queue_[c];
      queue_[hole] = queue_[c];
      hole = c;
    }
    if (c < n) {
      queue_[hole] = queue_[c];
      hole = c;
    }
    sift_up(hole, last);
  }

  // Puts r into the queue's hole, moving the ranks above it that r beats down along its path.
  void sift_up(size_t hole, Rank r) {
    while (hole > 0 && queue_[(hole - 1) / 2] < r) {
      queue_[hole] = queue_[(hole - 1) / 2];
      hole = (hole - 1) / 2;
    }
    queue_[hole] = r;
  }

  // kids_ by token, then by decreasing match (the order among candidates equal in both is the sort's).
  void sort_kids() {
    keys_.resize(kids_.size());
    for (uint32_t i = 0; i < kids_.size(); ++i) {
      keys_[i].key = (uint64_t)(uint32_t)kids_[i].token << 32 | (0xFFFFFFFFu - kids_[i].next.match);
      keys_[i].index = i;
    }
    std::sort(keys_.begin(), keys_.end(), [](const SortKey& a, const SortKey& b) { return a.key < b.key; });
    sorted_.resize(kids_.size());
    for (uint32_t i = 0; i < kids_.size(); ++i) sorted_[i] = kids_[keys_[i].index];
    kids_.swap(sorted_);
  }

  // The common case of expand(), without its candidate lists: every cursor of the node continues
  // inside a trie edge or a copy and all of them predict the same token (most expansions of a draft).
  // The node's cursors then step on in place (a node is expanded once, so nobody reads them again) and
  // its one child is queued or returned exactly as expand() would. False, with nothing changed, when
  // the node is not such a case.
  bool expand_run(uint32_t begin, uint32_t end, int32_t parent, double prob, Item* next, bool* at_once) {
    constexpr uint32_t kMaxRun = 8;
    if (end - begin > kMaxRun || begin == end) return false;
    struct Step {  // a cursor one token on
      ChildRef node;
      uint32_t depth, pos, copied;
    };
    Step step[kMaxRun];
    Tok token = kSentinel;
    double best = 0;
    for (uint32_t i = begin; i < end; ++i) {
      Tok tok = kSentinel;
      double estimate = 0;
      const Line line = in_line(pool_[i], [&](Tok t, const DraftFeature& f, ChildRef node, uint32_t depth, uint32_t pos,
                                              uint32_t copied) {
        tok = t;
        estimate = cal_.estimate(f);
        Step& s = step[i - begin];  // field by field (see add_kid)
        s.node = node;
        s.depth = depth;
        s.pos = pos;
        s.copied = copied;
      });
      if (line != Line::kOne || tok >= kClassBase || (i > begin && tok != token)) return false;
      token = tok;
      best = std::max(best, estimate);
    }
    const double p = prob * best;
    if (p < params_.min_prob) return true;  // no child worth drafting
    uint32_t kept = begin;
    for (uint32_t i = begin; i < end; ++i) {
      Cursor c = pool_[i];
      const Step& s = step[i - begin];
      c.node = s.node;
      c.depth = s.depth;
      c.pos = s.pos;
      c.copied = s.copied;
      c.match += 1;
      if (!redundant(c, begin, kept)) pool_[kept++] = c;
    }
    *at_once = next && (queue_.empty() || p > prob_of(queue_[0]));
    Item& item = *at_once ? *next : items_.emplace_back();
    item.prob = p;
    item.order = order_++;
    item.parent = parent;
    item.token = token;
    item.begin = begin;
    item.end = kept;
    if (!*at_once) push_queued(p, item.order);
    return true;
  }

  // Whether cursor c adds nothing to the cursors already kept for its node, pool_[first, last) (kept
  // in decreasing match order): a third one of its source, the same locus, or a canonical cursor whose
  // real twin matches as far.
  bool redundant(const Cursor& c, uint32_t first, uint32_t last) const {
    uint32_t same_source = 0;
    for (uint32_t q = first; q < last; ++q) {
      const Cursor& o = pool_[q];
      same_source += o.source == c.source;
      if (same_source >= kCursorsPerSource ||
          (o.source == c.source && o.node == c.node && o.depth == c.depth && o.pos == c.pos) ||
          (sources_[c.source & ~kSkipFlag].twin == (int32_t)o.source && o.match >= c.match))
        return true;
    }
    return false;
  }

  const std::vector<DraftSource>& sources_;
  const DrafterParams& params_;
  const Calibration& cal_;
  std::vector<Cursor>& pool_;
  std::vector<Candidate>& kids_;
  std::vector<Candidate>& sorted_;
  std::vector<SortKey>& keys_;
  std::vector<Item>& items_;
  std::vector<Rank>& queue_;
  std::vector<uint32_t>& first_;
  std::vector<Group>& groups_;
  std::vector<double>& path_;  // path probability of each emitted node
  uint32_t order_ = 0;
  uint32_t emitted_ = 0;
};

}  // namespace

DraftOut draft_multi(const std::vector<DraftSource>& sources, const Tok* ctx, const Tok* ctx_canon, size_t n,
                     const DrafterParams& params, const Calibration& calibration,
                     std::vector<RootObservation>* observations, std::vector<MatchHint>* hints,
                     DraftWorkspace* workspace) {
  if (observations) observations->clear();
  if (params.budget == 0) return DraftOut{};
  if (hints && hints->size() != sources.size()) hints->assign(sources.size(), MatchHint{});
  DraftWorkspace local;
  Builder b(sources, params, calibration, workspace ? workspace : &local);
  return b.run(ctx, ctx_canon, n, observations, hints);
}

void learn(Calibration* calibration, const std::vector<RootObservation>& observations, Tok actual, Tok actual_canon) {
  for (const RootObservation& o : observations)
    calibration->observe(o.feature, o.token == (o.canonical ? actual_canon : actual));
}

}  // namespace reprise
