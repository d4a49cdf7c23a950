// Python bindings of multi-source drafting (drafter.h): Calibration and DraftingSession.
//
// A DraftingSession owns one request's own indexes (its prompt and output, real and canonical) and its
// context, and holds references to its tenant's shared indexes (history, corpus) and calibration. One
// native call drafts (propose) and one commits (learn, extend the context and the request's indexes),
// each releasing the GIL; the tenant's indexes are read under their shared locks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "drafter.h"
#include "index.h"
#include "py_records.h"

namespace py = pybind11;

namespace reprise {
namespace {

using I32Array = py::array_t<int32_t, py::array::c_style>;
using U8Array = py::array_t<uint8_t, py::array::c_style>;

// The DraftTree type of retrieval/draft_tree.py, set once at import, so that propose() builds the
// frozen record without running its __init__ (every field below is validated here instead).
struct TreeType {
  PyObject* type = nullptr;
  PyObject* names[6] = {};
  PyObject* empty_i32 = nullptr;
  PyObject* empty_f32 = nullptr;
  PyObject* source = nullptr;
  PyObject* by_kind[kMaxSourceKinds + 1] = {};  // "<source>:<where the first node came from>"
  RecordLayout layout;
};
TreeType tree_type;

py::object make_tree(const DraftOut& d) {
  if (!tree_type.type) throw std::logic_error("suffix_index drafting used before retrieval registered DraftTree");
  PyObject* source = d.lead_kind >= 0 && d.lead_kind <= kLeadFallback ? tree_type.by_kind[d.lead_kind] : tree_type.source;
  Py_INCREF(source);
  PyObject* values[6] = {new_array(d.token_ids, tree_type.empty_i32), new_array(d.parents, tree_type.empty_i32),
                         new_array(d.probs, tree_type.empty_f32), PyFloat_FromDouble(d.score), source,
                         PyLong_FromUnsignedLong(d.match_len)};
  return new_record(tree_type.type, tree_type.names, values, 6, &tree_type.layout);
}

void check_tokens(const I32Array& a, const char* name) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D");
  const int32_t* p = a.data();
  for (py::ssize_t i = 0; i < a.shape(0); ++i)
    if (p[i] < 0 || p[i] >= kClassBase)
      throw py::value_error("token id " + std::to_string(p[i]) + " at index " + std::to_string(i) + " of " + name +
                            " is outside [0, 2**30)");
}

uint8_t checked_category(int category) {
  if (category < 0 || category >= (int)FallbackTable::kCategories)
    throw py::value_error("category must be in [0, " + std::to_string(FallbackTable::kCategories) + "), got " +
                          std::to_string(category));
  return (uint8_t)category;
}

struct SharedSource {
  py::object owner;  // keeps the SuffixIndex alive
  const SuffixIndex* index;
  uint8_t kind;
  bool canonical;
};

class DraftingSession {
 public:
  DraftingSession(uint32_t max_depth, py::object calibration, I32Array classes, const DrafterParams& params,
                  bool use_context, py::object fallback, U8Array categories)
      : use_context_(use_context),
        calibration_owner_(calibration),
        calibration_(calibration.cast<Calibration*>()),
        fallback_owner_(fallback),
        fallback_(fallback.is_none() ? nullptr : fallback.cast<FallbackTable*>()),
        classes_(std::move(classes)),
        categories_(std::move(categories)),
        params_(params),
        local_(max_depth, 0, {}),
        local_canon_(max_depth, 0, {}) {
    if (classes_.ndim() != 1) throw py::value_error("token classes must be a 1-D int32 array");
    // (a category >= FallbackTable::kCategories means no guesses after that token)
    if (categories_.ndim() != 1) throw py::value_error("token categories must be a 1-D uint8 array");
    canonical_ = classes_.shape(0) > 0;
    if (use_context_) {
      sources_.push_back(DraftSource{&local_.tree, kKindLocal, false, -1, kKindLocalSkip});
      if (canonical_) sources_.push_back(DraftSource{&local_canon_.tree, kKindLocalCanonical, true, 0});
    }
  }

