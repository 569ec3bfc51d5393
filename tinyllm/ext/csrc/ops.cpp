/* Step 13 - the C kernels of csrc/'s .c files as PyTorch operators, in the build's namespace
   (TINYLLM_NS: tinyllm for library()), loaded by tinyllm/ext/cpu_kernels.py: it compiles this
   file against torch's headers and links it with their objects. Each operator checks what it
   is given (a wrong dtype, shape or layout is an error, not a crash), makes its output and
   runs the C loop on torch's thread count. A call costs a few microseconds from Python, as
   any operator of torch's own does. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cmath>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <vector>

extern "C" {
void float_gemv(int64_t, int64_t, const int64_t *, int64_t, const float *, const float **,
                float *, int);
void int8_gemv(int64_t, int64_t, const int64_t *, int64_t, const float *, const int8_t **,
               const uint16_t **, float *, int);
void int4_gemv(int64_t, int64_t, const int64_t *, int64_t, int64_t, const float *,
               const uint8_t **, const uint16_t **, const uint16_t **, float *, int);
void int8g_gemv(int64_t, int64_t, const int64_t *, int64_t, int64_t, const float *,
                const int8_t **, const uint16_t **, float *, int);
int decode_attention_f32(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float *, const float *, const float *, float *, float *,
                         const int64_t *, const int64_t *, const float *, double, float *, int);
int decode_attention_f64(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const double *, const double *, const double *, double *, double *,
                         const int64_t *, const int64_t *, const double *, double, double *, int);
int decode_layer_f32(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float *, const float *,
                     const float *, const float **, const float *, const float *, int64_t,
                     float *, float *, int64_t, int64_t, const int64_t *, const int64_t *,
                     const float *, int64_t, double, int);
int decode_layer_f64(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double *,
                     const double *, const double *, const double **, const double *,
                     const double *, int64_t, double *, double *, int64_t, int64_t,
                     const int64_t *, const int64_t *, const double *, int64_t, double, int);
typedef struct {
    const void *q;
    const uint16_t *scale, *zero;
    int64_t group;
} QWeight;
int decode_layer_q(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float *, const float *,
                   const float *, const QWeight *, const float *, const float *, int64_t,
                   float *, float *, int64_t, int64_t, const int64_t *, const int64_t *,
                   const float *, int64_t, double, int);
}

/* x (M, K) float32 on the CPU, contiguous (a copy where it is not) */
static at::Tensor input(const at::Tensor &x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "x must be (M, K) float32 on the CPU, got ", x.scalar_type(), " ", x.sizes());
    return x.contiguous();
}

/* the data of each weight ws[i]: a contiguous CPU tensor of dtype, Ns[i] rows of per_row */
template <typename T>
static std::vector<const T *> rows(at::TensorList ws, const std::vector<int64_t> &Ns,
                                   int64_t per_row, at::ScalarType dtype, const char *what) {
    TORCH_CHECK(ws.size() == Ns.size(), what, ": ", Ns.size(), " tensors expected, got ",
                ws.size());
    std::vector<const T *> data;
    for (size_t i = 0; i < ws.size(); i++) {
        const at::Tensor &w = ws[i];
        TORCH_CHECK(w.scalar_type() == dtype, what, "[", i, "] must be ", dtype, ", got ",
                    w.scalar_type());
        TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), what, "[", i,
                    "] must be a contiguous CPU tensor");
        TORCH_CHECK(w.dim() >= 1 && w.size(0) == Ns[i] && w.numel() == Ns[i] * per_row, what,
                    "[", i, "] must hold ", Ns[i], " rows of ", per_row, " values, got ",
                    w.sizes());
        data.push_back(static_cast<const T *>(w.data_ptr()));
    }
    return data;
}

/* each weight's rows (N_i), and the output (M, N_1 + N_2 + ...) */
static std::vector<int64_t> counts(at::TensorList ws) {
    TORCH_CHECK(!ws.empty(), "the list of weights is empty");
    std::vector<int64_t> Ns;
    for (const at::Tensor &w : ws) Ns.push_back(w.dim() ? w.size(0) : 0);
    return Ns;
}
static at::Tensor output(const at::Tensor &x, const std::vector<int64_t> &Ns) {
    int64_t N = 0;
    for (int64_t n : Ns) N += n;
    return at::empty({x.size(0), N}, x.options());
}

