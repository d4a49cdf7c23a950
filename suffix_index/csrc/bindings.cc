// Python bindings of the suffix index (suffix_index._native). The typed facade is suffix_index/index.py;
// these functions take 1-D C-contiguous int32 arrays (anything else is a TypeError) and release the GIL
// while the index works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <string>

#include "index.h"
#include "py_records.h"

namespace py = pybind11;

static bool PyArray_Check_(PyObject* obj) { return py::detail::npy_api::get().PyArray_Check_(obj); }
static_assert(sizeof(int) == sizeof(int32_t), "NPY_INT is int32 here");
using reprise::DraftOut;
using reprise::new_array;
using reprise::new_record;
using reprise::SpecParams;
using reprise::SuffixIndex;
using reprise::Tok;

namespace {

// Set once by suffix_index.index at import: the Draft record type, the converter for token inputs
// that are not already 1-D int32 arrays, and shared read-only empty arrays for empty drafts.
struct Registry {
  PyObject* draft_type = nullptr;
  PyObject* as_tokens = nullptr;
  PyObject* empty_i32 = nullptr;
  PyObject* empty_f32 = nullptr;
  PyObject* names[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  reprise::RecordLayout layout;
};
Registry reg;

// A validated token array: `data` stays valid while `owner` lives.
struct Tokens {
  py::object owner;
  const Tok* data = nullptr;
  size_t size = 0;
};

// A 1-D C-contiguous native-endian int32 ndarray? Reads NumPy's array header directly (the fields
// used sit at the same offsets in NumPy 1.x and 2.x); this check is on every drafting call.
bool is_fast_array(PyObject* obj) {
  if (!PyArray_Check_(obj)) return false;
  const auto* a = py::detail::array_proxy(obj);
  const auto* d = py::detail::array_descriptor_proxy(a->descr);
  return a->nd == 1 && (a->flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_) &&
         d->type_num == py::detail::npy_api::NPY_INT_ && d->byteorder != '>';
}

Tokens tokens_of(py::handle obj, const char* name) {
  Tokens t;
  if (is_fast_array(obj.ptr())) {
    t.owner = py::reinterpret_borrow<py::object>(obj);
  } else {
    if (!reg.as_tokens) throw py::type_error(std::string(name) + " must be a 1-D int32 numpy array");
    PyObject* conv = PyObject_CallFunction(reg.as_tokens, "Os", obj.ptr(), name);
    if (!conv) throw py::error_already_set();
    t.owner = py::reinterpret_steal<py::object>(conv);
    if (!is_fast_array(conv)) throw py::type_error(std::string(name) + ": converter did not return a 1-D int32 array");
  }
  const auto* a = py::detail::array_proxy(t.owner.ptr());
  t.data = reinterpret_cast<const Tok*>(a->data);
  t.size = (size_t)a->dimensions[0];
  for (size_t i = 0; i < t.size; ++i)
    if (t.data[i] < 0)
      throw py::value_error("token id " + std::to_string(t.data[i]) + " at index " + std::to_string(i) + " of " + name +
                            " is outside [0, 2**31)");
  return t;
}

// A Draft instance without running the dataclass __init__ (frozen: object.__setattr__ semantics).
py::object make_draft(const DraftOut& d) {
  if (!reg.draft_type) throw std::logic_error("suffix_index._native used before suffix_index.index registered Draft");
  PyObject* values[5] = {new_array(d.token_ids, reg.empty_i32), new_array(d.parents, reg.empty_i32),
                         new_array(d.probs, reg.empty_f32), PyFloat_FromDouble(d.score), PyLong_FromUnsignedLong(d.match_len)};
  return new_record(reg.draft_type, reg.names, values, 5, &reg.layout);
}

void check_id(int64_t id) {
  if (id < 0) throw py::value_error("sequence id must be >= 0, got " + std::to_string(id));
}

void check_budget(int64_t max_tokens) {
  if (max_tokens < 1 || max_tokens > INT32_MAX)
    throw py::value_error("max_tokens must be in [1, 2**31), got " + std::to_string(max_tokens));
}

}  // namespace

namespace reprise {
void bind_drafter(py::module_& m);  // drafter_bindings.cc
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "Reprise native suffix index (see suffix_index.SuffixIndex for the typed API)";
  m.attr("ABI_VERSION") = 2;
  m.attr("MAX_DEPTH_LIMIT") = reprise::kMaxDepthLimit;
  m.attr("MAX_KEY_LENGTHS") = reprise::kMaxKeyLengths;

  m.def(
      "_register",
      [](py::object draft_type, py::object as_tokens, py::object empty_i32, py::object empty_f32) {
        if (!PyType_Check(draft_type.ptr())) throw py::type_error("draft_type must be a class");
        reg.draft_type = draft_type.release().ptr();
        reg.as_tokens = as_tokens.release().ptr();
        reg.empty_i32 = empty_i32.release().ptr();
        reg.empty_f32 = empty_f32.release().ptr();
        const char* names[5] = {"token_ids", "parents", "probs", "score", "match_len"};
        for (int i = 0; i < 5; ++i) reg.names[i] = PyUnicode_InternFromString(names[i]);
        reg.layout = reprise::record_layout(reg.draft_type, reg.names, 5);
      },
      "Internal: called once by suffix_index.index.");