  // A tenant index to draft from too. A canonical source added right after a real one is its twin.
  void add_source(py::object index, int kind, bool canonical) {
    if (kind < 0 || kind >= kMaxSourceKinds)
      throw py::value_error("source kind must be in [0, " + std::to_string(kMaxSourceKinds) + "), got " + std::to_string(kind));
    const SuffixIndex* ix = index.cast<const SuffixIndex*>();
    shared_.push_back(SharedSource{index, ix, (uint8_t)kind, canonical});
    int32_t twin = -1;
    if (canonical && !sources_.empty() && !sources_.back().canonical) twin = (int32_t)sources_.size() - 1;
    sources_.push_back(DraftSource{&ix->tree, (uint8_t)kind, canonical, twin,
                                   canonical ? DraftSource::kNoSkip : kKindSharedSkip});
    hints_.clear();
  }

  // The request's context becomes `prompt`. When it extends the current context, only the new tokens
  // are indexed; otherwise the new part goes into a fresh sequence with `overlap` tokens of left context,
  // so a session's next request reuses the indexes built for its previous one.
  void rebase(const I32Array& prompt, uint32_t overlap) {
    check_tokens(prompt, "prompt");
    const Tok* p = prompt.data();
    const size_t n = (size_t)prompt.shape(0);
    py::gil_scoped_release nogil;
    size_t lcp = 0;
    const size_t lim = std::min(n, ctx_.size());
    while (lcp < lim && ctx_[lcp] == p[lcp]) ++lcp;
    size_t from = lcp;
    if (lcp < ctx_.size()) {
      ++seq_;
      from = lcp > overlap ? lcp - overlap : 0;
    }
    ctx_.assign(p, p + n);
    if (canonical_) {
      ctx_canon_.resize(n);
      for (size_t i = 0; i < n; ++i) ctx_canon_[i] = canonical(p[i]);
    }
    if (from < n && use_context_) {
      local_.extend(seq_, ctx_.data() + from, n - from);
      if (canonical_) local_canon_.extend(seq_, ctx_canon_.data() + from, n - from);
    }
    observations_.clear();
    hints_.clear();
    fill_category_ = -1;
    forget_last_draft();
  }

  py::object propose(int64_t budget) {
    if (budget < 0 || budget > 4096) throw py::value_error("budget must be in [0, 4096], got " + std::to_string(budget));
    DrafterParams p = params_;
    p.budget = (uint32_t)budget;
    DraftOut d;
    {
      py::gil_scoped_release nogil;
      for (const SharedSource& s : shared_) s.index->mutex.lock_shared();
      d = draft_multi(sources_, ctx_.data(), canonical_ ? ctx_canon_.data() : ctx_.data(), ctx_.size(), p,
                      *calibration_, &observations_, &hints_, &workspace_);
      for (const SharedSource& s : shared_) s.index->mutex.unlock_shared();
      num_index_nodes_ = d.token_ids.size();
      index_score_ = d.score;
      if (fallback_ && budget > 0 && !ctx_.empty()) add_guesses(&d, p);
      num_last_nodes_ = d.token_ids.size();
      last_score_ = index_score_;
    }
    return make_tree(d);
  }