static at::Tensor float_gemv_op(const at::Tensor &x_, at::TensorList w) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(w);
    std::vector<const float *> wd = rows<float>(w, Ns, x.size(1), at::kFloat, "w");
    at::Tensor y = output(x, Ns);
    float_gemv(x.size(0), Ns.size(), Ns.data(), x.size(1), x.data_ptr<float>(), wd.data(),
               y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int8_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    std::vector<const int8_t *> qd = rows<int8_t>(q, Ns, x.size(1), at::kChar, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, 1, at::kHalf, "scale");
    at::Tensor y = output(x, Ns);
    int8_gemv(x.size(0), Ns.size(), Ns.data(), x.size(1), x.data_ptr<float>(), qd.data(),
              sd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int4_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale,
                               at::TensorList zero) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    TORCH_CHECK(q[0].dim() == 3, "q must be (N, G, h) bytes, got ", q[0].sizes());
    int64_t G = q[0].size(1), h = q[0].size(2);
    TORCH_CHECK(2 * h * G == x.size(1), "x's ", x.size(1), " columns are not the weights' ",
                2 * h * G);
    std::vector<const uint8_t *> qd = rows<uint8_t>(q, Ns, G * h, at::kByte, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, G, at::kHalf, "scale");
    std::vector<const uint16_t *> zd = rows<uint16_t>(zero, Ns, G, at::kHalf, "zero");
    at::Tensor y = output(x, Ns);
    int4_gemv(x.size(0), Ns.size(), Ns.data(), G, h, x.data_ptr<float>(), qd.data(), sd.data(),
              zd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int8g_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    int64_t K = x.size(1), G = scale.empty() || scale[0].dim() < 2 ? 0 : scale[0].size(1);
    TORCH_CHECK(G > 0 && K % G == 0, "scale must be (N, G) with G dividing x's ", K,
                " columns");
    std::vector<const int8_t *> qd = rows<int8_t>(q, Ns, K, at::kChar, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, G, at::kHalf, "scale");
    at::Tensor y = output(x, Ns);
    int8g_gemv(x.size(0), Ns.size(), Ns.data(), G, K / G, x.data_ptr<float>(), qd.data(),
               sd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

/* The cache's arguments of a decode step of B rows, n_kv KV heads of hd values each, as
   decode_attention and decode_layer take them (their dtype checked by each op) */
static void check_cache(const at::Tensor &keys, const at::Tensor &values, const at::Tensor &write,
                        const at::Tensor &read, const at::Tensor &mask, int64_t B, int64_t n_kv,
                        int64_t hd) {
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && hd > 0 &&
                keys.numel() == values.numel() && keys.numel() % hd == 0,
                "keys and values must be contiguous rows of ", hd, " values");
    TORCH_CHECK(write.scalar_type() == at::kLong && write.numel() == B * n_kv,
                "write must be (B, n_kv) int64");
    TORCH_CHECK(read.scalar_type() == at::kLong && read.dim() == 2 && read.size(0) == B &&
                mask.sizes() == read.sizes(), "read and mask must be (B, W), read int64");
}

static at::Tensor decode_attention_op(const at::Tensor &q_, const at::Tensor &k_,
                                      const at::Tensor &v_, at::Tensor &keys, at::Tensor &values,
                                      const at::Tensor &write_, const at::Tensor &read_,
                                      int64_t head_stride, const at::Tensor &mask_) {
    at::ScalarType dtype = keys.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
                "decode_attention runs in float32 or float64, not ", dtype);
    TORCH_CHECK(q_.dim() == 4, "q must be (B, n_kv, g, hd), got ", q_.sizes());
    int64_t B = q_.size(0), n_kv = q_.size(1), g = q_.size(2), hd = q_.size(3);
    for (const at::Tensor *t : std::initializer_list<const at::Tensor *>{&q_, &k_, &v_, &keys,
                                                                       &values, &mask_})
        TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                    "q, k, v, the cache and the mask must be CPU tensors of one dtype");
    check_cache(keys, values, write_, read_, mask_, B, n_kv, hd);
    TORCH_CHECK(k_.numel() == B * n_kv * hd && v_.numel() == B * n_kv * hd,
                "k and v must be (B, n_kv, 1, hd) = (", B, ", ", n_kv, ", 1, ", hd, ")");
    at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    at::Tensor write = write_.contiguous(), read = read_.contiguous(), mask = mask_.contiguous();
    at::Tensor y = at::empty(q.sizes(), q.options());
    int64_t W = read.size(1), cached = keys.numel() / hd, threads = at::get_num_threads();
    double scale = std::pow((double)hd, -0.5);
    int outside = dtype == at::kFloat
        ? decode_attention_f32(B, n_kv, g, hd, W, cached, head_stride, q.data_ptr<float>(),
                               k.data_ptr<float>(), v.data_ptr<float>(), keys.data_ptr<float>(),
                               values.data_ptr<float>(), write.data_ptr<int64_t>(),
                               read.data_ptr<int64_t>(), mask.data_ptr<float>(), scale,
                               y.data_ptr<float>(), threads)
        : decode_attention_f64(B, n_kv, g, hd, W, cached, head_stride, q.data_ptr<double>(),
                               k.data_ptr<double>(), v.data_ptr<double>(),
                               keys.data_ptr<double>(), values.data_ptr<double>(),
                               write.data_ptr<int64_t>(), read.data_ptr<int64_t>(),
                               mask.data_ptr<double>(), scale, y.data_ptr<double>(), threads);
    TORCH_CHECK_INDEX(!outside, "decode_attention: a row to write or read lies outside the "
                      "cache's ", cached, " rows");
    return y;
}

