// The elementwise work of a Tree-LSTM cell (flybatch/tree_lstm.py), forward and backward, each
// ONE pass over a launch's rows, on the raw memory of torch tensors. The gate products are GEMMs
// run by torch before (forward) and after (backward) a pass; a pass does everything between them:
// biases, activations, the forget-gated sum of the children's cells, tanh(c), h, and in backward
// every pre-activation gradient, the children's dc and the bias gradients (column sums).
//
// Gates of a row, as the N-ary cell (and the leaf, N = 0) computes them, pre-activations from
// the GEMMs plus the biases:
//   i = sigmoid(iou_i), o = sigmoid(iou_o), u = tanh(iou_u), f_k = sigmoid(f_k),
//   c = i*u + sum_k f_k*c_k,  h = o*tanh(c);   output row [h; c].
// The forward overwrites the pre-activations with the activations (backward's operands) and
// writes tanh(c); the backward needs nothing else but the children's c.
//
// float32 evaluates exp, sigmoid and tanh with the branch-free functions below, which the
// compiler vectorises (torch.tanh costs ~2 ns an element on the benchmark machine, 10x its
// sigmoid); float64 calls std::exp and std::tanh. target_clones picks AVX-512 or AVX2 at load
// time without -march=native; there is no -ffast-math, so the arithmetic is as written.
#include "store.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace flybatch {

