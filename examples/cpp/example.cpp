// example.cpp — fusedce from C++: a status turned into an exception, options built fluently,
// the workspace owned by a RAII buffer. Built by `make` as build/examples/cpp_example;
// run: build/examples/cpp_example [--cpu]
#include <fusedce.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(FCE_EXAMPLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace fce {

struct Error : std::runtime_error {
  fce_status status;
  Error(fce_status s, const std::string& what) : std::runtime_error(what), status(s) {}
};

inline void check(fce_status s) {
  if (s != FCE_SUCCESS) throw Error(s, std::string(fce_status_string(s)) + ": " + fce_last_error());
}

// Host or device memory, freed on scope exit.
class Buffer {
 public:
  Buffer(size_t bytes, bool device) : device_(device), bytes_(bytes) {
    if (bytes == 0) return;
#if defined(FCE_EXAMPLE_CUDA)
    if (device_) {
      if (cudaMalloc(&ptr_, bytes) != cudaSuccess) throw std::bad_alloc();
      return;
    }
#endif
    ptr_ = ::operator new(bytes);
  }
  ~Buffer() {
    if (!ptr_) return;
#if defined(FCE_EXAMPLE_CUDA)
    if (device_) { cudaFree(ptr_); return; }
#endif
    ::operator delete(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return ptr_; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }
  void upload(const void* src, size_t n) { copy(ptr_, src, n, true); }
  void download(void* dst, size_t n) const { copy(dst, ptr_, n, false); }

 private:
  void copy(void* dst, const void* src, size_t n, bool to_buffer) const {
#if defined(FCE_EXAMPLE_CUDA)
    if (device_) {
      cudaMemcpy(dst, src, n, to_buffer ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
      return;
    }
#endif
    (void)to_buffer;
    std::memcpy(dst, src, n);
  }
  bool device_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

class Options {
 public:
  Options() {
    o_.struct_size = sizeof o_;  // fce_options_default writes no more than struct_size bytes
    fce_options_default(&o_);
  }
  Options& backend(fce_backend b) { o_.backend = b; return *this; }
  Options& dtype(fce_dtype d) { o_.dtype = d; return *this; }
  Options& targets(fce_dtype d) { o_.target_dtype = d; return *this; }
  Options& reduction(fce_reduction r) { o_.reduction = r; return *this; }
  Options& label_smoothing(float e) { o_.label_smoothing = e; return *this; }
  Options& z_loss(float l) { o_.z_loss_scale = l; return *this; }
  Options& softcap(float c) { o_.softcap = c; return *this; }
  const fce_options* get() const { return &o_; }

 private:
  fce_options o_;
};

}  // namespace fce

int main(int argc, char** argv) {
  const bool cpu = argc > 1 && !std::strcmp(argv[1], "--cpu");
  const bool gpu = !cpu && fce_cuda_available();
  const int64_t N = 128, V = 5000;
  try {
    auto opt = fce::Options()
                   .backend(gpu ? FCE_BACKEND_CUDA : FCE_BACKEND_CPU)
                   .dtype(FCE_FLOAT32)
                   .targets(FCE_INT32)
                   .label_smoothing(0.1f)
                   .z_loss(1e-4f);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> z(N * V);
    std::vector<int32_t> y(N);
    for (auto& v : z) v = normal(rng);
    for (int64_t i = 0; i < N; ++i) y[i] = static_cast<int32_t>(rng() % V);

    fce::Buffer logits(z.size() * 4, gpu), targets(y.size() * 4, gpu), loss(4, gpu),
        lse(N * 4, gpu), grad(z.size() * 4, gpu);
    logits.upload(z.data(), z.size() * 4);
    targets.upload(y.data(), y.size() * 4);
    size_t ws_bytes = 0;
    fce::check(fce_forward_workspace_size(opt.get(), N, V, &ws_bytes));
    fce::Buffer ws(ws_bytes, gpu);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.as<float>();
    out.lse = lse.as<float>();
    fce_gradients grads = FCE_GRADIENTS_INIT;
    grads.grad_logits = grad.get();
    fce::check(fce_forward(opt.get(), N, V, logits.get(), targets.get(), &out, &grads, ws.get(),
                           ws_bytes, nullptr));
    float l = 0;
    loss.download(&l, 4);
    std::vector<float> g(z.size());
    grad.download(g.data(), g.size() * 4);
    double row0 = 0;  // each row of the mean-reduced gradient sums to ~0
    for (int64_t j = 0; j < V; ++j) row0 += g[j];
    std::printf("backend %s: loss %.5f, sum of row 0 of the gradient %.2e\n", gpu ? "CUDA" : "CPU",
                l, row0);

    // Bad input becomes an exception that names the argument.
    try {
      fce::check(fce_forward(opt.get(), N, -1, logits.get(), targets.get(), &out, nullptr,
                             ws.get(), ws_bytes, nullptr));
      std::printf("error: a negative vocab was accepted\n");
      return 1;
    } catch (const fce::Error& e) {
      std::printf("bad input reported: %s\n", e.what());
    }
    return std::isfinite(l) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
