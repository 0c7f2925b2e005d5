// The elementwise part of one step of an LSTM layer (flybatch/lstm_layer.py's stepwise layer),
// forward and backward, on the raw memory of contiguous torch tensors: one pass over the step's
// rows instead of the ~7 (forward) and ~15 (backward) torch ops, each a pass and a dispatch, that
// the same arithmetic takes in Python. The forward evaluates the gates' sigmoid and tanh and
// tanh(c): float32 with activations.h's vectorised functions (torch's tanh is ~2 ns an element on
// the benchmark machine), float64 with the library's. The backward evaluates no transcendental
// function (the forward saved the activations and tanh(c)), so its loop is plain multiply-adds.
// target_clones picks AVX-512 or AVX2 at load time without -march=native, and without
// -ffast-math the results are the arithmetic as written.
#include "activations.h"
#include "store.h"

#include <cstddef>
#include <cstdint>

namespace flybatch {

namespace {

using activations::sigmoid;  // float32 vectorisable, float64 the library's
using activations::tanh;

// One row of a step's forward; hidden size H, torch's gate order (i, f, g, o): the gates'
// pre-activations (x W_ih^T + b + h_prev W_hh^T) are overwritten by their activations (the
// backward's operands), then c = f * c_prev + i * g (i * g on the first step: `first`, whose
// c_prev is the zero state), tanh_c = tanh(c), h = o * tanh_c.
template <typename T, bool first>
inline void forward_row(T* __restrict a, const T* __restrict cp, T* __restrict c,
                        T* __restrict tc, T* __restrict h, std::int64_t H) {
  T* i = a;
  T* f = a + H;
  T* g = f + H;
  T* o = g + H;
  for (std::int64_t j = 0; j < 2 * H; ++j) i[j] = sigmoid(i[j]);  // i and f
  for (std::int64_t j = 0; j < H; ++j) {
    g[j] = tanh(g[j]);
    o[j] = sigmoid(o[j]);
  }
  for (std::int64_t j = 0; j < H; ++j) {
    c[j] = first ? i[j] * g[j] : f[j] * cp[j] + i[j] * g[j];
    tc[j] = tanh(c[j]);
    h[j] = o[j] * tc[j];
  }
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void forward_step(
    T* gates, const T* c_prev, T* c, T* tanh_c, T* h, std::int64_t rows, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    if (c_prev) {
      forward_row<T, false>(gates + r * 4 * H, c_prev + r * H, c + r * H, tanh_c + r * H,
                            h + r * H, H);
    } else {
      forward_row<T, true>(gates + r * 4 * H, nullptr, c + r * H, tanh_c + r * H, h + r * H, H);
    }
  }
}

// One row of a step's backward; hidden size H, gates in torch's order (i, f, g, o), activated:
//   dc    = dc_next + dh * o * (1 - tanh(c)^2)
//   d(i, f, g, o) (pre-activation) = (dc * g * i (1 - i), dc * c_prev * f (1 - f),
//                                     dc * i * (1 - g^2), dh * tanh(c) * o (1 - o))
//   dc_prev = dc * f, written over dc_next.
// `first`: the first step, whose c_prev is the zero state (no forget-gate gradient).
template <typename T, bool first>
inline void backward_row(const T* __restrict i, const T* __restrict tc, const T* __restrict cp,
                         const T* __restrict dh, T* __restrict dc, T* __restrict di,
                         std::int64_t H) {
  const T* f = i + H;
  const T* g = f + H;
  const T* o = g + H;
  T* df = di + H;
  T* dg = df + H;
  T* d_o = dg + H;
  for (std::int64_t j = 0; j < H; ++j) {
    const T d = dc[j] + dh[j] * o[j] * (T(1) - tc[j] * tc[j]);
    d_o[j] = dh[j] * tc[j] * o[j] * (T(1) - o[j]);
    di[j] = d * g[j] * i[j] * (T(1) - i[j]);
    dg[j] = d * i[j] * (T(1) - g[j] * g[j]);
    df[j] = first ? T(0) : d * cp[j] * f[j] * (T(1) - f[j]);
    dc[j] = d * f[j];
  }
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void backward_step(
    const T* acts, const T* tanh_c, const T* c_prev, const T* dh, T* dc, T* dgates,
    std::int64_t rows, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    if (c_prev) {
      backward_row<T, false>(acts + r * 4 * H, tanh_c + r * H, c_prev + r * H, dh + r * H,
                             dc + r * H, dgates + r * 4 * H, H);
    } else {
      backward_row<T, true>(acts + r * 4 * H, tanh_c + r * H, nullptr, dh + r * H, dc + r * H,
                            dgates + r * 4 * H, H);
    }
  }
}

// A step's binding: `kTensors` addresses of contiguous tensors of one dtype, then rows, H and
// is_double; `run(T{}, p, rows, H)` runs the step of T (float or double) on the addresses `p`.
// NULL with a Python error where an argument is wrong.
template <std::size_t kTensors, typename Run>
PyObject* step_binding(const char* name, PyObject* const* args, Py_ssize_t n, Run run) {
  if (n != static_cast<Py_ssize_t>(kTensors + 3)) {
    PyErr_Format(PyExc_TypeError, "%s takes %d arguments", name, static_cast<int>(kTensors + 3));
    return nullptr;
  }
  void* p[kTensors];
  for (std::size_t k = 0; k < kTensors; ++k) p[k] = PyLong_AsVoidPtr(args[k]);
  const std::int64_t rows = PyLong_AsLongLong(args[kTensors]);
  const std::int64_t H = PyLong_AsLongLong(args[kTensors + 1]);
  const int is_double = PyObject_IsTrue(args[kTensors + 2]);
  if (PyErr_Occurred()) return nullptr;
  if (is_double) {
    run(double{}, p, rows, H);
  } else {
    run(float{}, p, rows, H);
  }
  Py_RETURN_NONE;
}

// lstm_forward_step(gates, c_prev, c, tanh_c, h, rows, H, is_double): addresses of contiguous
// tensors of one dtype (c_prev 0 for the first step); see forward_step.
PyObject* lstm_forward_step(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return step_binding<5>("lstm_forward_step", args, n,
                         [](auto zero, void* const* p, std::int64_t rows, std::int64_t H) {
                           using T = decltype(zero);
                           forward_step<T>(static_cast<T*>(p[0]), static_cast<T*>(p[1]),
                                           static_cast<T*>(p[2]), static_cast<T*>(p[3]),
                                           static_cast<T*>(p[4]), rows, H);
                         });
}

// lstm_backward_step(acts, tanh_c, c_prev, dh, dc, dgates, rows, H, is_double): addresses of
// contiguous tensors of one dtype (c_prev 0 for the first step); see backward_step.
PyObject* lstm_backward_step(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return step_binding<6>("lstm_backward_step", args, n,
                         [](auto zero, void* const* p, std::int64_t rows, std::int64_t H) {
                           using T = decltype(zero);
                           backward_step<T>(static_cast<T*>(p[0]), static_cast<T*>(p[1]),
                                            static_cast<T*>(p[2]), static_cast<T*>(p[3]),
                                            static_cast<T*>(p[4]), static_cast<T*>(p[5]), rows,
                                            H);
                         });
}

PyMethodDef kLstmMethods[] = {
    {"lstm_forward_step",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lstm_forward_step)),
     METH_FASTCALL,
     "lstm_forward_step(gates, c_prev, c, tanh_c, h, rows, H, is_double): one step of an LSTM "
     "layer's forward after its products, elementwise, on the addresses of contiguous tensors: "
     "the gates activated in place, c, tanh(c) and h written."},
    {"lstm_backward_step",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lstm_backward_step)),
     METH_FASTCALL,
     "lstm_backward_step(acts, tanh_c, c_prev, dh, dc, dgates, rows, H, is_double): one step of "
     "an LSTM layer's backward, elementwise, on the addresses of contiguous tensors."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_lstm(PyObject* module) { return PyModule_AddFunctions(module, kLstmMethods) == 0; }

}  // namespace flybatch
