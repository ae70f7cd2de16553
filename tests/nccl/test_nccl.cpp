// test_nccl.cpp — libfusedce_nccl (include/fusedce_nccl.h) on the CUDA backend.
//
//   Single GPU: a one-rank communicator (ncclCommInitAll over device 0), so vocab_start = 0 and
//   vocab_local = vocab_total: fce_nccl_cross_entropy against the unsharded fce_forward and
//   fce_nccl_linear_ce against the unsharded fce_linear_ce, float32 and bfloat16, several
//   options (label smoothing + z-loss + ignored rows, reduction none with a per-row upstream,
//   sum with class weights, softcap and int32 targets, in place, loss only, accumulate,
//   grad_weight_fp32, the minimum workspace), loss / lse / z_loss / argmax / accuracy and every
//   gradient; the entropy with grad_lse / grad_entropy (options->vp_entropy); a CUDA graph
//   capturing both calls replays them bit for bit. fce_nccl_distill against the unsharded
//   fce_distill: forward KL, reverse KL and the JSD (beta = 0.5, two rounds; beta = 0) with
//   temperatures other than 1, float32 and bfloat16, each reduction, ignored rows, in place, the
//   loss only, a graph replay, and a shard that does not tile the vocabulary
//   (FCE_FLAG_SHARDS_INCONSISTENT).
//   Two or more GPUs: the vocabulary sharded unevenly over up to 4 of them, the shards in the
//   reverse of the rank order, one host thread per rank: every rank's loss is the same bits,
//   and loss, gradients and the all-reduced grad_hidden match the unsharded calls; each rank's
//   two calls, captured in CUDA graphs (collectives included), replay them bit for bit; the
//   distillation over the same uneven shards, against fce_distill, the same bits on every rank.
//   Everywhere: bad arguments (NULL comm, the CPU backend, NULL options, ...) give a status and
//   a message naming the function and the argument, and write nothing.
//
// Without a CUDA device the GPU cases print "SKIPPED: ..." and are skipped (the binary exits 0).//
// The cases and their machinery are nccl_cases.h.
#include "nccl_cases.h"

// ------------------------------------------------------------------ tests -------------------
TEST(Nccl, VersionAndBuildInfo) {
  EXPECT_EQ(fce_nccl_version(), fce_version());
  EXPECT_EQ(fce_nccl_version(), static_cast<unsigned>(FCE_VERSION_NUMBER));
  const std::string info = fce_nccl_build_info();
  std::printf("%s\n", info.c_str());
  EXPECT_NE(info.find("fusedce_nccl"), std::string::npos) << info;
  EXPECT_NE(info.find("NCCL"), std::string::npos) << info;
}

