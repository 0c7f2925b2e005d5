// flybatch._core: the Python bindings of the compiled core, and nothing else. Each stage's
// algorithms live in their own file over plain arrays; a binding here reads the Python
// arguments, calls the stage and translates errors. To add a stage: write <stage>.cpp/.h, wrap
// its functions below and list them in kMethods (setup.py compiles every csrc/*.cpp).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace {

PyMethodDef kMethods[] = {
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "flybatch._core",
    "The compiled core of flybatch: the per-node work of each stage (see csrc/).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__core() { return PyModule_Create(&kModule); }
