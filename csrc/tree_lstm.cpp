// The elementwise work of the Tree-LSTM cells (flybatch/tree_lstm.py), forward and backward,
// each ONE pass over a launch's rows, on the raw memory of torch tensors. The gate products are
// GEMMs run by torch before (forward) and after (backward) a pass; a pass does everything between
// them: biases, activations, the forget-gated sum of the children's cells, tanh(c), h, and in
// backward every pre-activation gradient, the children's dc and the bias gradients (column sums).
//
// Gates of a row, as the N-ary cell (and the leaf, N = 0) computes them, pre-activations from
// the GEMMs plus the biases:
//   i = sigmoid(iou_i), o = sigmoid(iou_o), u = tanh(iou_u), f_k = sigmoid(f_k),
//   c = i*u + sum_k f_k*c_k,  h = o*tanh(c);   output row [h; c].
// The child-sum cell is the same over each node's own number of children, its forget gates'
// pre-activations U_f h_m + (W_f x + b_f). The forward overwrites the pre-activations with the
// activations (backward's operands) and writes tanh(c); the backward needs nothing else but the
// children's c. A node's row is done in steps of one loop each (gates, each child's forget
// gate, the output), over data that stays in L1.
//
// float32 evaluates sigmoid and tanh with the branch-free functions of activations.h, which the
// compiler vectorises (torch.tanh costs ~2 ns an element on the benchmark machine, 10x its
// sigmoid); float64 calls std::exp and std::tanh. target_clones picks AVX-512 or AVX2 at load
// time without -march=native; there is no -ffast-math, so the arithmetic is as written. At the
// build's flags GCC 12 vectorises every loop of the float32 passes in each clone (64-, 32- and
// 16-byte vectors; checked with -fopt-info-vec-optimized); the float64 forward stays scalar.
#include "activations.h"
#include "store.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace flybatch {

namespace {

// float32 vectorisable, float64 the library's (activations.h)
using activations::sigmoid;
using activations::tanh;

// A child's c (forward, backward) and where its dc goes (backward): row r at base + r * stride
// (stride 0: one row shared by every node of the launch).
template <typename T>
struct Child {
  const T* c;
  std::int64_t c_stride;
  T* dc;
  std::int64_t dc_stride;
};

// ---- one node's row, in steps (each a loop the compiler vectorises) -----------------------------
// Gates i, o, u from their pre-activations (overwritten by the activations) and the bias;
// c = i * u.
template <typename T>
inline void gates_forward(T* __restrict i, T* __restrict o, T* __restrict u,
                          const T* __restrict b_iou, T* __restrict c, std::int64_t H) {
  for (std::int64_t j = 0; j < H; ++j) {
    i[j] = sigmoid(i[j] + b_iou[j]);
    o[j] = sigmoid(o[j] + b_iou[H + j]);
    u[j] = tanh(u[j] + b_iou[2 * H + j]);
    c[j] = i[j] * u[j];
  }
}

// One child's forget gate from its pre-activation (overwritten) and `bias`; c += f * c_child.
template <typename T>
inline void forget_forward(T* __restrict f, const T* __restrict bias, const T* __restrict c_child,
                           T* __restrict c, std::int64_t H) {
  for (std::int64_t j = 0; j < H; ++j) {
    f[j] = sigmoid(f[j] + bias[j]);
    c[j] += f[j] * c_child[j];
  }
}

template <typename T>
inline void output_forward(const T* __restrict o, const T* __restrict c, T* __restrict tc,
                           T* __restrict h, std::int64_t H) {
  for (std::int64_t j = 0; j < H; ++j) {
    tc[j] = tanh(c[j]);
    h[j] = o[j] * tc[j];
  }
}

// From the activations and the output's gradient (dh, dc_out):
//   dc = dc_out + dh * o * (1 - tanh(c)^2)
//   d(i, o, u) pre-activation = (dc * u * i(1 - i), dh * tanh(c) * o(1 - o), dc * i * (1 - u^2)),
// their column sums added to db_iou.
template <typename T>
inline void gates_backward(const T* __restrict i, const T* __restrict o, const T* __restrict u,
                           const T* __restrict tc, const T* __restrict dh,
                           const T* __restrict dc_out, T* __restrict dc, T* __restrict di,
                           T* __restrict d_o, T* __restrict du, T* __restrict db_iou,
                           std::int64_t H) {
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
}

// Node r's gates: `gates_backward` on its rows of iou [rows, 3H], tanh_c [rows, H], grad
// [rows, 2H] (dh, dc_out) and d_iou [rows, 3H]; dc [H] is its dc.
template <typename T>
inline void node_gates_backward(const T* iou, const T* tanh_c, const T* grad, T* d_iou, T* dc,
                                T* db_iou, std::int64_t r, std::int64_t H) {
  const T* i = iou + r * 3 * H;
  const T* dh = grad + r * 2 * H;
  T* di = d_iou + r * 3 * H;
  gates_backward(i, i + H, i + 2 * H, tanh_c + r * H, dh, dh + H, dc, di, di + H, di + 2 * H,
                 db_iou, H);
}

// One child's: d f pre-activation = dc * c_child * f(1 - f), added to `df_sum` too; the
// child's dc_child = dc * f.
template <typename T>
inline void forget_backward(const T* __restrict f, const T* __restrict c_child,
                            const T* __restrict dc, T* __restrict df, T* __restrict dc_child,
                            T* __restrict df_sum, std::int64_t H) {
  for (std::int64_t j = 0; j < H; ++j) {
    df[j] = dc[j] * c_child[j] * f[j] * (T(1) - f[j]);
    df_sum[j] += df[j];
    dc_child[j] = dc[j] * f[j];
  }
}

// ---- N-ary (and the leaf, N = 0) ----------------------------------------------------------------
// iou [rows, 3H] and f [N, rows, H]: pre-activations without bias, overwritten by activations;
// child k's forget gate f_k = sigmoid(f[k] + b_f). out [rows, 2H]: h, c. tanh_c [rows, H].
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void nary_forward(
    T* iou, const T* b_iou, T* f, const T* b_f, T* out, T* tanh_c, const Child<T>* children,
    std::int64_t n, std::int64_t rows, std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* i = iou + r * 3 * H;
    T* h = out + r * 2 * H;
    gates_forward(i, i + H, i + 2 * H, b_iou, h + H, H);
    for (std::int64_t k = 0; k < n; ++k) {
      forget_forward(f + (k * rows + r) * H, b_f, children[k].c + r * children[k].c_stride,
                     h + H, H);
    }
    output_forward(i + H, h + H, tanh_c + r * H, h, H);
  }
}

