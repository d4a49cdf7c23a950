// Building the package's frozen record types (suffix_index.Draft, retrieval's DraftTree) from native
// results without running their dataclass __init__: shared by both binding files.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <structmember.h>

#include <cstring>
#include <vector>

namespace reprise {

// A new 1-D array holding `v`, or a new reference to the shared read-only `empty` one.
template <typename T>
PyObject* new_array(const std::vector<T>& v, PyObject* empty) {
  if (v.empty()) {
    Py_INCREF(empty);
    return empty;
  }
  // NumPy's constructor called directly with a dtype looked up once: array_t's own path builds shape
  // and stride vectors and looks the dtype up on every call (three arrays per draft).
  static PyObject* const descr = pybind11::dtype::of<T>().release().ptr();
  const auto& api = pybind11::detail::npy_api::get();
  Py_INCREF(descr);  // stolen by the constructor
  const Py_intptr_t n = (Py_intptr_t)v.size();
  PyObject* a = api.PyArray_NewFromDescr_(api.PyArray_Type_, descr, 1, &n, nullptr, nullptr, 0, nullptr);
  if (a) std::memcpy(pybind11::detail::array_proxy(a)->data, v.data(), v.size() * sizeof(T));
  return a;  // null with the Python error set when it failed
}

// Where a record type keeps its fields: when every field is a plain __slots__ member (a dataclass with
// slots=True), the byte offset of each in the instance, so new_record fills them directly instead of
// looking each attribute up (a few percent of a draft call); otherwise none.
struct RecordLayout {
  bool direct = false;
  Py_ssize_t offsets[8] = {};
};

inline RecordLayout record_layout(PyObject* type, PyObject* const* names, int n) {
  RecordLayout layout;
  if (n > 8) return layout;
  layout.direct = true;
  for (int i = 0; i < n && layout.direct; ++i) {
    PyObject* d = PyObject_GetAttr(type, names[i]);
    if (d && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
      const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      layout.direct = m->type == T_OBJECT_EX && !(m->flags & READONLY);
      layout.offsets[i] = m->offset;
    } else {
      layout.direct = false;
    }
    Py_XDECREF(d);
  }
  PyErr_Clear();
  return layout;
}

// An instance of `type` with attribute names[i] = values[i] (object.__setattr__ semantics, so frozen
// dataclasses work); steals the references in `values`, even on error.
inline pybind11::object new_record(PyObject* type_obj, PyObject* const* names, PyObject** values, int n,
                                   const RecordLayout* layout = nullptr) {
  auto* type = reinterpret_cast<PyTypeObject*>(type_obj);
  pybind11::object obj = pybind11::reinterpret_steal<pybind11::object>(type->tp_alloc(type, 0));
  int rc = obj ? 0 : -1;
  for (int i = 0; i < n; ++i) {
    if (rc == 0 && !values[i]) rc = -1;  // a failed allocation left its Python error set
    if (rc == 0 && layout && layout->direct) {  // a fresh instance's slots are empty: the slot takes the reference
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj.ptr()) + layout->offsets[i]) = values[i];
      continue;
    }
    if (rc == 0) rc = PyObject_GenericSetAttr(obj.ptr(), names[i], values[i]);
    Py_XDECREF(values[i]);
  }
  if (rc != 0) throw pybind11::error_already_set();
  return obj;
}

}  // namespace reprise