/* what a layer's step reads beside its weights, checked: x (M, d) cloned (the op's output),
   cos and sin (rope_rows, hd), the cache's rows and the step's mask */
struct LayerStep {
    at::Tensor x, cos, sin, write, read, mask;
    int64_t M, d, hd, rope_rows, W, cached;
};

static LayerStep layer_step(const at::Tensor &x_, const at::Tensor &cos_, const at::Tensor &sin_,
                            const at::Tensor &keys, const at::Tensor &values,
                            const at::Tensor &write_, const at::Tensor &read_,
                            const at::Tensor &mask_, int64_t n_kv) {
    at::ScalarType dtype = x_.scalar_type();
    TORCH_CHECK(x_.dim() == 2 && x_.device().is_cpu(), "x must be (M, d) on the CPU, got ",
                x_.sizes());
    for (const at::Tensor *t : std::initializer_list<const at::Tensor *>{&cos_, &sin_, &keys,
                                                                       &values, &mask_})
        TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                    "cos, sin, the cache and the mask must be CPU tensors of x's dtype");
    LayerStep s;
    s.M = x_.size(0), s.d = x_.size(1), s.hd = cos_.size(-1);
    s.cos = cos_.contiguous(), s.sin = sin_.contiguous();
    s.rope_rows = s.cos.numel() / s.hd;
    TORCH_CHECK(s.sin.sizes() == s.cos.sizes() && (s.rope_rows == 1 || s.rope_rows == s.M),
                "cos and sin must hold one row of head_dim for every row of x, or one for all");
    check_cache(keys, values, write_, read_, mask_, s.M, n_kv, s.hd);
    s.x = x_.contiguous().clone(), s.read = read_.contiguous(), s.mask = mask_.contiguous();
    s.write = write_.contiguous();
    s.W = s.read.size(1), s.cached = keys.numel() / s.hd;
    return s;
}

/* the layer's heads (H, n_kv) from n_heads and the rows of Wk, checked */
static int64_t kv_heads(int64_t H, int64_t k_rows, int64_t hd) {
    int64_t n_kv = hd > 0 ? k_rows / hd : 0;
    TORCH_CHECK(H > 0 && n_kv > 0 && H % n_kv == 0 && hd > 0 && hd % 2 == 0,
                "n_heads must be a multiple of n_kv and head_dim even");
    return n_kv;
}

/* the shapes (N, K) of a layer's seven products: q, k, v, o, gate, up, down */
static std::vector<std::vector<int64_t>> product_shapes(int64_t d, int64_t H, int64_t n_kv,
                                                        int64_t hd, int64_t ff) {
    return {{H * hd, d}, {n_kv * hd, d}, {n_kv * hd, d}, {d, H * hd}, {ff, d}, {ff, d}, {d, ff}};
}