// The checks that need no device: run everywhere.
TEST(Nccl, BadArgumentsWithoutDevice) {
  TestOptions o = FCE_OPTIONS_INIT;
  size_t ws = 12345, mn = 12345;
  float loss = -1.0f;
  const ncclComm_t no_comm = nullptr;
  // NULL communicator
  EXPECT_EQ(flat::nccl_ce_ws(&o, no_comm, 4, 8, 8, 1, &ws),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_cross_entropy_workspace_size: shard is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(ws, 12345u);
  EXPECT_EQ(flat::nccl_cross_entropy(&o, no_comm, 4, 8, 0, 8, &loss, &loss, &loss, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, 0, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_cross_entropy: shard is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_linear_ce(&o, no_comm, 4, 8, 16, 0, 16, &loss, &loss, nullptr, &loss, &loss,
                               nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                               nullptr, 0, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_linear_ce: shard is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  // the distillation: its status and a message that says `text`
  fce_teacher te = FCE_TEACHER_INIT;
  auto distill = [&](const TestOptions* op) {
    return flat::nccl_distill(op, &te, no_comm, 4, 8, 0, 8, &loss, nullptr, &loss, nullptr, nullptr,
                              nullptr, nullptr, nullptr, 0, nullptr);
  };
  auto refused = [](fce_status got, fce_status want, const char* text) {
    EXPECT_EQ(got, want) << text;
    EXPECT_NE(std::string(fce_nccl_last_error()).find(text), std::string::npos)
        << fce_nccl_last_error();
  };
  refused(distill(&o), FCE_ERROR_NULL_POINTER, "fce_nccl_distill: shard is NULL");
  refused(flat::nccl_distill_ws(&o, &te, no_comm, 4, 8, 8, 1, &ws), FCE_ERROR_NULL_POINTER,
          "fce_nccl_distill_workspace_size: shard is NULL");
  refused(flat::nccl_distill_ws(&o, &te, no_comm, 4, 8, 8, 1, nullptr), FCE_ERROR_NULL_POINTER,
          "fce_nccl_distill_workspace_size: workspace_bytes is NULL");
  refused(distill(nullptr), FCE_ERROR_NULL_POINTER, "fce_nccl_distill: options is NULL");
  EXPECT_EQ(loss, -1.0f);
  // the CPU backend: refused before the communicator is looked at
  o.backend = FCE_BACKEND_CPU;
  refused(distill(&o), FCE_ERROR_UNSUPPORTED, "fce_nccl_distill: options->backend");
  EXPECT_EQ(flat::nccl_linear_ws(&o, no_comm, 4, 8, 16, 16, 1, &mn, nullptr),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_linear_ce_workspace_size: "
                                                    "options->backend"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_linear_ce(&o, no_comm, 4, 8, 16, 0, 16, &loss, &loss, nullptr, &loss, &loss,
                               nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                               nullptr, 0, nullptr),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_linear_ce: options->backend"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_cross_entropy(&o, no_comm, 4, 8, 0, 8, &loss, &loss, &loss, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_cross_entropy: options->backend"),
            std::string::npos)
      << fce_nccl_last_error();
  // a backend that does not exist
  o.backend = 7;
  EXPECT_EQ(flat::nccl_ce_ws(&o, no_comm, 4, 8, 8, 1, &ws),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("options->backend (7)"), std::string::npos)
      << fce_nccl_last_error();
  // NULL options, NULL outputs of the queries, a bad struct_size
  EXPECT_EQ(flat::nccl_ce_ws(nullptr, no_comm, 4, 8, 8, 1, &ws),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("options is NULL"), std::string::npos)
      << fce_nccl_last_error();
  o = FCE_OPTIONS_INIT;
  EXPECT_EQ(flat::nccl_ce_ws(&o, no_comm, 4, 8, 8, 1, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("workspace_bytes is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_linear_ws(&o, no_comm, 4, 8, 16, 16, 1, nullptr, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("min_bytes is NULL"), std::string::npos)
      << fce_nccl_last_error();
  o.struct_size = 3;
  EXPECT_EQ(flat::nccl_ce_ws(&o, no_comm, 4, 8, 8, 1, &ws),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("options->struct_size"), std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(ws, 12345u);
  EXPECT_EQ(mn, 12345u);
  // the shard: made by fce_nccl_shard from a communicator, refused otherwise
  o = FCE_OPTIONS_INIT;
  fce_vp_shard sh{};
  EXPECT_EQ(fce_nccl_shard(no_comm, 8, 0, 8, &sh), FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_shard: comm is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(fce_nccl_shard(no_comm, 8, 0, 8, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_shard: shard is NULL"),
            std::string::npos)
      << fce_nccl_last_error();
  const fce_vp_shard other = {1, 8, 0, 8, nullptr, nullptr};  // not fce_nccl_shard's
  EXPECT_EQ(fce_nccl_cross_entropy_workspace_size(&o, &other, 4, 1, &ws),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error())
                .find("fce_nccl_cross_entropy_workspace_size: shard->all_gather is not "
                      "fusedce_nccl's"),
            std::string::npos)
      << fce_nccl_last_error();
  refused(
      fce_nccl_distill(&o, &te, &other, 4, &loss, nullptr, nullptr, nullptr, nullptr, 0, nullptr),
      FCE_ERROR_INVALID_ARGUMENT, "fce_nccl_distill: shard->all_gather is not fusedce_nccl's");
  EXPECT_EQ(ws, 12345u);
  EXPECT_EQ(loss, -1.0f);
}

// The checks on a real communicator: sizes, pointers, workspace, the core's own checks (the
// message prefixed), and nothing written by a failing call.
TEST(Nccl, BadArgumentsOnDevice) {
  REQUIRE_GPU();
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  const int64_t N = 8, V = 40, D = 16;
  TestOptions o = FCE_OPTIONS_INIT;
  std::mt19937_64 rng(5);
  Dev z(encode(FCE_FLOAT32, random_logits(rng, FCE_FLOAT32, N, V)), s);
  Dev y(encode_targets(FCE_INT64, random_targets(rng, N, V)), s);
  Dev h(encode(FCE_FLOAT32, random_normal(rng, FCE_FLOAT32, N * D, 1.0)), s);
  Dev W(encode(FCE_FLOAT32, random_normal(rng, FCE_FLOAT32, V * D, 0.3)), s);
  Dev loss(4 * N, s), grad(4 * N * V, s);
  size_t wsb = 0;
  ASSERT_TRUE(ok(flat::nccl_ce_ws(&o, comm, N, V, V, 1, &wsb), "query"));
  EXPECT_STREQ(fce_nccl_last_error(), "");
  Dev ws(wsb + 256, s);
  loss.fill(kPoisonByte);
  grad.fill(kPoisonByte);
  const std::vector<uint8_t> loss0 = loss.download(), grad0 = grad.download();
  auto ce = [&](float* l, void* g, void* w, size_t b, int64_t vs = 0, int64_t vl = 40) {
    return flat::nccl_cross_entropy(&o, comm, N, V, vs, vl, z.ptr(), y.ptr(), l, nullptr, nullptr,
                                  g, nullptr, nullptr, w, b, s);
  };
  auto mentions = [](const char* a, const char* b) {
    const std::string m = fce_nccl_last_error();
    return m.find(a) != std::string::npos && m.find(b) != std::string::npos;
  };
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), ws.ptr(), wsb - 1), FCE_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "workspace_bytes")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), nullptr, wsb), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "workspace is NULL")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), ws.p<char>() + 8, wsb), FCE_ERROR_MISALIGNED);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "workspace")) << fce_nccl_last_error();
  EXPECT_EQ(ce(nullptr, grad.ptr(), ws.ptr(), wsb), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "loss is NULL")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), ws.ptr(), wsb, 1, V), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "vocab_start")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), ws.ptr(), wsb, 0, V + 1), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "vocab_local")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), ws.ptr(), ws.ptr(), wsb), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "overlaps")) << fce_nccl_last_error();
  EXPECT_EQ(ce(loss.p<float>(), grad.p<char>() + 2, ws.ptr(), wsb), FCE_ERROR_MISALIGNED);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: ", "grad_logits")) << fce_nccl_last_error();
  // an option only libfusedce checks (its workspace queries, run for the call): its message,
  // under the name of the call made, never the query's
  o.label_smoothing = 2.0f;
  EXPECT_EQ(ce(loss.p<float>(), grad.ptr(), ws.ptr(), wsb), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy: options->label_smoothing (2)", "[0, 1)"))
      << fce_nccl_last_error();
  EXPECT_FALSE(mentions("workspace_size", "")) << fce_nccl_last_error();
  size_t q = 0;
  EXPECT_EQ(flat::nccl_ce_ws(&o, comm, N, V, V, 1, &q),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_cross_entropy_workspace_size: options->label_smoothing", ""))
      << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_linear_ce(&o, comm, N, D, V, 0, V, h.ptr(), W.ptr(), nullptr, y.ptr(),
                               loss.p<float>(), nullptr, nullptr, nullptr, nullptr, nullptr,
                               nullptr, nullptr, ws.ptr(), wsb, s),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_linear_ce: options->label_smoothing (2)", "[0, 1)"))
      << fce_nccl_last_error();
  o.label_smoothing = 0.0f;
  ASSERT_TRUE(finish());
  EXPECT_EQ(loss.download(), loss0) << "a failing call wrote loss";
  EXPECT_EQ(grad.download(), grad0) << "a failing call wrote grad_logits";
  // linear
  size_t mn = 0;
  ASSERT_TRUE(ok(flat::nccl_linear_ws(&o, comm, N, D, V, V, 1, &mn, nullptr), "q"));
  Dev lws(mn, s), gh(4 * N * D, s);
  auto lin = [&](const void* bias, void* gb, void* w, size_t b) {
    return flat::nccl_linear_ce(&o, comm, N, D, V, 0, V, h.ptr(), W.ptr(), bias, y.ptr(),
                              loss.p<float>(), nullptr, nullptr, gh.ptr(), nullptr, gb, nullptr,
                              nullptr, w, b, s);
  };
  EXPECT_EQ(lin(nullptr, nullptr, lws.ptr(), mn - 1), FCE_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_TRUE(mentions("fce_nccl_linear_ce: ", "workspace_bytes")) << fce_nccl_last_error();
  EXPECT_EQ(lin(nullptr, grad.ptr(), lws.ptr(), mn), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(mentions("fce_nccl_linear_ce: ", "bias is NULL")) << fce_nccl_last_error();
  EXPECT_EQ(flat::nccl_linear_ce(&o, comm, N, D, V, 0, V, nullptr, W.ptr(), nullptr, y.ptr(),
                               loss.p<float>(), nullptr, nullptr, nullptr, nullptr, nullptr,
                               nullptr, nullptr, lws.ptr(), mn, s),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(mentions("fce_nccl_linear_ce: ", "hidden_states is NULL")) << fce_nccl_last_error();
  ASSERT_TRUE(finish());
  EXPECT_EQ(loss.download(), loss0) << "a failing call wrote loss";
  // and a good call clears the message
  ASSERT_TRUE(ok(lin(nullptr, nullptr, lws.ptr(), mn), "fce_nccl_linear_ce"));
  EXPECT_STREQ(fce_nccl_last_error(), "");
  ASSERT_TRUE(finish());
}

// Zero rows: the empty problem (fusedce.h), no collective: the queries return 0, per-row
// buffers may be NULL, the reduced loss is 0 and grad_weight is zeroed.
TEST(Nccl, EmptyBatch) {
  REQUIRE_GPU();
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  const int64_t V = 40, D = 16;
  TestOptions o = FCE_OPTIONS_INIT;
  size_t wsb = 1, mn = 1, op = 1;
  ASSERT_TRUE(ok(flat::nccl_ce_ws(&o, comm, 0, V, V, 1, &wsb), "query"));
  ASSERT_TRUE(ok(flat::nccl_linear_ws(&o, comm, 0, D, V, V, 1, &mn, &op), "query"));
  EXPECT_EQ(wsb, 0u);
  EXPECT_EQ(mn, 0u);
  EXPECT_EQ(op, 0u);
  Dev loss(4, s), W(4 * V * D, s), gw(4 * V * D, s);
  loss.fill(kPoisonByte);
  gw.fill(kPoisonByte);
  W.fill(0);
  ASSERT_TRUE(ok(flat::nccl_cross_entropy(&o, comm, 0, V, 0, V, nullptr, nullptr, loss.p<float>(),
                                        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                                        s),
                 "fce_nccl_cross_entropy"));
  std::vector<uint8_t> l = loss.download();
  EXPECT_EQ(l, std::vector<uint8_t>(4, 0)) << "loss of no row";
  loss.fill(kPoisonByte);
  ASSERT_TRUE(ok(flat::nccl_linear_ce(&o, comm, 0, D, V, 0, V, nullptr, W.ptr(), nullptr, nullptr,
                                    loss.p<float>(), nullptr, nullptr, nullptr, gw.ptr(),
                                    nullptr, nullptr, nullptr, nullptr, 0, s),
                 "fce_nccl_linear_ce"));
  l = loss.download();
  EXPECT_EQ(l, std::vector<uint8_t>(4, 0)) << "loss of no row (linear)";
  EXPECT_EQ(gw.download(), std::vector<uint8_t>(4 * V * D, 0)) << "grad_weight of no row";
  o.reduction = FCE_REDUCTION_NONE;
  EXPECT_TRUE(ok(flat::nccl_cross_entropy(&o, comm, 0, V, 0, V, nullptr, nullptr, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, nullptr, nullptr, 0, s),
                 "fce_nccl_cross_entropy (none)"));
  EXPECT_EQ(flat::nccl_cross_entropy(&o, comm, -1, V, 0, V, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, 0, s),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_cross_entropy: rows (-1)"),
            std::string::npos)
      << fce_nccl_last_error();
  // the distillation, two rounds (the JSD) and one: no row, no collective
  for (int div : {FCE_DIVERGENCE_JSD, FCE_DIVERGENCE_FORWARD_KL}) {
    fce_teacher te = FCE_TEACHER_INIT;
    te.divergence = div;
    o.reduction = FCE_REDUCTION_MEAN;
    ASSERT_TRUE(ok(flat::nccl_distill_ws(&o, &te, comm, 0, V, V, 1, &wsb), "distill query"));
    EXPECT_EQ(wsb, 0u);
    loss.fill(kPoisonByte);
    ASSERT_TRUE(ok(flat::nccl_distill(&o, &te, comm, 0, V, 0, V, nullptr, nullptr, loss.p<float>(),
                                      nullptr, nullptr, nullptr, nullptr, nullptr, 0, s),
                   "fce_nccl_distill"));
    EXPECT_EQ(loss.download(), std::vector<uint8_t>(4, 0)) << "distillation loss of no row";
    o.reduction = FCE_REDUCTION_NONE;
    EXPECT_TRUE(ok(flat::nccl_distill(&o, &te, comm, 0, V, 0, V, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, nullptr, nullptr, nullptr, 0, s),
                   "fce_nccl_distill (none)"));
    EXPECT_EQ(flat::nccl_distill(&o, &te, comm, -1, V, 0, V, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr, nullptr, nullptr, 0, s),
              FCE_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fce_nccl_last_error()).find("fce_nccl_distill: rows (-1)"),
              std::string::npos)
        << fce_nccl_last_error();
  }
  ASSERT_TRUE(finish());
}

TEST(Nccl, CrossEntropyMatchesUnsharded) {
  REQUIRE_GPU();
  for (const CeCase& c : ce_cases()) {
    SCOPED_TRACE(label(c));
    const CeData d = ce_data(c);
    CeOut ref, got;
    ASSERT_TRUE(ce_reference(c, d, &ref));
    ASSERT_TRUE(ce_nccl(c, d, &got, false));
    expect_ce_equal(c, got, ref);
  }
}

TEST(Nccl, LinearCeMatchesUnsharded) {
  REQUIRE_GPU();
  for (const LinCase& c : lin_cases()) {
    SCOPED_TRACE(label(c));
    const LinData d = lin_data(c);
    LinOut ref, got;
    ASSERT_TRUE(lin_reference(c, d, &ref));
    ASSERT_TRUE(lin_nccl(c, d, &got, false));
    expect_lin_equal(c, d, got, ref);
  }
}

TEST(Nccl, DistillMatchesUnsharded) {
  REQUIRE_GPU();
  for (const DistCase& c : dist_cases()) expect_dist_matches(c, false);
}

// The two rounds of the JSD and the one of the reverse KL captured in a CUDA graph after an
// eager call; two replays give the eager bits.
TEST(Nccl, DistillGraphCaptureReplays) {
  REQUIRE_GPU();
  for (int div : {FCE_DIVERGENCE_JSD, FCE_DIVERGENCE_REVERSE_KL}) {
    DistCase c = dist_case("graph", div, 2.0f, FCE_REDUCTION_MEAN, 0.1);
    c.dtype = FCE_BFLOAT16;
    c.seed = 601 + div;
    expect_dist_matches(c, true);
  }
}

// One rank whose shard is not the whole vocabulary: the gathered statistics do not tile it, so
// every counted row's loss and gradient are NaN, an ignored row keeps 0, and the error flag is
// set (fce_vp_distill_loss's, passed through).
TEST(Nccl, DistillShardsNotTiling) {
  REQUIRE_GPU();
  for (int div : {FCE_DIVERGENCE_JSD, FCE_DIVERGENCE_FORWARD_KL}) {
    DistCase c = dist_case("not tiling", div, 2.0f, FCE_REDUCTION_NONE);
    c.N = 6;
    c.V = 40;
    c.seed = 611 + div;
    SCOPED_TRACE(label(c));
    DistData d = dist_data(c);
    d.y[1] = -100;
    cudaStream_t s = stream0();
    DistDev b = dist_alloc(c, d, s);
    CeOut got;
    ASSERT_TRUE(dist_nccl_on(comm1(), s, c, b, c.V + 8, 0, &got, false));
    uint32_t flags = 0;
    std::memcpy(&flags, got.flags.data(), 4);
    EXPECT_EQ(flags, static_cast<uint32_t>(FCE_FLAG_SHARDS_INCONSISTENT));
    const std::vector<double> loss = decode(FCE_FLOAT32, got.loss);
    const std::vector<double> grad = decode(FCE_FLOAT32, got.grad);
    for (int64_t r = 0; r < c.N; ++r) {
      const bool counted = r != 1;
      EXPECT_EQ(std::isnan(loss[size_t(r)]), counted) << "row " << r << " loss " << loss[size_t(r)];
      if (!counted) {
        EXPECT_EQ(loss[size_t(r)], 0.0);
      }
      for (int64_t j = 0; j < c.V; ++j) {
        const double g = grad[size_t(r * c.V + j)];
        EXPECT_TRUE(counted ? std::isnan(g) : g == 0.0) << "row " << r << " column " << j;
      }
    }
  }
}

// fce_nccl_distill's own checks and those of the libfusedce calls it makes (under its name):
// a status and a message naming the function and the argument, and nothing written.
TEST(Nccl, DistillBadArgumentsOnDevice) {
  REQUIRE_GPU();
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  DistCase c;
  c.divergence = FCE_DIVERGENCE_JSD;
  c.N = 8;
  c.V = 40;
  const int64_t N = c.N, V = c.V;
  const DistData d = dist_data(c);
  DistDev b = dist_alloc(c, d, s);
  TestOptions o = ce_options(c);
  fce_teacher te = dist_teacher(c, b.t.ptr());
  size_t wsb = 0;
  ASSERT_TRUE(ok(flat::nccl_distill_ws(&o, &te, comm, N, V, V, 1, &wsb), "query"));
  EXPECT_STREQ(fce_nccl_last_error(), "");
  size_t wsb_loss = 0;
  ASSERT_TRUE(ok(flat::nccl_distill_ws(&o, &te, comm, N, V, V, 0, &wsb_loss), "query"));
  EXPECT_LE(wsb_loss, wsb);
  // the JSD gathers two rounds of [1, N, 8] float32: the last in front, round 1 in the scratch
  EXPECT_GE(wsb, size_t(N) * FCE_VP_DISTILL_STATS * 4 * 2);
  b.ws = Dev(wsb + 256, s);
  b.loss.fill(kPoisonByte);
  b.grad.fill(kPoisonByte);
  const std::vector<uint8_t> loss0 = b.loss.download(), grad0 = b.grad.download();
  fce_vp_shard sh;
  const fce_vp_shard* shard = flat::comm_shard(comm, V, 0, V, &sh);
  ASSERT_NE(shard, nullptr);
  fce_outputs out = flat::outputs(&o, b.loss.p<float>(), nullptr, nullptr, nullptr);
  fce_gradients g = flat::logit_grads(b.grad.ptr(), nullptr);
  const void* z = b.z.ptr();
  const void* y = b.y.ptr();
  auto call = [&](const fce_teacher* t, const void* logits, void* w, size_t wb,
                  const fce_vp_shard* shp) {
    return fce_nccl_distill(&o, t, shp, N, logits, y, &out, &g, w, wb, s);
  };
  auto expect = [&](fce_status want, const char* what, const fce_teacher* t, const void* logits,
                    void* w, size_t wb, const fce_vp_shard* shp) {
    EXPECT_EQ(call(t, logits, w, wb, shp), want) << what;
    const std::string m = fce_nccl_last_error();
    EXPECT_EQ(m.rfind("fce_nccl_distill: ", 0), 0u) << m;
    EXPECT_NE(m.find(what), std::string::npos) << m;
    EXPECT_EQ(m.find("fce_vp_"), std::string::npos) << m;  // no core call's name
  };
  auto bad = [&](fce_status want, const char* what) {
    expect(want, what, &te, z, b.ws.ptr(), wsb, shard);
  };
  // sizes, pointers and workspace
  expect(FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes", &te, z, b.ws.ptr(), wsb - 1, shard);
  expect(FCE_ERROR_NULL_POINTER, "workspace is NULL", &te, z, nullptr, wsb, shard);
  expect(FCE_ERROR_MISALIGNED, "workspace", &te, z, b.ws.p<char>() + 8, wsb, shard);
  expect(FCE_ERROR_NULL_POINTER, "teacher is NULL", nullptr, z, b.ws.ptr(), wsb, shard);
  expect(FCE_ERROR_NULL_POINTER, "logits is NULL", &te, nullptr, b.ws.ptr(), wsb, shard);
  expect(FCE_ERROR_NULL_POINTER, "shard is NULL", &te, z, b.ws.ptr(), wsb, nullptr);
  fce_vp_shard no_comm = sh;
  no_comm.context = nullptr;
  expect(FCE_ERROR_NULL_POINTER, "shard->context (the communicator) is NULL", &te, z, b.ws.ptr(),
         wsb, &no_comm);
  fce_vp_shard wide = sh;
  wide.vocab_start = 1;
  expect(FCE_ERROR_INVALID_ARGUMENT, "vocab_start", &te, z, b.ws.ptr(), wsb, &wide);
  fce_vp_shard two = sh;
  two.ranks = 2;
  expect(FCE_ERROR_INVALID_ARGUMENT, "shard->ranks (2)", &te, z, b.ws.ptr(), wsb, &two);
  fce_teacher t2 = te;
  t2.logits = nullptr;
  expect(FCE_ERROR_NULL_POINTER, "teacher->logits is NULL", &t2, z, b.ws.ptr(), wsb, shard);
  t2 = te;
  t2.row_stride = V - 1;
  expect(FCE_ERROR_INVALID_ARGUMENT, "teacher->row_stride (39)", &t2, z, b.ws.ptr(), wsb, shard);
  t2 = te;
  t2.logits = b.grad.ptr();  // the gradient written over the teacher's logits
  expect(FCE_ERROR_INVALID_ARGUMENT, "overlaps", &t2, z, b.ws.ptr(), wsb, shard);
  t2 = te;
  t2.logits = b.t.p<char>() + 2;
  expect(FCE_ERROR_MISALIGNED, "teacher->logits", &t2, z, b.ws.ptr(), wsb, shard);
  // the teacher and the options, checked by libfusedce's queries: under this call's name
  t2 = te;
  t2.temperature = 0.0f;
  expect(FCE_ERROR_INVALID_ARGUMENT, "teacher->temperature (0)", &t2, z, b.ws.ptr(), wsb, shard);
  t2 = te;
  t2.struct_size = 3;
  expect(FCE_ERROR_INVALID_ARGUMENT, "teacher->struct_size (3)", &t2, z, b.ws.ptr(), wsb, shard);
  o.label_smoothing = 0.1f;
  bad(FCE_ERROR_UNSUPPORTED, "options->label_smoothing is not supported by fce_nccl_distill");
  o.label_smoothing = 0.0f;
  o.row_stride = V - 1;
  bad(FCE_ERROR_INVALID_ARGUMENT, "options->row_stride (39)");
  o.row_stride = 0;
  // the outputs and gradients a distillation does not write
  out.argmax = b.ws.p<int64_t>();
  bad(FCE_ERROR_UNSUPPORTED, "outputs->argmax");
  out.argmax = nullptr;
  g.grad_lse = b.ws.p<float>();
  bad(FCE_ERROR_UNSUPPORTED, "gradients->grad_lse");
  g.grad_lse = nullptr;
  g.grad_hidden = b.ws.ptr();
  bad(FCE_ERROR_INVALID_ARGUMENT, "gradients->grad_hidden");
  g.grad_hidden = nullptr;
  out.loss = nullptr;
  bad(FCE_ERROR_NULL_POINTER, "outputs->loss is NULL");
  out.loss = b.loss.p<float>();
  // in place with another stride
  g.grad_logits = b.z.ptr();
  o.grad_row_stride = V + 8;
  bad(FCE_ERROR_INVALID_ARGUMENT, "in place");
  o.grad_row_stride = 0;
  g.grad_logits = b.grad.ptr();
  // the queries' own
  size_t q = 7;
  EXPECT_EQ(flat::nccl_distill_ws(&o, nullptr, comm, N, V, V, 1, &q), FCE_ERROR_NULL_POINTER);
  EXPECT_NE(
      std::string(fce_nccl_last_error()).find("fce_nccl_distill_workspace_size: teacher is NULL"),
      std::string::npos)
      << fce_nccl_last_error();
  t2 = te;
  t2.divergence = 9;
  EXPECT_EQ(flat::nccl_distill_ws(&o, &t2, comm, N, V, V, 1, &q), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error())
                .find("fce_nccl_distill_workspace_size: teacher->divergence (9)"),
            std::string::npos)
      << fce_nccl_last_error();
  EXPECT_EQ(q, 7u);
  ASSERT_TRUE(finish());
  EXPECT_EQ(b.loss.download(), loss0) << "a failing call wrote loss";
  EXPECT_EQ(b.grad.download(), grad0) << "a failing call wrote grad_logits";
  // and a good call clears the message
  ASSERT_TRUE(ok(call(&te, z, b.ws.ptr(), wsb, shard), "fce_nccl_distill"));
  EXPECT_STREQ(fce_nccl_last_error(), "");
  ASSERT_TRUE(finish());
}

// Rule 18 through fce_nccl_cross_entropy with options->vp_entropy on a one-rank communicator:
// the entropy and the gradient with grad_lse and grad_entropy equal fce_forward's; grad_lse
// without grad_logits is refused.
TEST(Nccl, EntropyAndRowGradientsMatchUnsharded) {
  REQUIRE_GPU();
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  const int64_t N = 24, V = 3001;
  std::mt19937_64 rng(18);
  std::normal_distribution<double> nd(0.0, 4.0);
  std::uniform_real_distribution<double> ud(-2.0, 2.0);
  std::vector<double> z(static_cast<size_t>(N * V)), gl(N), ge(N);
  std::vector<int64_t> y(static_cast<size_t>(N));
  for (double& v : z) v = static_cast<float>(nd(rng));
  for (int64_t r = 0; r < N; ++r) {
    y[size_t(r)] = r % 5 == 1 ? -100 : static_cast<int64_t>(rng() % uint64_t(V));
    gl[size_t(r)] = ud(rng);
    ge[size_t(r)] = ud(rng);
  }
  Dev zd(encode(FCE_FLOAT32, z), s), yd(encode_targets(FCE_INT64, y), s);
  Dev gld(encode(FCE_FLOAT32, gl), s), ged(encode(FCE_FLOAT32, ge), s);
  TestOptions o = FCE_OPTIONS_INIT;
  o.label_smoothing = 0.05f;
  o.reduction = FCE_REDUCTION_SUM;
  size_t wsb = 0;
  ASSERT_TRUE(ok(fce_forward_workspace_size(&o, N, V, &wsb), "fce_forward_workspace_size"));
  Dev ws(wsb, s), loss(4, s), ent(size_t(N) * 4, s), grad(size_t(N * V) * 4, s);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = ent.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad.ptr();
  g.grad_lse = gld.p<const float>();
  g.grad_entropy = ged.p<const float>();
  ASSERT_TRUE(
      ok(fce_forward(&o, N, V, zd.ptr(), yd.ptr(), &out, &g, ws.ptr(), wsb, s), "fce_forward"));
  const std::vector<double> ref_loss = decode(FCE_FLOAT32, loss.download());
  const std::vector<double> ref_ent = decode(FCE_FLOAT32, ent.download());
  const std::vector<double> ref_grad = decode(FCE_FLOAT32, grad.download());
  o.vp_entropy = 1;
  ASSERT_TRUE(ok(flat::nccl_ce_ws(&o, comm, N, V, V, 1, &wsb), "query"));
  Dev nws(wsb, s);
  loss.fill(kPoisonByte);
  ent.fill(kPoisonByte);
  grad.fill(kPoisonByte);
  fce_vp_shard sh;
  const fce_vp_shard* shard = flat::comm_shard(comm, V, 0, V, &sh);
  ASSERT_NE(shard, nullptr);
  ASSERT_TRUE(
      ok(fce_nccl_cross_entropy(&o, shard, N, zd.ptr(), yd.ptr(), &out, &g, nws.ptr(), wsb, s),
         "fce_nccl_cross_entropy"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, loss.download()), ref_loss, kTolF32, "loss"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, ent.download()), ref_ent, kTolF32, "entropy"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, grad.download()), ref_grad, kTolF32, "grad"));
  fce_gradients lone = FCE_GRADIENTS_INIT;
  lone.grad_lse = gld.p<const float>();
  EXPECT_EQ(
      fce_nccl_cross_entropy(&o, shard, N, zd.ptr(), yd.ptr(), &out, &lone, nws.ptr(), wsb, s),
      FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("gradients->grad_lse"), std::string::npos)
      << fce_nccl_last_error();
  ASSERT_TRUE(finish());
}