namespace {

// ---- float32 exp, sigmoid, tanh (vectorisable) -------------------------------------------------
inline std::int32_t bits_of(float x) {
  std::int32_t i;
  std::memcpy(&i, &x, sizeof i);
  return i;
}

inline float float_of(std::int32_t i) {
  float x;
  std::memcpy(&x, &i, sizeof x);
  return x;
}

// `condition ? a : b` on the bits: no branch for the compiler to keep (with -ftrapping-math,
// the default, GCC will not turn a ternary whose arms divide into a blend, and the loop stays
// scalar).
inline float select(bool condition, float a, float b) {
  const std::int32_t mask = -static_cast<std::int32_t>(condition);
  return float_of((bits_of(a) & mask) | (bits_of(b) & ~mask));
}

// exp(x) for x <= 0 (all that sigmoid and tanh need): x = n ln2 + r, |r| <= ln2/2, exp(r) by
// Cephes' expf polynomial, 2^n put in the exponent field. Below -88 the result is 0 (exp(-88)
// is 6e-39, under the smallest normal float); a NaN stays NaN.
inline float exp_nonpositive(float x) {
  x = select(x < -88.0f, -88.0f, x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t exponent = (bits_of(t) - bits_of(shifter) + 127) << 23;  // n >= -127
  return p * float_of(exponent);
}

inline float sigmoid(float x) {
  const float e = exp_nonpositive(select(x < 0.0f, x, -x));  // exp(-|x|): never overflows
  const float s = 1.0f / (1.0f + e);
  return select(x < 0.0f, e * s, s);
}

// tanh: an odd polynomial below |x| 0.55 (least squares on (x - tanh x)/x^3 in float64,
// weighted by x^2; 0.8 ulp at most in float32), (1 - e)/(1 + e) with
// e = exp(-2|x|) above, where no cancellation loses digits. Tested against float64 tanh over
// tiny, moderate and huge inputs (tests/test_tree_lstm.py).
inline float tanh(float x) {
  const float a = select(x < 0.0f, -x, x);
  const float e = exp_nonpositive(-2.0f * a);
  const float big = (1.0f - e) / (1.0f + e);
  const float x2 = x * x;
  float p = -2.43055006e-03f;
  p = p * x2 + 8.44287500e-03f;
  p = p * x2 - 2.17917114e-02f;
  p = p * x2 + 5.39608784e-02f;
  p = p * x2 - 1.33333012e-01f;
  p = p * x2 + 3.33333343e-01f;
  const float small = x - x * x2 * p;
  return select(a < 0.55f, small, select(x < 0.0f, -big, big));
}

// ---- float64: the library's functions ----------------------------------------------------------
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double tanh(double x) { return std::tanh(x); }

// A child's c (forward, backward) and where its dc goes (backward): row r at base + r * stride
// (stride 0: one row shared by every node of the launch).
template <typename T>
struct Child {
  const T* c;
  std::int64_t c_stride;
  T* dc;
  std::int64_t dc_stride;
};

// ---- forward -----------------------------------------------------------------------------------
// iou [rows, 3H] and f [N, rows, H]: pre-activations without bias, overwritten by activations.
// out [rows, 2H]: h, c. tanh_c [rows, H].
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void forward_pass(
    T* __restrict iou, const T* __restrict b_iou, T* __restrict f, const T* __restrict b_f,
    T* __restrict out, T* __restrict tanh_c, const Child<T>* children, std::int64_t n,
    std::int64_t rows, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* __restrict i = iou + r * 3 * H;
    T* __restrict o = i + H;
    T* __restrict u = o + H;
    T* __restrict h = out + r * 2 * H;
    T* __restrict c = h + H;
    T* __restrict tc = tanh_c + r * H;
    for (std::int64_t j = 0; j < H; ++j) {
      i[j] = sigmoid(i[j] + b_iou[j]);
      o[j] = sigmoid(o[j] + b_iou[H + j]);
      u[j] = tanh(u[j] + b_iou[2 * H + j]);
      c[j] = i[j] * u[j];
    }
    for (std::int64_t k = 0; k < n; ++k) {
      T* __restrict fk = f + (k * rows + r) * H;
      const T* __restrict ck = children[k].c + r * children[k].c_stride;
      for (std::int64_t j = 0; j < H; ++j) {
        fk[j] = sigmoid(fk[j] + b_f[j]);
        c[j] += fk[j] * ck[j];
      }
    }
    for (std::int64_t j = 0; j < H; ++j) {
      tc[j] = tanh(c[j]);
      h[j] = o[j] * tc[j];
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------
// From the activations and grad [rows, 2H] (dh, dc of the output):
//   dc = dc_out + dh * o * (1 - tanh(c)^2)
//   d(i, o, u) pre-activation = (dc * u * i(1 - i), dh * tanh(c) * o(1 - o), dc * i * (1 - u^2))
//   d f_k pre-activation = dc * c_k * f_k(1 - f_k),  the child's dc_k = dc * f_k,
// and the bias gradients, the column sums of d(i, o, u) and of sum_k d f_k.
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void backward_pass(
    const T* __restrict iou, const T* __restrict f, const T* __restrict tanh_c,
    const T* __restrict grad, T* __restrict d_iou, T* __restrict d_f, T* __restrict db_iou,
    T* __restrict db_f, T* __restrict dc, const Child<T>* children, std::int64_t n,
    std::int64_t rows, std::int64_t H) {
  for (std::int64_t j = 0; j < 3 * H; ++j) db_iou[j] = T(0);
  for (std::int64_t j = 0; j < H; ++j) db_f[j] = T(0);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* __restrict i = iou + r * 3 * H;
    const T* __restrict o = i + H;
    const T* __restrict u = o + H;
    const T* __restrict tc = tanh_c + r * H;
    const T* __restrict dh = grad + r * 2 * H;
    const T* __restrict dc_out = dh + H;
    T* __restrict di = d_iou + r * 3 * H;
    T* __restrict d_o = di + H;
    T* __restrict du = d_o + H;
    for (std::int64_t j = 0; j < H; ++j) {
      const T d = dc_out[j] + dh[j] * o[j] * (T(1) - tc[j] * tc[j]);
      dc[j] = d;
      di[j] = d * u[j] * i[j] * (T(1) - i[j]);
      d_o[j] = dh[j] * tc[j] * o[j] * (T(1) - o[j]);
      du[j] = d * i[j] * (T(1) - u[j] * u[j]);
      db_iou[j] += di[j];
      db_iou[H + j] += d_o[j];
      db_iou[2 * H + j] += du[j];
    }
    for (std::int64_t k = 0; k < n; ++k) {
      const T* __restrict fk = f + (k * rows + r) * H;
      const T* __restrict ck = children[k].c + r * children[k].c_stride;
      T* __restrict dfk = d_f + (k * rows + r) * H;
      T* __restrict dck = children[k].dc + r * children[k].dc_stride;
      for (std::int64_t j = 0; j < H; ++j) {
        dfk[j] = dc[j] * ck[j] * fk[j] * (T(1) - fk[j]);
        db_f[j] += dfk[j];
        dck[j] = dc[j] * fk[j];
      }
    }
  }
}

// ---- bindings ----------------------------------------------------------------------------------
template <typename T>
T* address(PyObject* arg) {
  return reinterpret_cast<T*>(PyLong_AsVoidPtr(arg));
}

// The children's (c, c_stride[, dc, dc_stride]) from `args`, `fields` ints each.
template <typename T>
bool read_children(PyObject* const* args, Py_ssize_t count, int fields,
                   std::vector<Child<T>>* children) {
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* const* a = args + k * fields;
    Child<T> child{address<T>(a[0]), PyLong_AsLongLong(a[1]), nullptr, 0};
    if (fields == 4) {
      child.dc = address<T>(a[2]);
      child.dc_stride = PyLong_AsLongLong(a[3]);
    }
    children->push_back(child);
  }
  return !PyErr_Occurred();
}

// tree_lstm_forward(iou, b_iou, f, b_f, out, tanh_c, rows, H, is_double, *(c_k, c_stride_k)):
// addresses of tensors of one dtype (f, b_f: 0 without children); see forward_pass.
template <typename T>
bool run_forward(PyObject* const* args, Py_ssize_t n_children, std::int64_t rows,
                 std::int64_t H) {
  std::vector<Child<T>> children;
  T* p[6];
  for (int k = 0; k < 6; ++k) p[k] = address<T>(args[k]);
  if (PyErr_Occurred() || !read_children<T>(args + 9, n_children, 2, &children)) return false;
  forward_pass<T>(p[0], p[1], p[2], p[3], p[4], p[5], children.data(), n_children, rows, H);
  return true;
}

PyObject* tree_lstm_forward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n < 9 || (n - 9) % 2 != 0) {
    PyErr_SetString(PyExc_TypeError,
                    "tree_lstm_forward takes 9 arguments and (c, stride) per child");
    return nullptr;
  }
  const std::int64_t rows = PyLong_AsLongLong(args[6]);
  const std::int64_t H = PyLong_AsLongLong(args[7]);
  const int is_double = PyObject_IsTrue(args[8]);
  if (PyErr_Occurred()) return nullptr;
  const Py_ssize_t children = (n - 9) / 2;
  const bool ok = is_double ? run_forward<double>(args, children, rows, H)
                            : run_forward<float>(args, children, rows, H);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// tree_lstm_backward(iou, f, tanh_c, grad, d_iou, d_f, db_iou, db_f, rows, H, is_double,
// *(c_k, c_stride_k, dc_k, dc_stride_k)); see backward_pass.
template <typename T>
bool run_backward(PyObject* const* args, Py_ssize_t n_children, std::int64_t rows,
                  std::int64_t H) {
  std::vector<Child<T>> children;
  T* p[8];
  for (int k = 0; k < 8; ++k) p[k] = address<T>(args[k]);
  if (PyErr_Occurred() || !read_children<T>(args + 11, n_children, 4, &children)) return false;
  std::vector<T> dc(static_cast<std::size_t>(H));  // one row's dc
  backward_pass<T>(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], dc.data(), children.data(),
                   n_children, rows, H);
  return true;
}