// grad [rows, 2H]; d_iou, d_f shaped as iou, f; db_iou [3H] and db_f [H] are written (column
// sums); each child's dc goes to its `dc` rows.
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void nary_backward(
    const T* iou, const T* f, const T* tanh_c, const T* grad, T* d_iou, T* d_f, T* db_iou,
    T* db_f, T* dc, const Child<T>* children, std::int64_t n, std::int64_t rows,
    std::int64_t H) {
  std::fill(db_iou, db_iou + 3 * H, T(0));
  std::fill(db_f, db_f + H, T(0));
  for (std::int64_t r = 0; r < rows; ++r) {
    node_gates_backward(iou, tanh_c, grad, d_iou, dc, db_iou, r, H);
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t at = (k * rows + r) * H;
      forget_backward(f + at, children[k].c + r * children[k].c_stride, dc, d_f + at,
                      children[k].dc + r * children[k].dc_stride, db_f, H);
    }
  }
}

// ---- child-sum ---------------------------------------------------------------------------------
// Node r's children are the rows offsets[r] .. offsets[r + 1] - 1 of the launch's children (c
// at children.c, dc at children.dc). f [M, H]: each child's U_f h_m, overwritten by its forget
// gate sigmoid(U_f h_m + fx[r]); fx [rows, H]: W_f x + b_f, by node.
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void
child_sum_forward(T* iou, const T* b_iou, T* f, const T* fx, T* out, T* tanh_c,
                  const Child<T>& children, const std::int64_t* offsets, std::int64_t rows,
                  std::int64_t H) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* i = iou + r * 3 * H;
    T* h = out + r * 2 * H;
    gates_forward(i, i + H, i + 2 * H, b_iou, h + H, H);
    for (std::int64_t m = offsets[r]; m < offsets[r + 1]; ++m) {
      forget_forward(f + m * H, fx + r * H, children.c + m * children.c_stride, h + H, H);
    }
    output_forward(i + H, h + H, tanh_c + r * H, h, H);
  }
}