// Class probabilities (rule 19) through both calls on a one-rank communicator, whose shard of
// q is all of it: the loss, lse and gradients equal fce_forward's and fce_linear_ce's; and q's
// bytes are [rows, vocab_local] in the overlap check.
TEST(Nccl, ProbabilityTargetsMatchUnsharded) {
  REQUIRE_GPU();
  // (the linear calls make their float32 logits in GEMMs of other shapes: the linear suites'
  // float32 bound)
  constexpr double kLinTolF32 = 1e-4;
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  const int64_t N = 24, V = 3001, D = 40;
  std::mt19937_64 rng(19);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> z(size_t(N * V)), q(size_t(N * V)), h(size_t(N * D)), w(size_t(V * D));
  for (double& v : z) v = static_cast<float>(4.0 * nd(rng));
  for (double& v : h) v = static_cast<float>(nd(rng));
  for (double& v : w) v = static_cast<float>(0.2 * nd(rng));
  for (int64_t r = 0; r < N; ++r) {  // a softmax of random scores, a few classes exactly 0
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      double& v = q[size_t(r * V + j)];
      v = j % 7 == 3 ? 0.0 : std::exp(2.0 * nd(rng));
      sum += v;
    }
    for (int64_t j = 0; j < V; ++j) q[size_t(r * V + j)] /= sum;
  }
  Dev zd(encode(FCE_FLOAT32, z), s), qd(encode(FCE_FLOAT32, q), s);
  Dev hd(encode(FCE_FLOAT32, h), s), wd(encode(FCE_FLOAT32, w), s);
  TestOptions o = FCE_OPTIONS_INIT;
  o.target_dtype = FCE_FLOAT32;
  o.label_smoothing = 0.05f;
  o.z_loss_scale = 1e-3f;
  fce_vp_shard sh;
  const fce_vp_shard* shard = flat::comm_shard(comm, V, 0, V, &sh);
  ASSERT_NE(shard, nullptr);
  for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
    SCOPED_TRACE(red == FCE_REDUCTION_MEAN ? "mean" : "none");
    o.reduction = red;
    const size_t nl = red == FCE_REDUCTION_NONE ? size_t(N) : 1;
    Dev loss(nl * 4, s), lse(size_t(N) * 4, s), grad(size_t(N * V) * 4, s);
    Dev gh(size_t(N * D) * 4, s), gw(size_t(V * D) * 4, s);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    // fce_forward, then fce_nccl_cross_entropy
    size_t wsb = 0;
    ASSERT_TRUE(ok(fce_forward_workspace_size(&o, N, V, &wsb), "fce_forward_workspace_size"));
    Dev ws(wsb, s);
    ASSERT_TRUE(
        ok(fce_forward(&o, N, V, zd.ptr(), qd.ptr(), &out, &g, ws.ptr(), wsb, s), "fce_forward"));
    const std::vector<uint8_t> ref[3] = {loss.download(), lse.download(), grad.download()};
    ASSERT_TRUE(ok(flat::nccl_ce_ws(&o, comm, N, V, V, 1, &wsb), "query"));
    Dev nws(wsb, s);
    for (Dev* d : {&loss, &lse, &grad}) d->fill(kPoisonByte);
    ASSERT_TRUE(
        ok(fce_nccl_cross_entropy(&o, shard, N, zd.ptr(), qd.ptr(), &out, &g, nws.ptr(), wsb, s),
           "fce_nccl_cross_entropy"));
    const char* what[3] = {"loss", "lse", "grad_logits"};
    const std::vector<uint8_t> got[3] = {loss.download(), lse.download(), grad.download()};
    for (int k = 0; k < 3; ++k)
      EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got[k]), decode(FCE_FLOAT32, ref[k]),
                                 kTolF32, what[k]));
    // fce_linear_ce, then fce_nccl_linear_ce
    fce_gradients lg = FCE_GRADIENTS_INIT;
    lg.grad_hidden = gh.ptr();
    lg.grad_weight = gw.ptr();
    size_t lo = 0, hi = 0;
    ASSERT_TRUE(ok(fce_linear_ce_workspace_size(&o, N, D, V, 1, &lo, &hi), "linear query"));
    Dev lws(hi, s);
    ASSERT_TRUE(ok(fce_linear_ce(&o, N, D, V, hd.ptr(), wd.ptr(), nullptr, qd.ptr(), &out, &lg,
                                 lws.ptr(), hi, s),
                   "fce_linear_ce"));
    const std::vector<uint8_t> lref[3] = {loss.download(), gh.download(), gw.download()};
    ASSERT_TRUE(ok(flat::nccl_linear_ws(&o, comm, N, D, V, V, 1, &lo, &hi), "nccl linear query"));
    Dev nlws(hi, s);
    for (Dev* d : {&loss, &gh, &gw}) d->fill(kPoisonByte);
    ASSERT_TRUE(ok(fce_nccl_linear_ce(&o, shard, N, D, hd.ptr(), wd.ptr(), nullptr, qd.ptr(),
                                      &out, &lg, nlws.ptr(), hi, s),
                   "fce_nccl_linear_ce"));
    const char* lwhat[3] = {"linear loss", "grad_hidden", "grad_weight"};
    const std::vector<uint8_t> lgot[3] = {loss.download(), gh.download(), gw.download()};
    for (int k = 0; k < 3; ++k)
      EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, lgot[k]), decode(FCE_FLOAT32, lref[k]),
                                 kLinTolF32, lwhat[k]));
  }
  // a gradient 256 bytes past q's start overlaps it (q: rows x vocab_local elements)
  o.reduction = FCE_REDUCTION_MEAN;
  Dev both(2 * size_t(N * V) * 4, s), loss(4, s);
  char* base = both.p<char>();
  size_t wsb = 0;
  ASSERT_TRUE(ok(flat::nccl_ce_ws(&o, comm, N, V, V, 1, &wsb), "query"));
  Dev nws(wsb, s);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = base + 256;
  EXPECT_EQ(fce_nccl_cross_entropy(&o, shard, N, zd.ptr(), base, &out, &g, nws.ptr(), wsb, s),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_nccl_last_error()).find("targets"), std::string::npos)
      << fce_nccl_last_error();
  ASSERT_TRUE(finish());
}

