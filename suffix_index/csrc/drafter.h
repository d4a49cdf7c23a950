// Multi-source drafting: one best-first draft tree from several suffix tries at once, with node
// probabilities from an online-calibrated table rather than raw count ratios.
//
// Why calibrate. SuffixDecoding (arXiv 2411.04975) scores a draft token by count(child)/count(node) at
// one match length. Measured on agent traces, whether a source's next-token guess is right depends
// mostly on how long the context match is (e.g. 0.3 at 1 token, 0.7 at 5-8, 0.98 beyond 32) and on the
// source (a request's own prompt vs the tenant's past responses), much less on the count ratio: a
// single occurrence gets ratio 1.0 whatever its match length. Merging sources by raw ratios lets a
// short, lucky match outvote a long one. Here every candidate child carries features (source kind,
// match length, count share, whether it continues the newest occurrence, occurrence count); its
// probability is the observed hit rate of that feature cell, learned per tenant from the tokens the
// verifier commits, starting from a prior that rises with the match length.
//
// Cursors. A cursor is a position in one source: a trie locus, or, once the trie's depth is used up, a
// copy position in that source's token arena (the newest occurrence continues beyond the depth cap, so
// drafts are not limited to max_depth minus the match length). Each source starts with cursors at its
// longest match and at a few shorter matches (back-off levels with more occurrences). A draft node
// gathers the cursors of every source that predicts its token; its probability is its parent's times
// the best calibrated estimate among them. Nodes are taken best first until the budget is spent, which
// maximises the expected number of accepted tokens for calibrated estimates.
//
// Canonical sources index token sequences where number tokens are replaced by a class id (>= kClassBase)
// so that "Total: $1,436\n\nWould you..." matches history that had other numbers. Their cursors never
// draft a class id (the number itself is unknown): a candidate class token is dropped. A canonical
// source is consulted only when its real twin matched fewer than canonical_below tokens and a number
// is among the last (that match + 1) tokens: otherwise its strings are the real ones and its cursors
// would duplicate the twin's.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "suffix_tree.h"

namespace reprise {

constexpr Tok kClassBase = 1 << 30;  // canonical class ids are >= this; real token ids are below
constexpr int kMaxSourceKinds = 10;
// Calibration rows of the sources (the proposer uses these; any row < kMaxSourceKinds works).
constexpr uint8_t kKindLocal = 0, kKindLocalCanonical = 1, kKindHistory = 2, kKindHistoryCanonical = 3,
                  kKindCorpus = 4, kKindCorpusCanonical = 5, kKindLocalSkip = 6, kKindSharedSkip = 7,
                  kKindPrompts = 8, kKindPromptsCanonical = 9;
// DraftOut::lead_kind of a draft whose first node is a fallback guess (FallbackTable), not a source's.
constexpr int32_t kLeadFallback = kMaxSourceKinds;

// Feature cell of one candidate child.
struct DraftFeature {
  uint8_t kind;    // source kind (calibration row), < kMaxSourceKinds
  uint8_t match;   // match-length bucket: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, >64
  uint8_t share;   // count share of the child among the locus' continuations: 1, >=.75, >=.5, >=.25, less
  uint8_t newest;  // 1 when the child continues the newest occurrence of the matched string
  uint8_t count;   // continuing occurrences of the locus: 1, 2-3, 4-10, more
};

// Hit rates per feature cell: hits and trials, prior included. Reads are lock-free (a torn read of a
// float pair only blurs one estimate); updates take a mutex. Shared by all sessions of a tenant.
class Calibration {
 public:
  static constexpr int kMatch = 8, kShare = 5, kNewest = 2, kCount = 4;
  static constexpr int kCells = kMaxSourceKinds * kMatch * kShare * kNewest * kCount;

  explicit Calibration(double prior_strength = 8.0);
  double estimate(const DraftFeature& f) const {
    const size_t i = cell(f);
    return hits_[i] / trials_[i];
  }
  void observe(const DraftFeature& f, bool hit);
  uint64_t num_observations() const { return observations_.load(std::memory_order_relaxed); }
  double prior_strength() const { return prior_strength_; }
  // Raw table for serialization and tests: hits then trials, kCells each.
  std::vector<float> table() const;
  void set_table(const std::vector<float>& t);

  static size_t cell(const DraftFeature& f) {
    return ((((size_t)f.kind * kMatch + f.match) * kShare + f.share) * kNewest + f.newest) * kCount + f.count;
  }
  static uint8_t match_bucket(uint32_t m);
  static uint8_t share_bucket(double share);
  static uint8_t count_bucket(double count);

 private:
  double prior_strength_;
  std::vector<float> hits_, trials_;
  std::mutex mutex_;
  std::atomic<uint64_t> observations_{0};
};

// What a tenant's context was followed by where its indexes' first guesses (a draft's roots) missed,
// by a category of the context's last token (the caller's: leading space or newline, letters, digits,
// punctuation, ...). Its most frequent tokens join a draft as further roots, competing with the
// indexes' nodes by probability: after a word the tenant's history never continued (14% of steps in
// chat answers, 3-5% in agent traces) the next token is still often " of", "," or " the", and such a
// guess is often worth more than the indexes' least likely nodes. Per category, space-saving counters
// (Metwally et al. 2005): at most kCapacity tokens, the frequent ones counted exactly. Shared by the
// tenant's sessions; every method takes the mutex.
class FallbackTable {
 public:
  static constexpr uint32_t kCategories = 32, kCapacity = 256;
  static constexpr double kPriorSteps = 8.0;