static at::Tensor layer_result(const LayerStep &s, int outside) {
    TORCH_CHECK(outside != 2, "decode_layer: no memory for the step's ", s.M, " rows");
    TORCH_CHECK_INDEX(!outside, "decode_layer: a row to write or read lies outside the cache's ",
                      s.cached, " rows");
    return s.x;
}

/* product i's weight (N, K) as QWeight: scale (N, G) float16 (group K / G); zero as scale, or
   empty; q int8 (N, K) without zero, else (N, G, group / 2) bytes of two 4-bit values */
static QWeight quant_weight(size_t i, const at::Tensor &q, const at::Tensor &scale,
                            const at::Tensor &zero, int64_t N, int64_t K) {
    for (const at::Tensor *t : {&q, &scale, &zero})
        TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "q[", i, "], scale[", i,
                    "] and zero[", i, "] must be contiguous CPU tensors");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N &&
                scale.size(1) > 0 && K % scale.size(1) == 0,
                "scale[", i, "] must be float16 (", N, ", G) with G dividing ", K, ", got ",
                scale.scalar_type(), " ", scale.sizes());
    int64_t G = scale.size(1), g = K / G;
    bool four = zero.numel() > 0;
    TORCH_CHECK(!four || (zero.scalar_type() == at::kHalf && zero.sizes() == scale.sizes()),
                "zero[", i, "] must be empty or float16 shaped as scale[", i, "]");
    std::vector<int64_t> shape = four ? std::vector<int64_t>{N, G, g / 2}
                                      : std::vector<int64_t>{N, K};
    TORCH_CHECK(q.scalar_type() == (four ? at::kByte : at::kChar) && q.sizes() ==
                at::IntArrayRef(shape) && (!four || g % 2 == 0),
                "q[", i, "] must be ", four ? "uint8 " : "int8 ", at::IntArrayRef(shape),
                ", got ", q.scalar_type(), " ", q.sizes());
    return {q.data_ptr(), (const uint16_t *)scale.data_ptr(),
            four ? (const uint16_t *)zero.data_ptr() : nullptr, g};
}

/* layer l's nine float weights w (ln1, q, k, v, o, ln2, gate, up, down), checked against the
   layer's shapes (d, H, n_kv, hd, ff): the two norms into norms, the seven products into fw */
static void float_layer(int64_t l, const at::Tensor *w, at::ScalarType dtype, int64_t d, int64_t H,
                        int64_t n_kv, int64_t hd, int64_t ff, std::vector<const void *> &norms,
                        std::vector<const void *> &fw) {
    std::vector<std::vector<int64_t>> shapes = product_shapes(d, H, n_kv, hd, ff);
    shapes.insert(shapes.begin() + 4, {d});
    shapes.insert(shapes.begin(), {d});
    for (size_t i = 0; i < 9; i++) {
        TORCH_CHECK(w[i].scalar_type() == dtype && w[i].device().is_cpu() &&
                    w[i].is_contiguous() && w[i].sizes() == at::IntArrayRef(shapes[i]),
                    "layer ", l, "'s w[", i, "] must be a contiguous CPU tensor of ", dtype,
                    ", shaped ", at::IntArrayRef(shapes[i]), ", got ", w[i].scalar_type(), " ",
                    w[i].sizes());
        (i == 0 || i == 5 ? norms : fw).push_back(w[i].data_ptr());
    }
}

/* layer l's quantized weights t: the two norms, then q, scale and zero of its seven products
   (q, k, v, o, gate, up, down), checked as QuantLinear keeps them, into norms and qw */
static void quant_layer(int64_t l, const at::Tensor *t, int64_t d, int64_t H, int64_t n_kv,
                        int64_t hd, int64_t ff, std::vector<const void *> &norms,
                        std::vector<QWeight> &qw) {
    std::vector<std::vector<int64_t>> shapes = product_shapes(d, H, n_kv, hd, ff);
    for (int i = 0; i < 2; i++) {
        TORCH_CHECK(t[i].scalar_type() == at::kFloat && t[i].is_contiguous() &&
                    t[i].device().is_cpu() && t[i].sizes() == at::IntArrayRef({d}),
                    "layer ", l, ": the norms must be contiguous float32 (", d, ") CPU tensors");
        norms.push_back(t[i].data_ptr());
    }
    size_t first = qw.size();
    for (size_t i = 0; i < 7; i++)
        qw.push_back(quant_weight(i, t[2 + i], t[9 + i], t[16 + i], shapes[i][0], shapes[i][1]));
    auto same = [&](size_t a, size_t b) {
        const QWeight &u = qw[first + a], &v = qw[first + b];
        TORCH_CHECK((u.zero == nullptr) == (v.zero == nullptr) && u.group == v.group, "layer ",
                    l, ": q[", a, "] and q[", b, "] read the same x and must be of one kind");
    };
    same(0, 1), same(0, 2), same(4, 5);
}