// Both calls captured in CUDA graphs after an eager call; two replays give the eager bits.
TEST(Nccl, GraphCaptureReplays) {
  REQUIRE_GPU();
  for (int dt : {FCE_FLOAT32, FCE_BFLOAT16}) {
    CeCase c;
    c.name = "graph";
    c.dtype = dt;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.ignore = 0.1;
    c.argmax = true;
    c.seed = 201 + dt;
    SCOPED_TRACE(label(c));
    const CeData d = ce_data(c);
    CeOut ref, got;
    ASSERT_TRUE(ce_reference(c, d, &ref));
    ASSERT_TRUE(ce_nccl(c, d, &got, true));
    expect_ce_equal(c, got, ref);

    LinCase l;
    l.name = "graph";
    l.dtype = dt;
    l.eps = 0.1f;
    l.lambda = 1e-4f;
    l.ignore = 0.1;
    l.argmax = true;
    l.seed = 211 + dt;
    SCOPED_TRACE(label(l));
    const LinData ld = lin_data(l);
    LinOut lref, lgot;
    ASSERT_TRUE(lin_reference(l, ld, &lref));
    ASSERT_TRUE(lin_nccl(l, ld, &lgot, true));
    expect_lin_equal(l, ld, lgot, lref);
  }
}

// ------------------------------------------------------------------ several GPUs ------------
namespace {

// What one rank computed (host copies), or why it failed.
struct RankOut {
  std::string error;
  CeOut ce;
  LinOut lin;
};

// A rank on device dev: the logits' columns [start, start + local) of the cross-entropy case,
// the weight's rows [lstart, lstart + llocal) of the linear case; each call then captured in a
// CUDA graph and replayed (replay_matches).
void run_rank(ncclComm_t comm, int dev, int64_t start, int64_t local, int64_t lstart,
              int64_t llocal, const CeCase& c, const CeData& cd, const LinCase& l,
              const LinData& ld, RankOut* out) {
  if (cudaSetDevice(dev) != cudaSuccess) {
    out->error = "cudaSetDevice";
    return;
  }
  cudaStream_t s;
  FCE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    // cross-entropy: this rank's columns, dense [N, local]
    CeData part = cd;
    part.z = columns(cd.z, c.N, c.V, start, local);
    CeCase pc = c;
    pc.V = local;  // the shard's buffers (sizes of the outputs: per row / scalar)
    CeDev b = ce_alloc(pc, part, s);
    if (c.weights) b.w = Dev(encode(FCE_FLOAT32, cd.w), s);  // the WHOLE vocabulary's
    TestOptions o = ce_options(c);
    o.class_weights = c.weights ? b.w.p<float>() : nullptr;
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
    size_t wsb = 0;
    fce_status st = flat::nccl_ce_ws(&o, comm, c.N, c.V, local, 1, &wsb);
    auto call = [&] {
      return flat::nccl_cross_entropy(&o, comm, c.N, c.V, start, local, b.z.ptr(), b.y.ptr(),
                                    b.loss.p<float>(), b.lse.p<float>(), b.zl.p<float>(),
                                    b.grad.ptr(), b.g.p<float>(), b.flags.p<uint32_t>(),
                                    b.ws.ptr(), wsb, s);
    };
    if (st == FCE_SUCCESS) {
      b.ws = Dev(wsb, s);
      b.poison();
      st = call();
    }
    if (st != FCE_SUCCESS) {
      out->error = fce_nccl_last_error();
      return;  // (the other ranks wait in the collective: the test times out)
    }
    FCE_CUDA_CHECK(cudaStreamSynchronize(s));
    out->ce = b.download(false);
    out->error = replay_matches(
        s, call, [&] { b.poison(); }, [&] { return bits(b.download(false)); }, bits(out->ce));
    if (!out->error.empty()) {
      out->error = "cross-entropy: " + out->error;
      return;
    }
  }
  {
    // linear: this rank's rows of W and b
    const int64_t D = l.D;
    LinData part = ld;
    part.W.assign(ld.W.begin() + lstart * D, ld.W.begin() + (lstart + llocal) * D);
    part.b.assign(ld.b.begin() + lstart, ld.b.begin() + lstart + llocal);
    part.gw0.assign(ld.gw0.begin() + lstart * D, ld.gw0.begin() + (lstart + llocal) * D);
    part.gb0.assign(ld.gb0.begin() + lstart, ld.gb0.begin() + lstart + llocal);
    LinCase pc = l;
    pc.V = llocal;
    LinDev b = lin_alloc(pc, part, s);
    TestOptions o = lin_options(l);
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
    size_t mn = 0, opt = 0;
    fce_status st =
        flat::nccl_linear_ws(&o, comm, l.N, l.D, l.V, llocal, 1, &mn, &opt);
    auto call = [&] {
      return flat::nccl_linear_ce(&o, comm, l.N, l.D, l.V, lstart, llocal, b.h.ptr(), b.W.ptr(),
                                b.b.ptr(), b.y.ptr(), b.loss.p<float>(), b.lse.p<float>(),
                                b.zl.p<float>(), b.gh.ptr(), b.gw.ptr(), b.gb.ptr(),
                                b.g.p<float>(), b.flags.p<uint32_t>(), b.ws.ptr(), opt, s);
    };
    if (st == FCE_SUCCESS) {
      b.ws = Dev(opt, s);
      b.poison();
      st = call();
    }
    if (st != FCE_SUCCESS) {
      out->error = fce_nccl_last_error();
      return;
    }
    FCE_CUDA_CHECK(cudaStreamSynchronize(s));
    out->lin = b.download();
    out->error = replay_matches(
        s, call, [&] { b.poison(); }, [&] { return bits(b.download()); }, bits(out->lin));
    if (!out->error.empty()) {
      out->error = "linear: " + out->error;
      return;
    }
  }
  FCE_CUDA_CHECK(cudaStreamDestroy(s));
}