  FallbackTable() : cats_(kCategories) {}
  // One drafted step of `category`: `next` followed, and the draft's roots had it or not.
  void observe(uint8_t category, Tok next, bool missed);
  // Up to `k` tokens of `category`, most frequent first, none of them in skip[0, num_skip), each with
  // its probability of following when the roots missed: count / (misses + 8), the 8 keeping the first
  // few observations from promising much; none below `floor`.
  void top(uint8_t category, uint32_t k, const Tok* skip, size_t num_skip, double floor,
           std::vector<std::pair<Tok, double>>* out) const;
  uint64_t num_observations() const;
  // Flat table for snapshots: per category its steps, misses and number of tokens, then (token, count)
  // pairs.
  std::vector<int64_t> table() const;
  void set_table(const std::vector<int64_t>& t);

 private:
  struct Entry {
    Tok token;
    uint32_t count;
  };
  struct Category {
    std::vector<Entry> entries;  // by count, descending
    uint64_t steps = 0;
    uint64_t misses = 0;
  };
  std::vector<Category> cats_;
  mutable std::mutex mutex_;
};

struct DraftSource {
  const SuffixTree* tree;
  uint8_t kind;    // calibration row
  bool canonical;  // matches the canonical context and never drafts class ids
  int32_t twin;    // canonical source: index of its real counterpart (consulted only when that one's match
                   // is shorter than DrafterParams::canonical_below), else -1
  uint8_t skip_kind = kNoSkip;  // calibration row of this source's skip cursors (kNoSkip: none)
  static constexpr uint8_t kNoSkip = 0xFF;
};

// Where a source's longest match with a continuation was at the previous draft of the same session:
// the match cannot have grown by more than the tokens appended since, which bounds the next search.
struct MatchHint {
  uint32_t match = 0;
  size_t context_length = 0;  // 0: no hint
};

struct DrafterParams {
  uint32_t budget = 32;          // draft nodes at most
  double min_prob = 1e-4;        // nodes below this path probability are not drafted
  uint32_t levels = 2;           // cursors per source: the longest match, then halved matches with more occurrences
  uint32_t max_copy = 256;       // tokens a copy cursor may read past the trie's depth
  uint32_t canonical_below = 16; // a canonical source adds cursors only when its twin matched fewer tokens
                                 // (and a number token lies within that match + 1)
  uint32_t wide = 32;            // nodes with more children offer only their most frequent child
  // Skip cursors: when a source's exact match is shorter than skip_below tokens (often the context's
  // last token is new: an odd whitespace run, a fresh name), match the context without its last token
  // (at least skip_min tokens) and draft what followed whatever token stood in its place there.
  uint32_t skip_below = 2;
  uint32_t skip_min = 3;
};

// What a root candidate predicted, to learn from once the next token is known.
struct RootObservation {
  DraftFeature feature;
  Tok token;
  bool canonical;
};

// Scratch memory of draft_multi, reused across calls (one per session).
struct DraftWorkspace {
  struct Cursor {
    uint32_t source;
    ChildRef node;    // trie locus (kNil: copy cursor)
    uint32_t depth;   // locus depth
    uint32_t pos;     // copy cursor: arena position of the next token
    uint32_t copied;  // tokens copied past the trie's depth
    uint32_t match;   // context tokens matched so far, draft tokens included
  };
  struct Candidate {
    Tok token;
    double estimate;
    Cursor next;
    DraftFeature feature;
  };
  struct Item {
    double prob;
    uint32_t order;  // push order breaks ties: earlier first
    int32_t parent;
    Tok token;
    uint32_t begin, end;  // the node's cursors in pool
  };
  struct Group {  // candidates predicting one token
    double prob;
    uint32_t begin, end;  // range in kids
  };
  struct SortKey {  // a candidate's place in token order: token, then decreasing match
    uint64_t key;
    uint32_t index;
  };
  std::vector<Cursor> pool;
  std::vector<Candidate> kids, sorted;
  std::vector<SortKey> keys;
  // Queued nodes: items holds them, queue is a binary max-heap of their ranks (the probability's bits,
  // then the complement of (push order << 32 | items index), so that ties go to the earlier node).
  using Rank = unsigned __int128;
  std::vector<Item> items;
  std::vector<Rank> queue;
  std::vector<Group> groups;
  std::vector<uint32_t> first_match;  // per source: its longest match this call (0: none)
  std::vector<double> path;           // path probability of each emitted node
};

// Drafts continuing ctx[0, n) (real ids) / ctx_canon[0, n) (canonical ids, used by canonical sources).
// The result's probs are conditional (a node's probability given its parent was accepted) and its
// score is the expected number of accepted tokens (the sum of path probabilities).
// Callers hold every source's index lock shared. `observations` receives the root candidates; `hints`
// (one per source, may be null) bound the match search and are updated.
DraftOut draft_multi(const std::vector<DraftSource>& sources, const Tok* ctx, const Tok* ctx_canon, size_t n,
                     const DrafterParams& params, const Calibration& calibration,
                     std::vector<RootObservation>* observations, std::vector<MatchHint>* hints,
                     DraftWorkspace* workspace);

// Learns from the token that followed: every root candidate of the last draft is a hit or a miss.
void learn(Calibration* calibration, const std::vector<RootObservation>& observations, Tok actual, Tok actual_canon);

}  // namespace reprise
