// Placeholder module: the native suffix index lands here (see issue 2).
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_native, m) {
  m.doc() = "Reprise native suffix index";
  m.attr("ABI_VERSION") = 1;
}