  // What the verifier committed: `tokens` (the accepted draft tokens, then the bonus token) and, when
  // the last draft was verified, `accepted`, its accepted nodes, root to leaf (the verifier's count;
  // never recounted here). Learns from the first token, then extends the context and own indexes.
  // Returns (expected, accepted) for the acceptance monitor: the last draft's score and how many of the
  // accepted nodes came from the indexes, or (0, 0) when the draft was not verified (a draft nobody
  // checked says nothing about the tenant's drafts) (the fallback's guesses are its table's to learn from: a tenant whose
  // next words are new to it should not lose its copies to the monitor over them). Guesses are roots
  // without children that follow the index nodes, so an accepted path is all index nodes or one guess.
  std::pair<double, uint32_t> commit(const I32Array& tokens, const I32Array& accepted, bool draft_verified,
                                     bool learn_from_it) {
    check_tokens(tokens, "token_ids");
    if (accepted.ndim() != 1) throw py::value_error("accepted must be 1-D");
    const Tok* t = tokens.data();
    const size_t n = (size_t)tokens.shape(0);
    const size_t k = (size_t)accepted.shape(0);
    if (k > n)
      throw py::value_error(std::to_string(k) + " accepted nodes but only " + std::to_string(n) + " tokens");
    for (size_t i = 0; i < k; ++i)
      if (accepted.data()[i] < 0 || (size_t)accepted.data()[i] >= num_last_nodes_)
        throw py::value_error("accepted node " + std::to_string(accepted.data()[i]) + " is not a node of the last "
                              "draft (" + std::to_string(num_last_nodes_) + " nodes)");
    if (n == 0) return {0.0, 0};
    py::gil_scoped_release nogil;
    const uint32_t from_indexes = k > 0 && (size_t)accepted.data()[0] < num_index_nodes_ ? (uint32_t)k : 0;
    const double expected = draft_verified ? last_score_ : 0.0;
    if (learn_from_it && fill_category_ >= 0)
      fallback_->observe((uint8_t)fill_category_, t[0],
                         std::find(index_roots_.begin(), index_roots_.end(), t[0]) == index_roots_.end());
    fill_category_ = -1;
    forget_last_draft();
    if (learn_from_it && !observations_.empty()) learn(calibration_, observations_, t[0], canonical(t[0]));
    observations_.clear();
    ctx_.insert(ctx_.end(), t, t + n);
    if (use_context_) local_.extend(seq_, t, n);
    if (canonical_) {
      const size_t old = ctx_canon_.size();
      ctx_canon_.resize(old + n);
      for (size_t i = 0; i < n; ++i) ctx_canon_[old + i] = canonical(t[i]);
      if (use_context_) local_canon_.extend(seq_, ctx_canon_.data() + old, n);
    }
    return {expected, draft_verified ? from_indexes : 0};
  }

  I32Array context() const {
    I32Array out((py::ssize_t)ctx_.size());
    if (!ctx_.empty()) std::memcpy(out.mutable_data(), ctx_.data(), ctx_.size() * sizeof(Tok));
    return out;
  }
  size_t context_length() const { return ctx_.size(); }
  uint64_t memory_bytes() const {
    return local_.tree.memory_bytes() + local_canon_.tree.memory_bytes() + 2 * ctx_.capacity() * sizeof(Tok);
  }


 private:
  Tok canonical(Tok t) const {
    return (py::ssize_t)t < classes_.shape(0) ? classes_.data()[t] : t;
  }
  uint8_t category(Tok t) const {
    return (py::ssize_t)t < categories_.shape(0) ? categories_.data()[t] : 0;
  }

  void forget_last_draft() {
    num_last_nodes_ = 0;
    num_index_nodes_ = 0;
    last_score_ = 0.0;
  }

  // The fallback's guesses for this context's last token join the draft as further roots (never one
  // the indexes drafted), each with its table probability times the chance that every root of the
  // indexes is wrong; the draft keeps the `budget` most probable nodes of both (the indexes' in their
  // best-first order, so every kept node's parent is kept). The next commit tells the table whether the
  // indexes' roots had the token that followed. Sets num_index_nodes_ and index_score_.
  void add_guesses(DraftOut* d, const DrafterParams& p) {
    fill_category_ = category(ctx_.back());
    index_roots_.clear();
    path_.resize(d->token_ids.size());
    double all_wrong = 1.0;
    for (size_t i = 0; i < d->token_ids.size(); ++i) {
      const int32_t parent = d->parents[i];
      path_[i] = d->probs[i] * (parent < 0 ? 1.0 : path_[parent]);
      if (parent < 0) {
        index_roots_.push_back(d->token_ids[i]);
        all_wrong *= 1.0 - path_[i];
      }
    }
    guesses_.clear();
    // A guess must beat the least likely index node when the indexes filled the budget.
    const double floor = std::max(p.min_prob, path_.size() >= p.budget ? path_.back() : 0.0);
    if (all_wrong > 0 && all_wrong >= floor)
      fallback_->top((uint8_t)fill_category_, p.budget, index_roots_.data(), index_roots_.size(), floor / all_wrong,
                     &guesses_);
    size_t kept = 0, taken = 0;  // index nodes, guesses
    while (kept + taken < p.budget) {
      const double guess = taken < guesses_.size() ? guesses_[taken].second * all_wrong : 0.0;
      if (kept < path_.size() && path_[kept] >= guess)
        ++kept;
      else if (guess >= p.min_prob && guess > 0)
        ++taken;
      else
        break;
    }
    d->token_ids.resize(kept);
    d->parents.resize(kept);
    d->probs.resize(kept);
    d->score = 0.0;
    for (size_t i = 0; i < kept; ++i) d->score += path_[i];
    num_index_nodes_ = kept;
    index_score_ = d->score;
    if (kept == 0 && taken > 0) d->lead_kind = kLeadFallback;
    for (size_t g = 0; g < taken; ++g) {
      const double prob = guesses_[g].second * all_wrong;
      d->push(guesses_[g].first, -1, prob);
      d->score += prob;
    }
  }