PyObject* tree_lstm_backward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n < 11 || (n - 11) % 4 != 0) {
    PyErr_SetString(PyExc_TypeError,
                    "tree_lstm_backward takes 11 arguments and (c, stride, dc, stride) per child");
    return nullptr;
  }
  const std::int64_t rows = PyLong_AsLongLong(args[8]);
  const std::int64_t H = PyLong_AsLongLong(args[9]);
  const int is_double = PyObject_IsTrue(args[10]);
  if (PyErr_Occurred()) return nullptr;
  const Py_ssize_t children = (n - 11) / 4;
  const bool ok = is_double ? run_backward<double>(args, children, rows, H)
                            : run_backward<float>(args, children, rows, H);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef kTreeLstmMethods[] = {
    {"tree_lstm_forward",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tree_lstm_forward)),
     METH_FASTCALL,
     "tree_lstm_forward(iou, b_iou, f, b_f, out, tanh_c, rows, H, is_double, *(c, stride)): "
     "a Tree-LSTM cell's elementwise forward, on the addresses of tensors."},
    {"tree_lstm_backward",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tree_lstm_backward)),
     METH_FASTCALL,
     "tree_lstm_backward(iou, f, tanh_c, grad, d_iou, d_f, db_iou, db_f, rows, H, is_double, "
     "*(c, stride, dc, stride)): a Tree-LSTM cell's elementwise backward."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_tree_lstm(PyObject* module) {
  return PyModule_AddFunctions(module, kTreeLstmMethods) == 0;
}

}  // namespace flybatch