// d_f [M, H]: each child's forget pre-activation gradient; d_fx [rows, H]: their sum by node
// (the gradient of W_f x + b_f); db_f, the column sums of d_fx.
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void
child_sum_backward(const T* iou, const T* f, const T* tanh_c, const T* grad, T* d_iou, T* d_f,
                   T* d_fx, T* db_iou, T* db_f, T* dc, const Child<T>& children,
                   const std::int64_t* offsets, std::int64_t rows, std::int64_t H) {
  std::fill(db_iou, db_iou + 3 * H, T(0));
  std::fill(db_f, db_f + H, T(0));
  for (std::int64_t r = 0; r < rows; ++r) {
    node_gates_backward(iou, tanh_c, grad, d_iou, dc, db_iou, r, H);
    T* dfx = d_fx + r * H;
    std::fill(dfx, dfx + H, T(0));
    for (std::int64_t m = offsets[r]; m < offsets[r + 1]; ++m) {
      forget_backward(f + m * H, children.c + m * children.c_stride, dc, d_f + m * H,
                      children.dc + m * children.dc_stride, dfx, H);
    }
    for (std::int64_t j = 0; j < H; ++j) db_f[j] += dfx[j];
  }
}

// ---- bindings ----------------------------------------------------------------------------------
// Every argument is a Python int: an address of a tensor's first element, a size, a stride (in
// elements) or a flag. `is_double` picks the dtype of all the tensors.

// The arguments as int64, or false with a Python error.
bool read_ints(const char* name, PyObject* const* args, Py_ssize_t n, Py_ssize_t fixed,
               Py_ssize_t per_child, std::vector<std::int64_t>* out) {
  if (n < fixed || (per_child ? (n - fixed) % per_child != 0 : n != fixed)) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments%s", name, fixed,
                 per_child ? " and a group per child" : "");
    return false;
  }
  for (Py_ssize_t k = 0; k < n; ++k) out->push_back(PyLong_AsLongLong(args[k]));
  return !PyErr_Occurred();
}

template <typename T>
T* at(std::int64_t address) {
  return reinterpret_cast<T*>(address);
}

// The children's groups of `a` from index `first`: (c, c_stride) or (c, c_stride, dc, dc_stride).
template <typename T>
std::vector<Child<T>> children_of(const std::vector<std::int64_t>& a, std::size_t first,
                                  std::size_t per_child) {
  std::vector<Child<T>> children;
  for (std::size_t k = first; k + per_child <= a.size(); k += per_child) {
    children.push_back({at<T>(a[k]), a[k + 1], per_child == 4 ? at<T>(a[k + 2]) : nullptr,
                        per_child == 4 ? a[k + 3] : 0});
  }
  return children;
}

// A pass's binding: its int arguments read (`fixed` of them, then groups of `per_child`), and
// `as_double` or `as_float` run on them by the is_double flag, the last fixed argument.
using Pass = void (*)(const std::vector<std::int64_t>&);
PyObject* run_pass(const char* name, PyObject* const* args, Py_ssize_t n, Py_ssize_t fixed,
                   Py_ssize_t per_child, Pass as_float, Pass as_double) {
  std::vector<std::int64_t> a;
  if (!read_ints(name, args, n, fixed, per_child, &a)) return nullptr;
  (a[fixed - 1] ? as_double : as_float)(a);
  Py_RETURN_NONE;
}

template <typename T>
void nary_forward_at(const std::vector<std::int64_t>& a) {
  const std::vector<Child<T>> children = children_of<T>(a, 9, 2);
  nary_forward<T>(at<T>(a[0]), at<T>(a[1]), at<T>(a[2]), at<T>(a[3]), at<T>(a[4]), at<T>(a[5]),
                  children.data(), static_cast<std::int64_t>(children.size()), a[6], a[7]);
}

// tree_lstm_forward(iou, b_iou, f, b_f, out, tanh_c, rows, H, is_double, *(c_k, c_stride_k));
// f, b_f: 0 without children. See nary_forward.
PyObject* tree_lstm_forward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return run_pass("tree_lstm_forward", args, n, 9, 2, nary_forward_at<float>,
                  nary_forward_at<double>);
}