  bool use_context_;  // draft from the request's own prompt and output too
  py::object calibration_owner_;
  Calibration* calibration_;
  py::object fallback_owner_;
  FallbackTable* fallback_;  // null: no fallback guesses
  I32Array classes_;
  U8Array categories_;
  DrafterParams params_;
  SuffixIndex local_, local_canon_;
  bool canonical_ = false;
  std::vector<SharedSource> shared_;
  std::vector<DraftSource> sources_;  // local, local canonical (with classes), then the shared ones
  std::vector<MatchHint> hints_;
  DraftWorkspace workspace_;
  std::vector<Tok> ctx_, ctx_canon_;
  int64_t seq_ = 0;
  std::vector<RootObservation> observations_;
  size_t num_last_nodes_ = 0;  // nodes of the last draft, until its commit (0: none due)
  double last_score_ = 0.0;    // its indexes' expected accepted tokens
  int32_t fill_category_ = -1;  // the last draft's context category, while its commit is due (-1: none)
  std::vector<Tok> index_roots_;  // the last draft's roots from the indexes
  std::vector<std::pair<Tok, double>> guesses_;
  std::vector<double> path_;      // path probabilities of the indexes' nodes
  size_t num_index_nodes_ = 0;    // the last draft's nodes from the indexes (they come first)
  double index_score_ = 0.0;      // their expected accepted tokens
};

}  // namespace