/* A model's decoder layers as decode_layers reads them, checked once when made, so that a
   step hands its weights to C as one object (each tensor handed to an operator costs about a
   microsecond and a half: a quantized layer has 23). tensors: each layer's nine float weights
   (decode_layer's order), or with quantized its two norms and its seven products' q, scale and
   zero (an empty tensor where it has none); it holds them while it lives. */
namespace TINYLLM_NS {              /* a type of its own in each build loaded, as torch asks */
struct Layers : torch::CustomClassHolder {
    std::vector<at::Tensor> held;
    bool quantized;
    at::ScalarType dtype;
    int64_t n, d, H, n_kv, hd, ff;
    double eps;
    std::vector<const void *> norms, fw;        /* 2 a layer; float: 7 products a layer */
    std::vector<QWeight> qw;                    /* quantized: 7 products a layer */

    Layers(std::vector<at::Tensor> tensors, bool quantized_, int64_t n_heads, int64_t head_dim,
           double eps_)
        : held(std::move(tensors)), quantized(quantized_), H(n_heads), hd(head_dim), eps(eps_) {
        size_t per = quantized ? 23 : 9;
        TORCH_CHECK(!held.empty() && held.size() % per == 0, "layers takes ", per,
                    " tensors a layer, got ", held.size());
        n = held.size() / per;
        const at::Tensor &k = held[quantized ? 3 : 2], &gate = held[6];
        d = held[0].dim() == 1 ? held[0].size(0) : 0;
        dtype = quantized ? at::kFloat : held[0].scalar_type();
        TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
                    "the layers run in float32 or float64, not ", dtype);
        n_kv = kv_heads(H, k.dim() >= 1 ? k.size(0) : 0, hd);
        ff = gate.dim() >= 1 ? gate.size(0) : 0;
        for (int64_t l = 0; l < n; l++) {
            const at::Tensor *t = held.data() + l * per;
            if (quantized) quant_layer(l, t, d, H, n_kv, hd, ff, norms, qw);
            else float_layer(l, t, dtype, d, H, n_kv, hd, ff, norms, fw);
        }
    }
};
}  // namespace TINYLLM_NS
using TINYLLM_NS::Layers;

/* layer l of float layers L on the step s, in T: decode_layer_f32's or _f64's call */
template <typename T, typename LayerFn>
static int float_layer_step(LayerFn layer, Layers &L, int64_t l, LayerStep &s,
                            at::TensorList keys, at::TensorList values, int64_t head_stride,
                            int threads) {
    return layer(s.M, L.d, L.H, L.n_kv, L.hd, L.ff, s.x.data_ptr<T>(), (const T *)L.norms[2 * l],
                 (const T *)L.norms[2 * l + 1], (const T **)(L.fw.data() + 7 * l),
                 s.cos.data_ptr<T>(), s.sin.data_ptr<T>(), s.rope_rows, keys[l].data_ptr<T>(),
                 values[l].data_ptr<T>(), s.cached, head_stride, s.write.data_ptr<int64_t>(),
                 s.read.data_ptr<int64_t>(), s.mask.data_ptr<T>(), s.W, L.eps, threads);
}

/* x (M, d) through every layer of `layers`, layer l on the cache's keys[l] and values[l]: the
   decode steps of decode_layer_f32 / _f64 / _q in turn, in C. The layers' caches have one
   shape, so a row outside them is found at the first layer, before anything is written. */