// A rank on device dev: the columns [start, start + local) of the distillation case's student
// and teacher, its call then captured in a CUDA graph and replayed.
void dist_rank(ncclComm_t comm, int dev, int64_t start, int64_t local, const DistCase& c,
               const DistData& d, std::string* error, CeOut* out) {
  if (cudaSetDevice(dev) != cudaSuccess) {
    *error = "cudaSetDevice";
    return;
  }
  cudaStream_t s;
  FCE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    DistData part = d;
    part.z = columns(d.z, c.N, c.V, start, local);
    part.t = columns(d.t, c.N, c.V, start, local);
    DistCase pc = c;
    pc.V = local;  // the shard's buffers
    DistDev b = dist_alloc(pc, part, s);
    const ::testing::AssertionResult r = dist_nccl_on(comm, s, pc, b, c.V, start, out, true);
    if (!r) *error = r.message();  // (the other ranks wait in the collective: the test times out)
  }
  FCE_CUDA_CHECK(cudaStreamDestroy(s));
}

// The number of GPUs (ranks) a test over several of them runs on, up to 4; 0, after a line
// saying so, when there are fewer than 2.
int several_gpus(const char* test) {
  const int P = std::min(device_count(), 4);
  if (P >= 2) return P;
  std::printf("SKIPPED: %s needs 2 or more CUDA devices (%d here)\n", test, device_count());
  return 0;
}

