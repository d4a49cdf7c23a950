// Python bindings of the suffix index (suffix_index._native). The typed facade is suffix_index/index.py;
// these functions take 1-D C-contiguous int32 arrays (anything else is a TypeError) and release the GIL
// while the index works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "index.h"

namespace py = pybind11;
using reprise::DraftOut;
using reprise::SpecParams;
using reprise::SuffixIndex;
using reprise::Tok;

namespace {

// A borrowed view of a validated token array (the caller keeps the array alive).
struct Tokens {
  const Tok* data;
  size_t size;
};

Tokens tokens_of(const py::handle& obj, const char* name) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + " must be a numpy int32 array, got " + std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!arr.dtype().is(py::dtype::of<int32_t>()))
    throw py::type_error(std::string(name) + " must have dtype int32, got " + std::string(py::str(arr.dtype())));
  if (arr.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(arr.ndim()) + " dimensions");
  if (!(arr.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be contiguous");
  const Tok* data = static_cast<const Tok*>(arr.data());
  size_t n = (size_t)arr.shape(0);
  for (size_t i = 0; i < n; ++i)
    if (data[i] < 0)
      throw py::value_error("token id " + std::to_string(data[i]) + " at index " + std::to_string(i) + " of " + name +
                            " is negative (token ids are in [0, 2**31))");
  return Tokens{data, n};
}

py::tuple draft_tuple(const DraftOut& d) {
  size_t n = d.token_ids.size();
  py::array_t<int32_t> ids(n), parents(n);
  py::array_t<float> probs(n);
  if (n) {
    std::memcpy(ids.mutable_data(), d.token_ids.data(), n * sizeof(int32_t));
    std::memcpy(parents.mutable_data(), d.parents.data(), n * sizeof(int32_t));
    std::memcpy(probs.mutable_data(), d.probs.data(), n * sizeof(float));
  }
  return py::make_tuple(std::move(ids), std::move(parents), std::move(probs), d.score, d.match_len);
}

void check_id(int64_t id) {
  if (id < 0) throw py::value_error("sequence id must be >= 0, got " + std::to_string(id));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Reprise native suffix index (see suffix_index.SuffixIndex for the typed API)";
  m.attr("ABI_VERSION") = 2;
  m.attr("MAX_DEPTH_LIMIT") = reprise::kMaxDepthLimit;
  m.attr("MAX_KEY_LENGTHS") = reprise::kMaxKeyLengths;

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
             py::gil_scoped_release nogil;
             self.remove(id);
           })
      .def("speculate",
           [](const SuffixIndex& self, py::handle context, uint32_t max_tokens, double factor, double offset,
              double min_prob, bool use_tree) {
             Tokens t = tokens_of(context, "context");
             SpecParams p{max_tokens, factor, offset, min_prob, use_tree};
             DraftOut d;
             {
               py::gil_scoped_release nogil;
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               d = self.tree.speculate(t.data, t.size, p);
             }
             return draft_tuple(d);
           })
      .def("speculate_exact",
           [](const SuffixIndex& self, py::handle context, uint32_t max_tokens, uint32_t min_key_len) {
             Tokens t = tokens_of(context, "context");
             DraftOut d;
             {
               py::gil_scoped_release nogil;
               std::shared_lock<std::shared_mutex> lock(self.mutex);
               d = self.tree.speculate_exact(t.data, t.size, max_tokens, min_key_len);
             }
             return draft_tuple(d);
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
}