void bind_drafter(py::module_& m) {
  m.def(
      "_register_draft_tree",
      [](py::object type, py::object empty_i32, py::object empty_f32, py::str source) {
        if (!PyType_Check(type.ptr())) throw py::type_error("type must be a class");
        tree_type.type = type.release().ptr();
        tree_type.empty_i32 = empty_i32.release().ptr();
        tree_type.empty_f32 = empty_f32.release().ptr();
        const std::string base = source;
        tree_type.source = source.release().ptr();
        const char* names[6] = {"token_ids", "parents", "probs", "score", "source", "match_len"};
        for (int i = 0; i < 6; ++i) tree_type.names[i] = PyUnicode_InternFromString(names[i]);
        tree_type.layout = record_layout(tree_type.type, tree_type.names, 6);
        // Where a draft's first node came from, for the drafter mix: the request itself, the tenant's
        // past responses, its corpus, its past prompts (canonical twins and skip cursors count as theirs),
        // the fallback's guesses.
        const char* where[kLeadFallback + 1] = {"context", "context", "history", "history", "corpus", "corpus",
                                                "context", "history", "prompts", "prompts", "fallback"};
        for (int k = 0; k <= kLeadFallback; ++k)
          tree_type.by_kind[k] = PyUnicode_InternFromString((base + ":" + where[k]).c_str());
      },
      "Internal: called once by suffix_index.drafting.");

  py::class_<DrafterParams>(m, "DrafterParams")
      .def(py::init([](double min_prob, uint32_t levels, uint32_t max_copy, uint32_t canonical_below, uint32_t wide,
                       uint32_t skip_below, uint32_t skip_min) {
             if (!(min_prob >= 0 && min_prob < 1)) throw py::value_error("min_prob must be in [0, 1), got " + std::to_string(min_prob));
             if (levels < 1 || levels > 8) throw py::value_error("levels must be in [1, 8], got " + std::to_string(levels));
             if (wide < 1) throw py::value_error("wide must be >= 1, got " + std::to_string(wide));
             DrafterParams p;
             p.min_prob = min_prob;
             p.levels = levels;
             p.max_copy = max_copy;
             p.canonical_below = canonical_below;
             p.wide = wide;
             p.skip_below = skip_below;
             p.skip_min = std::max<uint32_t>(skip_min, 1);
             return p;
           }),
           py::arg("min_prob"), py::arg("levels"), py::arg("max_copy"), py::arg("canonical_below"), py::arg("wide"),
           py::arg("skip_below"), py::arg("skip_min"))
      .def_readonly("min_prob", &DrafterParams::min_prob)
      .def_readonly("levels", &DrafterParams::levels)
      .def_readonly("max_copy", &DrafterParams::max_copy)
      .def_readonly("canonical_below", &DrafterParams::canonical_below)
      .def_readonly("wide", &DrafterParams::wide);

  py::class_<Calibration>(m, "Calibration")
      .def(py::init<double>(), py::arg("prior_strength"))
      .def_property_readonly("num_observations", &Calibration::num_observations)
      .def_property_readonly("prior_strength", &Calibration::prior_strength)
      .def("table",
           [](const Calibration& c) {
             const auto t = c.table();
             return py::array_t<float>((py::ssize_t)t.size(), t.data());  // a copy
           })
      .def("set_table", [](Calibration& c, py::array_t<float, py::array::c_style | py::array::forcecast> t) {
        std::vector<float> v(t.data(), t.data() + t.size());
        c.set_table(v);
      })
      .def("estimate", [](const Calibration& c, int kind, uint32_t match, double share, bool newest, double count) {
        if (kind < 0 || kind >= kMaxSourceKinds) throw py::value_error("kind out of range: " + std::to_string(kind));
        DraftFeature f{(uint8_t)kind, Calibration::match_bucket(match), Calibration::share_bucket(share), (uint8_t)newest,
                       Calibration::count_bucket(count)};
        return c.estimate(f);
      });

  py::class_<FallbackTable>(m, "FallbackTable")
      .def(py::init<>())
      .def_property_readonly("num_observations", &FallbackTable::num_observations)
      .def("observe", [](FallbackTable& f, int category, Tok next, bool missed) {
        f.observe(checked_category(category), next, missed);
      }, py::arg("category"), py::arg("next"), py::arg("missed"))
      .def("top", [](const FallbackTable& f, int category, uint32_t k) {
        std::vector<std::pair<Tok, double>> out;
        f.top(checked_category(category), k, nullptr, 0, 0.0, &out);
        return out;
      }, py::arg("category"), py::arg("k"))
      .def("table", [](const FallbackTable& f) {
        const auto t = f.table();
        return py::array_t<int64_t>((py::ssize_t)t.size(), t.data());  // a copy
      })
      .def("set_table", [](FallbackTable& f, py::array_t<int64_t, py::array::c_style | py::array::forcecast> t) {
        f.set_table(std::vector<int64_t>(t.data(), t.data() + t.size()));
      });
  m.attr("FALLBACK_CATEGORIES") = (int)FallbackTable::kCategories;

  py::class_<DraftingSession>(m, "DraftingSession")
      .def(py::init<uint32_t, py::object, I32Array, const DrafterParams&, bool, py::object, U8Array>(),
           py::arg("max_depth"), py::arg("calibration"), py::arg("token_classes"), py::arg("params"),
           py::arg("use_context") = true, py::arg("fallback") = py::none(),
           py::arg("token_categories") = U8Array(0))
      .def("add_source", &DraftingSession::add_source, py::arg("index"), py::arg("kind"), py::arg("canonical"))
      .def("rebase", &DraftingSession::rebase, py::arg("prompt"), py::arg("overlap"))
      .def("propose", &DraftingSession::propose, py::arg("budget"))
      .def("commit", &DraftingSession::commit, py::arg("token_ids"), py::arg("accepted"), py::arg("draft_verified"),
           py::arg("learn"))
      .def("context", &DraftingSession::context)
      .def_property_readonly("context_length", &DraftingSession::context_length)
      .def("memory_bytes", &DraftingSession::memory_bytes);
  m.attr("KIND_LOCAL") = (int)kKindLocal;
  m.attr("KIND_LOCAL_CANONICAL") = (int)kKindLocalCanonical;
  m.attr("KIND_HISTORY") = (int)kKindHistory;
  m.attr("KIND_HISTORY_CANONICAL") = (int)kKindHistoryCanonical;
  m.attr("KIND_CORPUS") = (int)kKindCorpus;
  m.attr("KIND_CORPUS_CANONICAL") = (int)kKindCorpusCanonical;
  m.attr("KIND_PROMPTS") = (int)kKindPrompts;
  m.attr("KIND_PROMPTS_CANONICAL") = (int)kKindPromptsCanonical;
  m.attr("CLASS_BASE") = (int)kClassBase;
}

}  // namespace reprise