  py::class_<SuffixIndex>(m, "SuffixIndex")
      .def(py::init([](uint32_t max_depth, uint64_t max_bytes, std::vector<uint32_t> keys) {
             return new SuffixIndex(max_depth, max_bytes, keys);
           }),
           py::arg("max_depth"), py::arg("max_bytes"), py::arg("key_lengths"))
      .def("add",
           [](SuffixIndex& self, int64_t id, py::handle tokens) {
             check_id(id);
             Tokens t = tokens_of(tokens, "tokens");
             py::gil_scoped_release nogil;
             return self.add(id, t.data, t.size);
           })
      .def("extend",
           [](SuffixIndex& self, int64_t id, py::handle tokens) {
             check_id(id);
             Tokens t = tokens_of(tokens, "tokens");
             py::gil_scoped_release nogil;
             return self.extend(id, t.data, t.size);
           })
      .def("remove",
           [](SuffixIndex& self, int64_t id) {
             check_id(id);
             py::gil_scoped_release nogil;
             self.remove(id);
           })
      .def("speculate",
           [](const SuffixIndex& self, py::handle context, int64_t max_tokens, double factor, double offset,
              double min_prob, bool use_tree) {
             check_budget(max_tokens);
             if (!(factor >= 0) || !std::isfinite(factor))
               throw py::value_error("max_spec_factor must be a finite number >= 0, got " + std::to_string(factor));
             if (!std::isfinite(offset)) throw py::value_error("max_spec_offset must be finite, got " + std::to_string(offset));
             if (!(min_prob >= 0 && min_prob <= 1))
               throw py::value_error("min_token_prob must be in [0, 1], got " + std::to_string(min_prob));
             Tokens t = tokens_of(context, "context");
             SpecParams p{(uint32_t)max_tokens, factor, offset, min_prob, use_tree};
             DraftOut d;
             {
               py::gil_scoped_release nogil;
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               d = self.tree.speculate(t.data, t.size, p);
             }
             return make_draft(d);
           })
      .def("speculate_exact",
           [](const SuffixIndex& self, py::handle context, int64_t max_tokens, int64_t min_key_len) {
             check_budget(max_tokens);
             if (min_key_len < 0) throw py::value_error("min_key_len must be >= 1, got " + std::to_string(min_key_len));
             Tokens t = tokens_of(context, "context");
             DraftOut d;
             {
               py::gil_scoped_release nogil;
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               d = self.tree.speculate_exact(t.data, t.size, (uint32_t)max_tokens,
                                             (uint32_t)std::min<int64_t>(min_key_len, UINT32_MAX));
             }
             return make_draft(d);
           })
      .def_property_readonly("num_sequences",
                             [](const SuffixIndex& self) {
                               std::shared_lock<std::shared_mutex> lock(self.mutex);
                               return self.tree.num_sequences();
                             })
      .def_property_readonly("num_tokens",
                             [](const SuffixIndex& self) {
                               std::shared_lock<std::shared_mutex> lock(self.mutex);
                               return self.tree.num_tokens();
                             })
      .def_property_readonly("max_depth", [](const SuffixIndex& self) { return self.tree.max_depth(); })
      .def_property_readonly("key_lengths", [](const SuffixIndex& self) { return self.tree.key_lengths(); })
      .def_property_readonly("max_bytes", [](const SuffixIndex& self) { return self.max_bytes; })
      .def("count",
           [](const SuffixIndex& self, py::handle tokens) {
             Tokens t = tokens_of(tokens, "tokens");
             py::gil_scoped_release nogil;
             std::shared_lock<std::shared_mutex> lock(self.mutex);
             if (t.size == 0) return self.tree.num_tokens();
             reprise::Locus l;
             return self.tree.locate(t.data, t.size, &l) ? (uint64_t)self.tree.count_of(l.node) : (uint64_t)0;
           })
      .def("memory_bytes",
           [](const SuffixIndex& self) {
             std::shared_lock<std::shared_mutex> lock(self.mutex);
             return self.tree.memory_bytes();
           })
      .def("check_integrity",
           [](const SuffixIndex& self) {
             py::gil_scoped_release nogil;
             std::shared_lock<std::shared_mutex> lock(self.mutex);
             self.tree.check_integrity();
           })
      .def("stats",
           [](const SuffixIndex& self) {
             std::shared_lock<std::shared_mutex> lock(self.mutex);
             return self.tree.stats();
           })
      .def("contains",
           [](const SuffixIndex& self, int64_t id) {
             std::shared_lock<std::shared_mutex> lock(self.mutex);
             return self.tree.contains(id);
           })
      .def("sequence_ids",
           [](const SuffixIndex& self) {
             std::vector<int64_t> ids;
             {
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               ids = self.tree.sequence_ids();
             }
             py::array_t<int64_t> out(ids.size());
             if (!ids.empty()) std::memcpy(out.mutable_data(), ids.data(), ids.size() * sizeof(int64_t));
             return out;
           })
      .def("get_sequence",
           [](const SuffixIndex& self, int64_t id) {
             std::vector<Tok> toks;
             {
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               toks = self.tree.get_sequence(id);
             }
             py::array_t<int32_t> out(toks.size());
             if (!toks.empty()) std::memcpy(out.mutable_data(), toks.data(), toks.size() * sizeof(Tok));
             return out;
           })
      .def("serialize",
           [](const SuffixIndex& self) {
             std::string s;
             {
               py::gil_scoped_release nogil;
               s = self.serialize();
             }
             return py::bytes(s);
           })
      .def_static("deserialize", [](py::bytes data) {
        char* buf;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(data.ptr(), &buf, &len) != 0) throw py::error_already_set();
        std::unique_ptr<SuffixIndex> idx;
        {
          py::gil_scoped_release nogil;
          idx = SuffixIndex::deserialize(buf, (size_t)len);
        }
        return idx;
      });

  reprise::bind_drafter(m);
}