static at::Tensor decode_layers_op(const at::Tensor &x_, const c10::intrusive_ptr<Layers> &L,
                                   const at::Tensor &cos_, const at::Tensor &sin_,
                                   at::TensorList keys, at::TensorList values,
                                   const at::Tensor &write_, const at::Tensor &read_,
                                   int64_t head_stride, const at::Tensor &mask_) {
    TORCH_CHECK(x_.scalar_type() == L->dtype, "x must be ", L->dtype, " as the layers are, not ",
                x_.scalar_type());
    TORCH_CHECK(x_.dim() == 2 && x_.size(1) == L->d, "x must be (M, ", L->d, "), got ",
                x_.sizes());
    TORCH_CHECK(cos_.size(-1) == L->hd, "cos and sin must have head_dim ", L->hd, " values");
    TORCH_CHECK((int64_t)keys.size() == L->n && (int64_t)values.size() == L->n,
                "keys and values must hold a cache for each of the ", L->n, " layers");
    for (int64_t l = 1; l < L->n; l++)
        TORCH_CHECK(keys[l].sizes() == keys[0].sizes() && values[l].sizes() == keys[0].sizes() &&
                    keys[l].scalar_type() == L->dtype && values[l].scalar_type() == L->dtype &&
                    keys[l].device().is_cpu() && values[l].device().is_cpu() &&
                    keys[l].is_contiguous() && values[l].is_contiguous(),
                    "every layer's keys and values must be contiguous CPU tensors shaped as "
                    "layer 0's keys");
    LayerStep s = layer_step(x_, cos_, sin_, keys[0], values[0], write_, read_, mask_, L->n_kv);
    int threads = at::get_num_threads(), outside = 0;
    for (int64_t l = 0; l < L->n && !outside; l++) {
        if (L->quantized)
            outside = decode_layer_q(s.M, L->d, L->H, L->n_kv, L->hd, L->ff, s.x.data_ptr<float>(),
                                     (const float *)L->norms[2 * l],
                                     (const float *)L->norms[2 * l + 1], &L->qw[7 * l],
                                     s.cos.data_ptr<float>(), s.sin.data_ptr<float>(),
                                     s.rope_rows, keys[l].data_ptr<float>(),
                                     values[l].data_ptr<float>(), s.cached, head_stride,
                                     s.write.data_ptr<int64_t>(), s.read.data_ptr<int64_t>(),
                                     s.mask.data_ptr<float>(), s.W, L->eps, threads);
        else if (L->dtype == at::kFloat)
            outside = float_layer_step<float>(decode_layer_f32, *L, l, s, keys, values,
                                              head_stride, threads);
        else
            outside = float_layer_step<double>(decode_layer_f64, *L, l, s, keys, values,
                                               head_stride, threads);
    }
    return layer_result(s, outside);
}

#define NAME(ns) #ns
#define CLASS(ns) "__torch__.torch.classes." NAME(ns) ".Layers"
#define DEFINE(ns) TORCH_LIBRARY(ns, m)      /* TINYLLM_NS expanded first */
#define IMPLEMENT(ns) TORCH_LIBRARY_IMPL(ns, CPU, m)
DEFINE(TINYLLM_NS) {
    m.def("float_gemv(Tensor x, Tensor[] w) -> Tensor");
    m.def("int8_gemv(Tensor x, Tensor[] q, Tensor[] scale) -> Tensor");
    m.def("int4_gemv(Tensor x, Tensor[] q, Tensor[] scale, Tensor[] zero) -> Tensor");
    m.def("int8g_gemv(Tensor x, Tensor[] q, Tensor[] scale) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, "
          "Tensor write, Tensor read, int head_stride, Tensor mask) -> Tensor");
    m.class_<Layers>("Layers").def(
        torch::init<std::vector<at::Tensor>, bool, int64_t, int64_t, double>());
    m.def("decode_layers(Tensor x, " CLASS(TINYLLM_NS) " layers, Tensor cos, Tensor sin, "
          "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor write, Tensor read, int head_stride, "
          "Tensor mask) -> Tensor");
}
IMPLEMENT(TINYLLM_NS) {
    m.impl("float_gemv", float_gemv_op);
    m.impl("int8_gemv", int8_gemv_op);
    m.impl("int4_gemv", int4_gemv_op);
    m.impl("int8g_gemv", int8g_gemv_op);
    m.impl("decode_attention", decode_attention_op);
    m.impl("decode_layers", decode_layers_op);
}