template <typename T>
void nary_backward_at(const std::vector<std::int64_t>& a) {
  const std::vector<Child<T>> children = children_of<T>(a, 11, 4);
  std::vector<T> dc(static_cast<std::size_t>(a[9]));  // one row's dc
  nary_backward<T>(at<T>(a[0]), at<T>(a[1]), at<T>(a[2]), at<T>(a[3]), at<T>(a[4]), at<T>(a[5]),
                   at<T>(a[6]), at<T>(a[7]), dc.data(), children.data(),
                   static_cast<std::int64_t>(children.size()), a[8], a[9]);
}

// tree_lstm_backward(iou, f, tanh_c, grad, d_iou, d_f, db_iou, db_f, rows, H, is_double,
// *(c_k, c_stride_k, dc_k, dc_stride_k)). See nary_backward.
PyObject* tree_lstm_backward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return run_pass("tree_lstm_backward", args, n, 11, 4, nary_backward_at<float>,
                  nary_backward_at<double>);
}

template <typename T>
void child_sum_forward_at(const std::vector<std::int64_t>& a) {
  const Child<T> children{at<T>(a[6]), a[7], nullptr, 0};
  child_sum_forward<T>(at<T>(a[0]), at<T>(a[1]), at<T>(a[2]), at<T>(a[3]), at<T>(a[4]),
                       at<T>(a[5]), children, at<const std::int64_t>(a[8]), a[9], a[10]);
}

// tree_lstm_child_sum_forward(iou, b_iou, f, fx, out, tanh_c, c, c_stride, offsets, rows, H,
// is_double); offsets: an int64 tensor of rows + 1. See child_sum_forward.
PyObject* tree_lstm_child_sum_forward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return run_pass("tree_lstm_child_sum_forward", args, n, 12, 0, child_sum_forward_at<float>,
                  child_sum_forward_at<double>);
}

template <typename T>
void child_sum_backward_at(const std::vector<std::int64_t>& a) {
  const Child<T> children{at<T>(a[9]), a[10], at<T>(a[11]), a[12]};
  std::vector<T> dc(static_cast<std::size_t>(a[15]));  // one row's dc
  child_sum_backward<T>(at<T>(a[0]), at<T>(a[1]), at<T>(a[2]), at<T>(a[3]), at<T>(a[4]),
                        at<T>(a[5]), at<T>(a[6]), at<T>(a[7]), at<T>(a[8]), dc.data(), children,
                        at<const std::int64_t>(a[13]), a[14], a[15]);
}

// tree_lstm_child_sum_backward(iou, f, tanh_c, grad, d_iou, d_f, d_fx, db_iou, db_f, c,
// c_stride, dc, dc_stride, offsets, rows, H, is_double). See child_sum_backward.
PyObject* tree_lstm_child_sum_backward(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return run_pass("tree_lstm_child_sum_backward", args, n, 17, 0, child_sum_backward_at<float>,
                  child_sum_backward_at<double>);
}

PyCFunction fast(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kTreeLstmMethods[] = {
    {"tree_lstm_forward", fast(tree_lstm_forward), METH_FASTCALL,
     "tree_lstm_forward(iou, b_iou, f, b_f, out, tanh_c, rows, H, is_double, *(c, stride)): "
     "an N-ary Tree-LSTM cell's elementwise forward, on the addresses of tensors."},
    {"tree_lstm_backward", fast(tree_lstm_backward), METH_FASTCALL,
     "tree_lstm_backward(iou, f, tanh_c, grad, d_iou, d_f, db_iou, db_f, rows, H, is_double, "
     "*(c, stride, dc, stride)): an N-ary Tree-LSTM cell's elementwise backward."},
    {"tree_lstm_child_sum_forward", fast(tree_lstm_child_sum_forward), METH_FASTCALL,
     "tree_lstm_child_sum_forward(iou, b_iou, f, fx, out, tanh_c, c, c_stride, offsets, rows, "
     "H, is_double): a child-sum Tree-LSTM cell's elementwise forward."},
    {"tree_lstm_child_sum_backward", fast(tree_lstm_child_sum_backward), METH_FASTCALL,
     "tree_lstm_child_sum_backward(iou, f, tanh_c, grad, d_iou, d_f, d_fx, db_iou, db_f, c, "
     "c_stride, dc, dc_stride, offsets, rows, H, is_double): its elementwise backward."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_tree_lstm(PyObject* module) {
  return PyModule_AddFunctions(module, kTreeLstmMethods) == 0;
}

}  // namespace flybatch