// Uneven shards of [0, V) (the last the largest), in the reverse of the rank order.
void split(int P, int64_t V, std::vector<int64_t>* start, std::vector<int64_t>* size) {
  start->assign(P, 0);
  size->assign(P, 0);
  int64_t at = 0;
  for (int k = 0; k < P; ++k) {  // shard k goes to rank P-1-k
    const int64_t n = k + 1 < P ? V / P - 7 * (k + 1) : V - at;
    (*start)[P - 1 - k] = at;
    (*size)[P - 1 - k] = n;
    at += n;
  }
}

// rank(r, comm, device) on P host threads, rank r on GPU r of a communicator over GPUs 0..P-1.
template <class Rank>
void on_ranks(int P, Rank rank) {
  std::vector<int> devs(P);
  for (int r = 0; r < P; ++r) devs[r] = r;
  std::vector<ncclComm_t> comms(P);
  NCCL_CHECK(ncclCommInitAll(comms.data(), P, devs.data()));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) threads.emplace_back(rank, r, comms[r], devs[r]);
  for (auto& t : threads) t.join();
  for (auto& cm : comms) ncclCommDestroy(cm);
  FCE_CUDA_CHECK(cudaSetDevice(0));
}

}  // namespace

TEST(Nccl, ShardedOverSeveralGpus) {
  REQUIRE_GPU();
  const int P = several_gpus("Nccl.ShardedOverSeveralGpus");
  if (P == 0) GTEST_SKIP() << "one CUDA device";
  for (int dt : {FCE_FLOAT32, FCE_BFLOAT16}) {
    CeCase c;
    c.name = "sharded";
    c.dtype = dt;
    c.eps = 0.1f;
    c.lambda = 1e-3f;
    c.ignore = 0.2;
    c.weights = true;
    c.argmax = true;
    c.seed = 301 + dt;
    LinCase l;
    l.name = "sharded";
    l.dtype = dt;
    l.eps = 0.1f;
    l.lambda = 1e-3f;
    l.ignore = 0.2;
    l.argmax = true;
    l.seed = 311 + dt;
    SCOPED_TRACE(label(c) + " / " + label(l) + " over " + std::to_string(P) + " GPUs");
    const CeData cd = ce_data(c);
    const LinData ld = lin_data(l);
    FCE_CUDA_CHECK(cudaSetDevice(0));
    CeOut cref;
    LinOut lref;
    ASSERT_TRUE(ce_reference(c, cd, &cref));
    ASSERT_TRUE(lin_reference(l, ld, &lref));
    std::vector<int64_t> cs, cn, ls, ln;
    split(P, c.V, &cs, &cn);
    split(P, l.V, &ls, &ln);
    std::vector<RankOut> outs(P);
    on_ranks(P, [&](int r, ncclComm_t comm, int dev) {
      run_rank(comm, dev, cs[r], cn[r], ls[r], ln[r], c, cd, l, ld, &outs[r]);
    });
    for (int r = 0; r < P; ++r) ASSERT_EQ(outs[r].error, "") << "rank " << r;
    // the loss (and everything fce_vp_loss writes): the same bits on every rank
    for (int r = 1; r < P; ++r) {
      EXPECT_EQ(outs[r].ce.loss, outs[0].ce.loss) << "rank " << r;
      EXPECT_EQ(outs[r].ce.lse, outs[0].ce.lse) << "rank " << r;
      EXPECT_EQ(outs[r].ce.argmax, outs[0].ce.argmax) << "rank " << r;
      EXPECT_EQ(outs[r].lin.loss, outs[0].lin.loss) << "rank " << r;
      EXPECT_EQ(outs[r].lin.gh, outs[0].lin.gh) << "rank " << r << " grad_hidden";
    }
    // the shards' gradients put together: the unsharded call's
    const size_t N = static_cast<size_t>(c.N), es = dtype_size(dt), D = static_cast<size_t>(l.D);
    CeOut cat = outs[0].ce;
    cat.grad.assign(N * static_cast<size_t>(c.V) * es, 0);
    LinOut lcat = outs[0].lin;
    lcat.gw.assign(static_cast<size_t>(l.V) * D * es, 0);
    lcat.gb.assign(static_cast<size_t>(l.V) * es, 0);
    for (int r = 0; r < P; ++r) {
      for (size_t row = 0; row < N; ++row)
        std::memcpy(cat.grad.data() + (row * c.V + cs[r]) * es,
                    outs[r].ce.grad.data() + row * cn[r] * es, cn[r] * es);
      std::memcpy(lcat.gw.data() + ls[r] * D * es, outs[r].lin.gw.data(), ln[r] * D * es);
      std::memcpy(lcat.gb.data() + ls[r] * es, outs[r].lin.gb.data(), ln[r] * es);
      uint32_t f = 0;
      std::memcpy(&f, outs[r].ce.flags.data(), 4);
      EXPECT_EQ(f, 0u) << "rank " << r << " error_flags";
    }
    expect_ce_equal(c, cat, cref);
    expect_lin_equal(l, ld, lcat, lref);
  }
}

// The distillation over the same uneven shards, one thread per rank: every rank's loss and lse
// are the same bits, the shards' gradients put together are fce_distill's, and each rank's call,
// its rounds' all-gathers included, replays from a CUDA graph bit for bit.
TEST(Nccl, DistillShardedOverSeveralGpus) {
  REQUIRE_GPU();
  const int P = several_gpus("Nccl.DistillShardedOverSeveralGpus");
  if (P == 0) GTEST_SKIP() << "one CUDA device";
  std::vector<DistCase> cases = {
      dist_case("forward KL", FCE_DIVERGENCE_FORWARD_KL, 2.0f, FCE_REDUCTION_MEAN, 0.2),
      dist_case("reverse KL, sum", FCE_DIVERGENCE_REVERSE_KL, 0.5f, FCE_REDUCTION_SUM, 0.1),
      dist_case("JSD, none", FCE_DIVERGENCE_JSD, 2.0f, FCE_REDUCTION_NONE, 0.25),
      dist_case("JSD, no targets", FCE_DIVERGENCE_JSD, 1.5f)};
  cases[0].dtype = cases[3].dtype = FCE_BFLOAT16;
  cases[3].targets = false;
  uint64_t seed = 700;
  for (DistCase& c : cases) {
    c.seed = ++seed;
    SCOPED_TRACE(label(c) + " over " + std::to_string(P) + " GPUs");
    const DistData d = dist_data(c);
    FCE_CUDA_CHECK(cudaSetDevice(0));
    CeOut ref;
    ASSERT_TRUE(dist_reference(c, d, &ref));
    std::vector<int64_t> start, size;
    split(P, c.V, &start, &size);
    std::vector<CeOut> outs(P);
    std::vector<std::string> errors(P);
    on_ranks(P, [&](int r, ncclComm_t comm, int dev) {
      dist_rank(comm, dev, start[r], size[r], c, d, &errors[r], &outs[r]);
    });
    for (int r = 0; r < P; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    for (int r = 1; r < P; ++r) {
      EXPECT_EQ(outs[r].loss, outs[0].loss) << "rank " << r;
      EXPECT_EQ(outs[r].lse, outs[0].lse) << "rank " << r;
      EXPECT_EQ(outs[r].flags, outs[0].flags) << "rank " << r;
    }
    const size_t N = static_cast<size_t>(c.N), es = dtype_size(c.dtype);
    CeOut cat = outs[0];
    cat.grad.assign(N * static_cast<size_t>(c.V) * es, 0);
    for (int r = 0; r < P; ++r)
      for (size_t row = 0; row < N; ++row)
        std::memcpy(cat.grad.data() + (row * c.V + start[r]) * es,
                    outs[r].grad.data() + row * size[r] * es, size[r] * es);
    expect_dist_equal(c, cat, ref);
  }
}
